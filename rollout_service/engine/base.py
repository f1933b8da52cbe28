"""The engine interface the agent loops use: token ids in, token ids + logprobs + versions out.

Design: agents never see vLLM. They hand a prompt as token ids and get back the sampled token ids
verbatim (never decoded and re-encoded: retokenisation drift is the classic bug of agent RL), the
logprob of each sampled token under the policy that sampled it, and the policy version of each
token (a generation can straddle a weight update under the ``keep`` policy). The scripted engine
(``scripted.py``, ``rollout_server.engine: scripted``) implements the same protocol.

Two protocols: ``SamplingEngine`` is what an agent loop needs (generate, abort, the version);
``Engine`` is what the rollout server drives: that, plus weight updates (chunks received over the
protocol, or the learner's file on this machine), the manifest announces are checked against, and
shutdown. The server calls every member; an engine that cannot do one raises ``WeightUpdateError``
saying so, and the server reports the update failed.

An engine's output is checked before an agent sees it (``check_logprobs``): a logprob that is not
finite or is above 0 means the engine computed garbage (vLLM's full CUDA graphs of large mixed
batches have done so), and ``EngineOutputError`` stops the server with that said (exit 2, which
the launcher does not restart: the same settings would do the same), instead of shipping batches
the learner can only refuse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import numpy as np

    from protocol.weights import ModelManifest

FinishReason = Literal["stop", "length", "abort"]
UpdateMode = Literal["abort", "keep"]
"""What a weight update does to requests in flight: abort them, or keep them running (the rest of
their tokens come from the new weights and carry its version)."""


class WeightUpdateError(RuntimeError):
    """A weight update was refused or failed; the previous weights and version stay."""


class EngineOutputError(RuntimeError):
    """The engine returned output no policy could have produced; the server stops on it."""


def check_logprobs(logprobs: Sequence[float], what: str) -> None:
    """Raise ``EngineOutputError`` naming the first logprob of ``what`` that is not finite and <= 0."""
    for i, v in enumerate(logprobs):
        if not -math.inf < v <= 0.0:  # NaN fails both comparisons
            raise EngineOutputError(
                f"{what}: the engine returned logprob {v} for sampled token {i} of "
                f"{len(logprobs)}; its output is corrupt and cannot be trained on (vLLM's "
                "cudagraph_mode FULL has produced this on large mixed prefill-decode batches: "
                "actor_rollout_ref.rollout.compilation_config)"
            )


@dataclass(frozen=True)
class SamplingSettings:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    choices: tuple[
        str, ...
    ] = ()  # constrain the output to one of these texts (vLLM structured outputs)
    stop: tuple[
        str, ...
    ] = ()  # stop strings (the code agent's closing tag); the ids that spell one stay in the output
    # The episode a request is a turn of: under "keep" updates its turns go on reusing the KV the
    # earlier ones computed (`VllmEngine`); "": a request on its own.
    kv_scope: str = ""


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token, <= 0
    versions: list[int]  # policy version that produced each token
    finish_reason: FinishReason
    stop_token_included: bool = True  # an EOS/stop token that ended the turn is in token_ids
    stop_string: str | None = None  # the stop string that ended generation, if one did
    timings: dict[str, float] = field(default_factory=dict)
    # Of the tokens its submissions sent on KV from before a weight update (a continuation, or a
    # later turn of an episode: `kv_reuse`), how many vLLM found cached.
    reuse_sent: int = 0
    reuse_cached: int = 0


class SamplingEngine(Protocol):
    """What an agent loop uses: sampling, aborting, and the version it samples with."""

    @property
    def policy_version(self) -> int:
        """Version of the weights generation uses now."""
        ...

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:
        """Sample a continuation. Returns with finish_reason "abort" (and the tokens so far) when
        the request is aborted; cancelling the caller aborts the request in the engine."""
        ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...


class Engine(SamplingEngine, Protocol):
    """What the rollout server drives: sampling plus weight updates and shutdown."""

    @property
    def weight_manifest(self) -> ModelManifest | None:
        """Every tensor an update must carry (names, dtypes, shapes); the server checks weight
        announces against it before receiving anything. None: only the size bound is checked."""
        ...

    @property
    def last_update_timings(self) -> Mapping[str, float]:
        """Breakdown of the last weight update in seconds (``reload_s``...); empty if none."""
        ...

    async def load_weights(
        self, version: int, tensors: list[tuple[str, np.ndarray]], *, mode: UpdateMode
    ) -> float:
        """Swaps in ``tensors`` as ``version``; returns the seconds taken. All or nothing: on error
        the previous weights and ``policy_version`` stay and ``WeightUpdateError`` says why."""
        ...

    async def load_weights_file(self, version: int, path: str, *, mode: UpdateMode) -> float:
        """Swaps in ``version`` from a safetensors file on this machine (the learner's file
        hand-over); returns the seconds taken. All or nothing, like ``load_weights``."""
        ...

    async def shutdown(self) -> None:
        """Stops generating and releases the engine's processes and memory."""
        ...


class DetachedEngine:
    """The engine of a server that has none attached yet: every use says so."""

    weight_manifest: ModelManifest | None = None
    last_update_timings: Mapping[str, float] = {}

    def _missing(self) -> RuntimeError:
        return RuntimeError(
            "no engine attached to the rollout server yet (RolloutServer.attach_engine)"
        )

    @property
    def policy_version(self) -> int:
        raise self._missing()

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:
        raise self._missing()

    async def abort(self, request_ids: Sequence[str]) -> None:
        raise self._missing()

    async def load_weights(
        self, version: int, tensors: list[tuple[str, np.ndarray]], *, mode: UpdateMode
    ) -> float:
        raise self._missing()

    async def load_weights_file(self, version: int, path: str, *, mode: UpdateMode) -> float:
        raise self._missing()

    async def shutdown(self) -> None:
        pass
