"""``Engine`` over vLLM's in-process ``AsyncLLM`` (V1), with weight updates that never restart it.

Design:
- token in, token out: prompts go in as ``TokensPrompt``; the sampled ids, the logprob of each
  sampled token (``logprobs=0``) and the final output only (``FINAL_ONLY``: no per-step copies on
  the event loop) come back. Nothing is decoded.
- versions: vLLM's engine core labels every step's outputs with its current *weight version*
  and changes the label only while generation is paused; the final ``CompletionOutput`` carries
  the spans ``[start, end) -> label``. The label is ``str(policy_version)``, so each token's
  version is the one whose weights computed it, exact even for tokens that were in the output
  pipe while the update ran. On a vLLM without these spans (0.24, the GPU build), ``keep``
  updates abort the running requests and continue them as the ``abort`` path below does, but
  without recomputing their KV: a request keeps the prefix-cache salt of its first submission, the
  cache is not cleared, so its continuation finds every full block of prompt + tokens so far still
  cached (what ``keep`` means: old KV, new weights from here on), and the labels stay exact.
  The same holds across an episode's turns (``SamplingSettings.kv_scope``): a later turn takes
  the salt its episode's first turn had, so after a ``keep`` update it recomputes only what is new
  since its last turn, not its whole context. Its KV is never older than its oldest token, which
  ``max_staleness`` bounds. An ``abort`` update forgets every episode's salt.
- weight update (``load_weights``): validate names/shapes/dtypes against the checkpoint first
  (nothing touched on error), write one safetensors file to a temp dir on /dev/shm (RAM), pause
  the scheduler (``keep``: requests stay frozen with their KV; ``abort``: vLLM aborts them),
  ``collective_rpc("reload_weights_tied", weights_path=...)`` in every worker (vLLM's in-place
  ``reload_weights``, then the refresh of an output layer tied to the embedding:
  ``vllm_worker``), relabel, resume.
  Prefetch (``prefetch_weights``, on by default): before pausing, every worker copies the file's
  tensors onto its device while generation goes on, so the pause holds only device-to-device
  copies (`vllm_reload`).
  If the reload fails the last good weights are reloaded and the version stays unchanged.
- file hand-over (``load_weights_file``): when the learner runs on this machine it writes the new
  weights as a safetensors file on /dev/shm itself, and the engine reloads straight from it after
  checking its header: no bytes cross a socket and nothing is staged again (the fast path on GPU).
- ``abort`` continuation: ``generate`` sees its request finish with "abort" because of the
  update, waits for the new weights and resubmits prompt + tokens so far with the remaining
  ``max_tokens``; the caller gets one ``Generation`` with old then new versions. Prefix caching
  is salted with the policy version so a new request, or one continued in ``abort`` mode, never
  reuses KV blocks computed with old weights.
- LoRA (``lora_rank`` > 0): an update whose tensors are an adapter (`protocol.adapters`) is served
  beside the base weights (`vllm_adapters`): no pause, no reload; new submissions use it, running
  ones finish with the adapter they started with (``abort``: are continued with the new one).
- lifecycle: ``await VllmEngine.start(settings)``; ``await engine.shutdown()`` stops the engine
  core and worker processes and waits (bounded) until none of them survives.
vLLM is imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from common.safetensors_buffers import model_manifest, read_header
from protocol.adapters import ADAPTER_FILE, is_adapter_update
from rollout_service.engine import vllm_adapters, vllm_worker
from rollout_service.engine.base import (
    FinishReason,
    Generation,
    SamplingSettings,
    UpdateMode,
    WeightUpdateError,
    check_logprobs,
)
from rollout_service.engine.kv_reuse import Reuse, Salts, salt
from rollout_service.engine.vllm_adapters import AdapterSlots
from rollout_service.engine.vllm_compat import resolve_dtype, set_platform_env, vllm_info
from rollout_service.engine.vllm_reload import WorkerReload
from rollout_service.engine.vllm_weights import (
    Checkpoint,
    check_newer,
    read_checkpoint,
    stage_root,
    stage_safetensors,
    write_safetensors,
)

if TYPE_CHECKING:
    import numpy as np
    from vllm.v1.engine.async_llm import AsyncLLM

    from common.config import ActorRolloutRefConfig
    from protocol.weights import ModelManifest

log = logging.getLogger(__name__)

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
SHUTDOWN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class VllmEngineSettings:
    """What the engine is built from (``RolloutConfig``'s engine keys plus the model path)."""

    model: str
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.3
    dtype: str = "float32"
    enforce_eager: bool = True
    compilation_config: dict[str, Any] | None = None  # vLLM's keys; used when not enforce_eager
    tensor_model_parallel_size: int = 1
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: vLLM's default for the device
    trust_remote_code: bool = False
    initial_version: int = 0
    # processed: after temperature, i.e. the distribution the token was sampled from (what the
    # learner's importance ratio needs when it divides its logits by the same temperature).
    logprobs_mode: LogprobsMode = "processed_logprobs"
    shm_dir: str | None = None  # where update files are staged; None: /dev/shm if present
    lora_rank: int = 0  # > 0: serve LoRA adapters up to this rank (adapter-only weight updates)
    lora_alpha: int = 16  # the adapters' scaling numerator (peft's lora_alpha)
    prefetch_weights: bool = True  # copy a full update onto the device before pausing

    @classmethod
    def from_config(
        cls, actor_rollout_ref: ActorRolloutRefConfig, **overrides: Any
    ) -> VllmEngineSettings:
        rollout = actor_rollout_ref.rollout
        values: dict[str, Any] = {
            "model": actor_rollout_ref.model.path,
            "max_model_len": rollout.max_model_len,
            "gpu_memory_utilization": rollout.gpu_memory_utilization,
            "dtype": rollout.dtype,
            "enforce_eager": rollout.enforce_eager,
            "compilation_config": rollout.compilation_config,
            "tensor_model_parallel_size": rollout.tensor_model_parallel_size,
            "seed": rollout.seed,
            "max_num_seqs": rollout.max_num_seqs,
            "trust_remote_code": actor_rollout_ref.model.trust_remote_code,
            "prefetch_weights": rollout.prefetch_weights,
        }
        model = actor_rollout_ref.model
        if model.lora_rank > 0 and not model.lora.merge:
            values |= {"lora_rank": model.lora_rank, "lora_alpha": model.lora_alpha}
        values.update(overrides)
        return cls(**values)


@dataclass
class _Request:
    """One caller request; it may span several vLLM submissions (abort-mode continuations)."""

    request_id: str
    vllm_id: str = ""
    user_aborted: bool = False
    preempted: bool = False  # aborted by a weight update: generate() continues it
    lora_id: int = 0  # the adapter its current submission samples with (0: none)
    salt: str = ""  # prefix-cache salt its KV blocks are cached under ("": set at submission)
    submissions: int = 0  # to vLLM so far (more than one: continued after weight updates)
    reuse: Reuse = dataclasses.field(default_factory=Reuse)  # its submissions on older KV


class VllmEngine:
    """``base.Engine`` backed by an in-process ``AsyncLLM``; see the module docstring."""

    def __init__(
        self,
        llm: AsyncLLM,
        settings: VllmEngineSettings,
        *,
        version_labels: bool,
        checkpoint: Checkpoint,
        child_pids: frozenset[int],
    ) -> None:
        self._llm = llm
        self._settings = settings
        self._version = settings.initial_version
        self._version_labels = version_labels
        self._checkpoint = checkpoint
        self._child_pids = child_pids
        self._requests: dict[str, _Request] = {}
        self._serial = itertools.count()
        self._update_lock = asyncio.Lock()
        self._ready = asyncio.Event()  # cleared while weights are being swapped
        self._ready.set()
        self.last_update_timings: dict[str, float] = {}  # breakdown of the last load_weights
        self._manifest: ModelManifest | None = None  # weight_manifest, read at its first use
        self.worker_reload = WorkerReload(
            llm, Path(settings.model), prefetch=settings.prefetch_weights
        )
        self._pause_s = self._resume_s = 0.0  # pause_generation and resume of the last swap
        self.continuations = Reuse()  # requests continued after a swap (kv_reuse)
        self.later_turns = Reuse()  # episodes' turns on KV from before a swap
        self._salts = Salts()
        self._adapters = AdapterSlots(llm, settings.lora_alpha, settings.model)
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    async def start(cls, settings: VllmEngineSettings) -> VllmEngine:
        """Builds the AsyncLLM (engine-core and worker processes); tens of seconds on CPU."""
        import psutil

        set_platform_env()
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        llm = _build_async_llm(settings)
        # multiprocessing's resource tracker is shared by the whole process and outlives vLLM.
        children = {
            p.pid
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and not _is_resource_tracker(p)
        }
        version_labels = vllm_info().weight_version_spans
        engine = cls(
            llm,
            settings,
            version_labels=version_labels,
            checkpoint=read_checkpoint(Path(settings.model)),
            child_pids=frozenset(children),
        )
        del llm  # the engine owns it: shutdown() must be able to drop the last reference
        if version_labels:
            await engine._llm.update_weight_version(str(settings.initial_version))
        return engine

    @classmethod
    async def from_config(
        cls, actor_rollout_ref: ActorRolloutRefConfig, **overrides: Any
    ) -> VllmEngine:
        return await cls.start(VllmEngineSettings.from_config(actor_rollout_ref, **overrides))

    async def shutdown(self) -> None:
        """Stops vLLM and waits until its child processes are gone (kills stragglers)."""
        if self._closed:
            return
        self._closed = True
        self._llm.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        # AsyncLLM.__del__ shuts down again; at interpreter exit that fails noisily, so let the
        # object go now, while the interpreter is whole.
        del self._llm
        gc.collect()
        await _reap(self._child_pids)
        self.worker_reload.close()
        self._adapters.close()

    async def __aenter__(self) -> VllmEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def child_pids(self) -> frozenset[int]:
        """Processes vLLM started (engine core, workers): for shutdown checks."""
        return self._child_pids

    @property
    def async_llm(self) -> AsyncLLM:
        return self._llm

    @property
    def adapters_staged(self) -> set[int]:
        """vLLM ids of the LoRA adapters whose files are kept (`vllm_adapters`)."""
        return self._adapters.staged

    @property
    def weight_manifest(self) -> ModelManifest:
        """Every tensor an update must carry (names, dtypes, shapes of the checkpoint it runs; read
        once), checked before anything is received; with LoRA, adapters up to the served rank."""
        if self._manifest is None:
            manifest = model_manifest(self._settings.model)
            self._manifest = dataclasses.replace(manifest, lora_max_rank=self._settings.lora_rank)
        return self._manifest

    # -- Engine protocol -----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def swapping_weights(self) -> bool:
        """True while generation is paused for a weight swap (new submissions wait for it)."""
        return not self._ready.is_set()

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:
        if self._closed:
            raise RuntimeError("the vLLM engine is shut down")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        start = time.perf_counter()
        req = _Request(request_id, salt=self._salts.of(sampling.kv_scope))
        self._requests[request_id] = req
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish: FinishReason = "abort"
        stop_string: str | None = None
        waited = 0.0
        try:
            while True:
                t_wait = time.perf_counter()
                await self._ready.wait()  # no submission while weights are being swapped
                waited += time.perf_counter() - t_wait
                if req.user_aborted:
                    break
                remaining = sampling.max_tokens - len(tokens)
                # Only an update that starts after this point may mark this submission preempted.
                req.preempted = False
                out = await self._submit(req, [*prompt_ids, *tokens], sampling, remaining)
                tokens += out.token_ids
                logprobs += out.logprobs
                versions += out.versions
                finish, stop_string = out.finish_reason, out.stop_string
                if finish != "abort" or not req.preempted or req.user_aborted:
                    break
                if len(tokens) >= sampling.max_tokens:
                    finish = "length"
                    break
        finally:
            del self._requests[request_id]
        return Generation(
            token_ids=tokens,
            logprobs=logprobs,
            versions=versions,
            finish_reason=finish,
            stop_token_included=finish == "stop",
            stop_string=stop_string,
            timings={"total_s": time.perf_counter() - start, "weight_update_wait_s": waited},
            reuse_sent=req.reuse.tokens,
            reuse_cached=req.reuse.cached_tokens,
        )

    async def abort(self, request_ids: Sequence[str]) -> None:
        vllm_ids = []
        for rid in request_ids:
            if (req := self._requests.get(rid)) is not None:
                req.user_aborted = True
                if req.vllm_id:
                    vllm_ids.append(req.vllm_id)
        if vllm_ids:
            await self._llm.abort(vllm_ids)

    # -- weights -------------------------------------------------------------------------------

    async def load_weights(
        self, version: int, tensors: list[tuple[str, np.ndarray]], *, mode: UpdateMode
    ) -> float:
        """Swaps in new weights as ``version``; returns the seconds taken. All or nothing: on any
        error the previous weights and ``policy_version`` stay and ``WeightUpdateError`` says why.
        An adapter (`protocol.adapters` names) is served beside the base weights instead."""
        start = time.perf_counter()
        if is_adapter_update([name for name, _ in tensors]):
            specs = [(n, a.shape, a.dtype.name) for n, a in tensors]
            return await self._load_adapter(
                version, specs, lambda d: write_safetensors(tensors, d / ADAPTER_FILE), mode, start
            )
        async with self._updating(mode):
            self._checkpoint.check(
                version, self._version, [(n, a.shape, a.dtype.name) for n, a in tensors]
            )
            checked = time.perf_counter()
            nbytes = sum(array.nbytes for _, array in tensors)
            staged = await asyncio.to_thread(
                stage_safetensors, tensors, stage_root(self._settings.shm_dir, nbytes)
            )
            staged_at = time.perf_counter()
            try:
                await self.worker_reload.prefetch(staged)
                prefetched = time.perf_counter()
                await self._swap_to_end(version, staged, mode)
            finally:
                self.worker_reload.adopt(self._version == version, staged=staged)
        end = time.perf_counter()
        self.last_update_timings = self._swap_timings(
            check_s=checked - start,
            stage_s=staged_at - checked,
            prefetch_s=prefetched - staged_at,
            swap_s=end - prefetched,
            total_s=end - start,
            bytes=float(nbytes),
        )
        return end - start

    async def load_weights_file(self, version: int, path: str, *, mode: UpdateMode) -> float:
        """Swaps in ``version`` from a safetensors file on this machine (the learner's file
        hand-over); returns the seconds taken. All or nothing, like ``load_weights``. The file's
        directory must hold no other weights; it is not copied, so the caller keeps it until the
        next version is applied (it is also the rollback source while it exists)."""

        start = time.perf_counter()
        try:
            header = read_header(path)
            nbytes = Path(path).stat().st_size
        except (OSError, ValueError, KeyError) as e:
            raise WeightUpdateError(f"cannot read the weights file {path}: {e}") from e
        if is_adapter_update(list(header)):
            specs = [(n, shape, dtype) for n, (dtype, shape) in header.items()]
            return await self._load_adapter(
                version, specs, lambda d: shutil.copyfile(path, d / ADAPTER_FILE), mode, start
            )
        async with self._updating(mode):
            self._checkpoint.check(
                version, self._version, [(n, shape, dtype) for n, (dtype, shape) in header.items()]
            )
            checked = time.perf_counter()
            folder = Path(path).parent
            try:
                await self.worker_reload.prefetch(folder)
                prefetched = time.perf_counter()
                await self._swap_to_end(version, folder, mode)
            finally:
                self.worker_reload.adopt(self._version == version, file_dir=folder)
        end = time.perf_counter()
        self.last_update_timings = self._swap_timings(
            check_s=checked - start,
            stage_s=0.0,
            prefetch_s=prefetched - checked,
            swap_s=end - prefetched,
            total_s=end - start,
            bytes=float(nbytes),
        )
        return end - start

    def _swap_timings(self, **parts: float) -> dict[str, float]:
        """An update's breakdown: ``parts`` and what the swap inside it recorded."""
        swap = {"pause_s": self._pause_s, "resume_s": self._resume_s}
        return {**parts, **self.worker_reload.timings(), **swap}

    async def _load_adapter(
        self,
        version: int,
        specs: list[tuple[str, tuple[int, ...], str]],
        write: Callable[[Path], object],
        mode: UpdateMode,
        start: float,
    ) -> float:
        """``version`` as a LoRA adapter beside the base weights (`vllm_adapters`), without a pause:
        new submissions use it; running ones keep theirs (``keep``) or continue with it (``abort``)."""
        async with self._updating(mode):
            entered = time.perf_counter()
            check_newer(version, self._version)
            # a server without lora_rank is refused here too, by the manifest (lora_max_rank 0)
            request = await self._adapters.add(
                version,
                specs,
                write,
                stage_root(self._settings.shm_dir, 0),
                self.weight_manifest,
                in_use={r.lora_id for r in self._requests.values()},
            )
            loaded = time.perf_counter()
            running = list(self._requests.values())
            if mode == "abort":
                for req in running:  # generate() continues them with the new adapter
                    req.preempted = True
            self._adapters.current = request
            self._version = version
            if mode == "abort" and (ids := [r.vllm_id for r in running if r.vllm_id]):
                await self._llm.abort(ids)
        end = time.perf_counter()
        self.last_update_timings = {
            **self._adapters.last_timings,  # stage_s, add_s (vLLM's add_lora; 0 after the first)
            "wait_s": entered - start,  # for the update before it (one at a time)
            "reload_s": loaded - start,  # waited for, checked, staged and loaded by add_lora
            "total_s": end - start,
            "bytes": float(self._adapters.nbytes(specs)),
        }
        return end - start

    @contextlib.asynccontextmanager
    async def _updating(self, mode: UpdateMode) -> AsyncIterator[None]:
        """One weight update at a time, on a running engine."""
        if mode not in ("abort", "keep"):
            raise ValueError(f"mode must be 'abort' or 'keep', not {mode!r}")
        async with self._update_lock:
            if self._closed:
                raise WeightUpdateError("the engine is shut down")
            yield

    async def _swap_to_end(self, version: int, folder: Path, mode: UpdateMode) -> None:
        """The swap is not interruptible: a cancelled caller waits for it to finish, so the
        workers never keep half-loaded weights and generation is always resumed; then the
        cancellation goes on."""
        swap = asyncio.ensure_future(self._swap(version, folder, mode))
        try:
            await asyncio.shield(swap)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await swap
            raise

    async def _swap(self, version: int, staged: Path, mode: UpdateMode) -> None:
        keep = mode == "keep"
        frozen = keep and self._version_labels  # vLLM keeps them with their KV and relabels
        self._ready.clear()
        try:
            if not frozen:
                # Mark before pausing: their "abort" outputs may arrive before pause returns.
                for req in self._requests.values():
                    req.preempted = True
                    if not keep:  # its continuation recomputes its KV with the new weights
                        req.salt = ""
            if not keep:
                self._salts.forget()
            t_pause = time.perf_counter()
            await self._llm.pause_generation(
                mode="keep" if frozen else "abort", clear_cache=not keep
            )
            self._pause_s = time.perf_counter() - t_pause
            try:
                await self.worker_reload.reload(staged)
            except Exception as e:
                await self.worker_reload.rollback()
                raise WeightUpdateError(
                    f"reloading weights for version {version} failed: {e}"
                ) from e
            if self._version_labels:
                await self._llm.update_weight_version(str(version))
            self._version = version
            self._adapters.current = None  # full weights: the policy is exactly these
        finally:
            t_resume = time.perf_counter()
            await self._llm.resume_generation()
            self._resume_s = time.perf_counter() - t_resume
            self._ready.set()

    # -- one vLLM submission -------------------------------------------------------------------

    async def _submit(
        self, req: _Request, prompt: list[int], sampling: SamplingSettings, max_tokens: int
    ) -> _Piece:
        from vllm.inputs import TokensPrompt

        version, lora = self._version, self._adapters.current
        req.vllm_id = f"{req.request_id}#{next(self._serial)}"
        req.lora_id = lora.lora_int_id if lora is not None else 0
        params = _sampling_params(sampling, max_tokens)
        final = None
        continued, req.submissions = req.submissions > 0, req.submissions + 1
        # cache_salt: blocks of older weights are reused only by their own request or episode
        later_turn = not continued and req.salt not in ("", salt(version))
        req.salt = req.salt or salt(version)
        self._salts.used(sampling.kv_scope, req.salt)
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt, cache_salt=req.salt),
            params,
            request_id=req.vllm_id,
            lora_request=lora,
        )
        async for out in stream:  # FINAL_ONLY: one item; cancellation aborts the vLLM request
            final = out
        if final is None:
            raise RuntimeError(f"vLLM returned no output for request {req.vllm_id!r}")
        if continued or later_turn:
            for stats in (self.continuations if continued else self.later_turns, req.reuse):
                stats.add(len(prompt), getattr(final, "num_cached_tokens", None) or 0)
        # vLLM's version spans label the engine's weights; an adapter's tokens are its version's.
        piece = _piece(final.outputs[0], version, spans=lora is None and self._version_labels)
        check_logprobs(piece.logprobs, f"vLLM request {req.vllm_id!r}")
        return piece


