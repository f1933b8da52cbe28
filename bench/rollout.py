#!/usr/bin/env python3
"""Generation throughput of ``VllmEngine`` against bare ``AsyncLLM``, and weight-update times.

Phase 1 (throughput): one engine on the tiny model. N concurrent single-turn requests with fixed
lengths (``ignore_eos``), the same prompts and the same ``SamplingParams`` (temperature 1,
``logprobs=0``, final output only) go once through ``VllmEngine.generate`` and once straight into
the same ``AsyncLLM`` it wraps, alternating for ``--repeat`` rounds after a warm-up round; the
median of the per-round ratios (VllmEngine / bare) is the wrapper's cost (target >= 0.95).

Phase 2 (weight update): ``load_weights`` on the idle engine (mode "keep": pause, stage a
safetensors file on /dev/shm, ``reload_weights`` in the worker, relabel, resume), for the tiny
model and for a ~0.5B-parameter random Qwen2 (hidden 896, 24 layers, 14 heads / 2 KV heads,
intermediate 4864, vocabulary 151936, the tiny model's tokenizer), in ms and GB/s of float32
weights. ``--skip-large`` skips the 0.5B engine (its start takes a minute or more on 2 cores).

Progress lines go to stderr; the last line of stdout is one JSON object with all figures.
Run: ``.venv/bin/python bench/rollout.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def progress(msg: str) -> None:
    print(f"[bench/rollout {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/rollout.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--requests", type=int, default=64, help="concurrent requests (default %(default)s)"
    )
    p.add_argument("--tokens", type=int, default=256, help="generated tokens per request")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--repeat", type=int, default=8, help="timed rounds per side (median taken)")
    p.add_argument("--updates", type=int, default=3, help="timed weight updates per model")
    p.add_argument("--skip-large", action="store_true", help="skip the ~0.5B-parameter model")
    return p.parse_args(argv)


# -- throughput -------------------------------------------------------------------------------


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 500 + 1 for j in range(length)] for i in range(n)]


async def round_engine(engine: Any, batch: list[list[int]], tokens: int, tag: str) -> float:
    from rollout_service.engine.base import SamplingSettings

    sampling = SamplingSettings(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    start = time.perf_counter()
    gens = await asyncio.gather(
        *(engine.generate(f"{tag}-{i}", p, sampling) for i, p in enumerate(batch))
    )
    elapsed = time.perf_counter() - start
    assert all(len(g.token_ids) == tokens for g in gens)
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
        return len(final.outputs[0].token_ids)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    elapsed = time.perf_counter() - start
    assert all(c == tokens for c in counts)
    return len(batch) * tokens / elapsed


async def throughput(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    batch = prompts(args.requests, args.prompt_len)
    await round_engine(engine, batch, args.tokens, "warm-engine")
    await round_bare(engine.async_llm, batch, args.tokens, "warm-bare")
    ours, bare = [], []
    for r in range(args.repeat):
        # Alternate which side goes first: a round after another runs on a warmer machine.
        if r % 2 == 0:
            ours.append(await round_engine(engine, batch, args.tokens, f"engine-{r}"))
            bare.append(await round_bare(engine.async_llm, batch, args.tokens, f"bare-{r}"))
        else:
            bare.append(await round_bare(engine.async_llm, batch, args.tokens, f"bare-{r}"))
            ours.append(await round_engine(engine, batch, args.tokens, f"engine-{r}"))
        progress(
            f"round {r}: VllmEngine {ours[-1]:,.0f} tok/s, bare AsyncLLM {bare[-1]:,.0f} tok/s"
        )
    # Median of the per-round ratios: adjacent runs share the machine's state, so pairing them
    # cancels most of the drift that 2 busy cores show from round to round.
    ratio = statistics.median(o / b for o, b in zip(ours, bare, strict=True))
    return {
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "prompt_len": args.prompt_len,
        "engine_tok_s": round(statistics.median(ours), 1),
        "bare_tok_s": round(statistics.median(bare), 1),
        "engine_tok_s_rounds": [round(x, 1) for x in ours],
        "bare_tok_s_rounds": [round(x, 1) for x in bare],
        "ratio": round(ratio, 4),  # median of per-round VllmEngine / bare
        "ratio_of_medians": round(statistics.median(ours) / statistics.median(bare), 4),
    }


# -- weight updates ---------------------------------------------------------------------------


async def update_times(engine: Any, model_dir: Path, repeats: int) -> dict[str, Any]:
    from safetensors.numpy import load_file

    from rollout_service.engine.base import SamplingSettings

    weights = list(load_file(str(model_dir / "model.safetensors")).items())
    nbytes = sum(a.nbytes for _, a in weights)
    params = sum(a.size for _, a in weights)
    times, breakdown = [], []
    for _ in range(repeats):
        times.append(await engine.load_weights(engine.policy_version + 1, weights, mode="keep"))
        parts = {
            k: round(v * 1e3, 1) for k, v in engine.last_update_timings.items() if k != "bytes"
        }
        breakdown.append(parts)
        progress(f"update of {nbytes / 1e9:.3f} GB took {times[-1] * 1e3:.1f} ms ({parts})")
    gen = await engine.generate(
        "after-update", [1, 2, 3], SamplingSettings(max_tokens=4, temperature=0.0)
    )
    assert gen.versions == [engine.policy_version] * len(gen.token_ids)
    best = min(times)
    return {
        "parameters": params,
        "bytes": nbytes,
        "update_ms": [round(t * 1e3, 1) for t in times],
        "update_ms_best": round(best * 1e3, 1),
        "update_gb_s_best": round(nbytes / best / 1e9, 3),
        "breakdown_ms": breakdown,  # check / stage (safetensors on /dev/shm) / swap (pause,
        # reload_weights in the worker, relabel, resume)
    }


def large_spec() -> Any:
    from tools.make_tiny_model import TinyModelSpec

    # vocab_multiple rounds the 512-token tokenizer's vocabulary up to Qwen2.5-0.5B's 151936 rows.
    return TinyModelSpec(
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        max_position_embeddings=2048,
        vocab_multiple=151936,
    )


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from rollout_service.engine.vllm_engine import VllmEngine, VllmEngineSettings
    from tools.make_tiny_model import make_tiny_model

    result: dict[str, Any] = {"bench": "rollout"}
    tiny = make_tiny_model(workdir / "tiny")
    progress("starting the tiny-model engine")
    start = time.perf_counter()
    settings = VllmEngineSettings(
        model=str(tiny),
        max_model_len=args.prompt_len + args.tokens + 64,
        max_num_seqs=max(64, args.requests),
    )
    async with await VllmEngine.start(settings) as engine:
        result["tiny_engine_start_s"] = round(time.perf_counter() - start, 1)
        result["throughput"] = await throughput(engine, args)
        progress(
            f"throughput ratio VllmEngine / bare AsyncLLM = {result['throughput']['ratio']:.3f}"
        )
        result["update_tiny"] = await update_times(engine, tiny, args.updates)
    if args.skip_large:
        result["update_0_5b"] = "skipped (--skip-large)"
        return result
    progress("writing the ~0.5B-parameter random Qwen2")
    start = time.perf_counter()
    large = make_tiny_model(workdir / "large", large_spec())
    result["large_model_write_s"] = round(time.perf_counter() - start, 1)
    progress("starting the 0.5B engine")
    start = time.perf_counter()
    settings = VllmEngineSettings(
        model=str(large), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256
    )
    try:
        async with await VllmEngine.start(settings) as engine:
            result["large_engine_start_s"] = round(time.perf_counter() - start, 1)
            result["update_0_5b"] = await update_times(engine, large, max(1, args.updates - 1))
    except Exception as e:  # report what was measured so far rather than nothing
        result["update_0_5b"] = f"failed: {type(e).__name__}: {e}"
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    t = result["throughput"]
    print(
        f"VllmEngine {t['engine_tok_s']:,.0f} tok/s vs bare AsyncLLM {t['bare_tok_s']:,.0f} tok/s "
        f"(ratio {t['ratio']:.3f}); tiny update {result['update_tiny']['update_ms_best']} ms"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