@dataclass
class _Piece:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    stop_string: str | None = None


async def _reap(pids: frozenset[int]) -> None:
    """Waits for vLLM's child processes to exit after its shutdown; kills the stragglers."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = await asyncio.to_thread(psutil.wait_procs, procs, SHUTDOWN_TIMEOUT_S)
    for proc in alive:
        log.warning("vLLM child process %d survived shutdown; killing it", proc.pid)
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def _sampling_params(s: SamplingSettings, max_tokens: int) -> Any:
    """vLLM's ``SamplingParams`` for one submission of at most ``max_tokens`` tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else 0,
        seed=s.seed,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        stop=list(s.stop) or None,
        structured_outputs=StructuredOutputsParams(choice=list(s.choices)) if s.choices else None,
        logprobs=0,
        detokenize=bool(s.stop),  # stop strings are matched on text; ids are what we keep
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _piece(comp: Any, submitted_version: int, *, spans: bool = True) -> _Piece:
    """What a submission returned (vLLM's ``CompletionOutput``), tokens labelled with the version
    whose weights computed them (``submitted_version`` when vLLM gives no spans, or ``spans`` is
    false: a submission with an adapter samples with it to the end)."""
    ids = list(comp.token_ids)
    lps = comp.logprobs or []
    logprobs = [float(lps[i][t].logprob) for i, t in enumerate(ids)] if lps else []
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
    versions = (
        _versions_from_spans(getattr(comp, "weight_versions", None), len(ids)) if spans else None
    )
    if versions is None:
        versions = [submitted_version] * len(ids)
    reason = comp.finish_reason
    finish: FinishReason = reason if reason in ("stop", "length") else "abort"
    stop = comp.stop_reason if isinstance(getattr(comp, "stop_reason", None), str) else None
    return _Piece(ids, logprobs, versions, finish, stop)


def _versions_from_spans(spans: Any, n: int) -> list[int] | None:
    """Per-token versions from vLLM's weight-version spans; None when vLLM gave none."""
    if not spans:
        return None if n else []
    versions = [0] * n
    for span in spans:
        try:
            label = int(span.version)
        except ValueError:  # "default": a label this engine did not set
            return None
        versions[span.start : span.end] = [label] * (span.end - span.start)
    return versions


def _is_resource_tracker(proc: Any) -> bool:
    import psutil

    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def _build_async_llm(s: VllmEngineSettings) -> AsyncLLM:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    # vLLM's annotations are narrower than what it accepts: max_model_len None means "from the
    # model's config" (its default), dtype is any of its dtype names, and compilation_config may be
    # a dict (its CLI passes one); pyright would check the unpacked dict against every parameter.
    args = AsyncEngineArgs(
        model=s.model,
        max_model_len=s.max_model_len,  # pyright: ignore[reportArgumentType]
        gpu_memory_utilization=s.gpu_memory_utilization,
        dtype=resolve_dtype(s.dtype),  # pyright: ignore[reportArgumentType]
        enforce_eager=s.enforce_eager,
        **({"compilation_config": dict(s.compilation_config)} if s.compilation_config else {}),  # pyright: ignore[reportArgumentType]
        tensor_parallel_size=s.tensor_model_parallel_size,
        seed=s.seed,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        trust_remote_code=s.trust_remote_code,
        logprobs_mode=s.logprobs_mode,
        disable_log_stats=True,
        worker_extension_cls=vllm_worker.EXTENSION,
        **vllm_adapters.engine_args(s.lora_rank),
    )
    return AsyncLLM.from_engine_args(args)
