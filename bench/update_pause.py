#!/usr/bin/env python3
"""Generation while full weight updates land: tokens/s against the same engine with no updates.

Design: one ``VllmEngine`` on the ``--shape`` model (bench/rollout.py's models: ``tiny``, or
``0.5b``, Qwen2-0.5B's shape with random weights). A round is ``--requests`` concurrent
single-turn requests of ``--tokens`` tokens each (``ignore_eos``), as in bench/rollout.py. Three
kinds of round, alternated for ``--repeat`` rounds after a warm-up round of each:

- ``none``: no update; its tokens/s is the bound;
- ``prefetch``: a task calls ``load_weights_file(v, FILE, mode="keep")`` every ``--every-s``
  seconds while the round generates (the learner's file hand-over); the workers copy the file onto
  the device while generation goes on, and generation pauses only for device-to-device copies;
- ``direct``: ``prefetch`` with the staged copy loaded through the model's ``load_weights``
  alone instead of vLLM's layer-by-layer reload;
- ``file``: the same with the engine's prefetch turned off, so the pause reads the file (the
  engine's behaviour before prefetch);
- ``recompute``: ``file`` in ``abort`` mode. On a vLLM without weight-version spans (0.24, the GPU
  build) this is what ``keep`` did before the engine continued requests on their cached KV:
  every running request's KV recomputed after each update.

FILE is the model's own safetensors file, loaded as a new version each time: the bytes moved and
the work done are those of new weights. Updates start every ``--every-s`` seconds, start to start,
as a learner publishes at its own pace. Per kind: the median tokens/s over its rounds, and its
ratio to ``none`` (1.0: updates cost generation nothing); the seconds of generation an update
costs (a round's time beyond what its tokens take at ``none``'s pace, over its updates); per
update, the pause (``swap_s``: generation stopped; ``pause_generation``, the reload and the resume
inside it) and the prefetch before it. The
last line of stdout is one JSON object. On one H200: ``python3 bench/update_pause.py --shape 0.5b
--graphs --requests 256 --tokens 512 --every-s 1 --repeat 3``; on the CPU:
``.venv/bin/python bench/update_pause.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import rollout as rollout_bench  # noqa: E402  (after the checkout is on the path)
from bench._common import Progress  # noqa: E402
from rollout_service.engine.kv_reuse import Reuse  # noqa: E402

progress = Progress("update_pause")
KINDS = {
    # kind: (prefetch, direct load, update mode)
    "none": (False, False, "keep"),
    "prefetch": (True, False, "keep"),
    "direct": (True, True, "keep"),
    "file": (False, False, "keep"),
    "recompute": (False, False, "abort"),
}
"""``recompute`` is what a ``keep`` update did on a vLLM without weight-version spans before the
engine continued requests on their cached KV: abort them, clear the cache, recompute their KV."""
PARTS = ("prefetch_s", "swap_s", "pause_s", "reload_s", "resume_s", "total_s", "prefetched")
"""What each update records: the swap (generation stopped) holds pause_generation and the reload."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/update_pause.py", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--shape", choices=("tiny", "0.5b"), default="tiny")
    p.add_argument("--requests", type=int, default=16, help="concurrent requests a round")
    p.add_argument("--tokens", type=int, default=1024, help="generated tokens per request")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--every-s", type=float, default=0.5, help="seconds between updates")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds per kind")
    p.add_argument("--graphs", action="store_true", help="CUDA graphs (bench/rollout.py's)")
    return p.parse_args(argv)


async def updating(
    engine: Any, file: Path, every_s: float, mode: str, pauses: list[dict[str, float]]
) -> None:
    """A full update from ``file`` every ``every_s`` seconds, start to start (the learner publishes
    at its own pace, however long a server takes to apply), until cancelled."""
    start = time.perf_counter()
    for n in itertools.count(1):
        await asyncio.sleep(max(0.0, start + n * every_s - time.perf_counter()))
        # shielded: a round that ends mid-update lets that update finish before the next round
        await asyncio.shield(
            engine.load_weights_file(engine.policy_version + 1, str(file), mode=mode)
        )
        t = engine.last_update_timings
        pauses.append({k: round(t[k], 4) for k in PARTS})


async def one_round(
    engine: Any, kind: str, args: argparse.Namespace, file: Path, tag: str
) -> tuple[float, list[dict[str, float]]]:
    reload = engine.worker_reload
    reload.prefetch_weights, reload.direct, mode = KINDS[kind]
    engine.continuations = Reuse()
    batch = rollout_bench.prompts(args.requests, args.prompt_len)
    pauses: list[dict[str, float]] = []
    updater = (
        asyncio.create_task(updating(engine, file, args.every_s, mode, pauses))
        if kind != "none"
        else None
    )
    try:
        tok_s = await rollout_bench.round_engine(engine, batch, args.tokens, tag)
    finally:
        if updater is not None:
            updater.cancel()
            try:
                await updater
            except asyncio.CancelledError:
                pass
    c = engine.continuations
    for p in pauses:  # the round's continuations: how much of their KV was found cached
        p["continued_cached"] = round(c.cached_tokens / c.tokens, 4) if c.tokens else 0.0
    return tok_s, pauses


def _median(ps: list[dict[str, float]], key: str) -> float | None:
    return round(statistics.median(p[key] for p in ps), 4) if ps else None


def summarize(
    rounds: dict[str, list[tuple[float, int]]],
    pauses: dict[str, list[dict[str, float]]],
    tokens: int,
) -> dict[str, Any]:
    """Per kind, from its rounds' (tokens/s, updates): tokens/s against the ``none`` rounds'
    median, and the seconds of generation each update cost: a round's time beyond what the same
    tokens take at the bound, over the round's updates (median over rounds)."""
    out: dict[str, Any] = {"tok_s": {k: [round(t) for t, _ in v] for k, v in rounds.items()}}
    bound = statistics.median(t for t, _ in rounds["none"])
    out["none"] = {"tok_s_median": round(bound)}
    for kind in [k for k in KINDS if k != "none"]:
        ps, tok_s = pauses[kind], [t for t, _ in rounds[kind]]
        lost = [(tokens / t - tokens / bound) / n for t, n in rounds[kind] if n]
        swaps = [p["swap_s"] for p in ps]
        out[kind] = {
            "tok_s_median": round(statistics.median(tok_s)),
            "ratio": round(statistics.median(tok_s) / bound, 4),
            "ratios": [round(t / bound, 4) for t in tok_s],
            "updates": len(ps),
            "lost_s_per_update": round(statistics.median(lost), 4) if lost else None,
            "lost_s_per_update_rounds": [round(x, 4) for x in lost],
            "pause_s_median": _median(ps, "swap_s"),
            "pause_s_range": [min(swaps), max(swaps)] if swaps else None,
            "prefetch_s_median": _median(ps, "prefetch_s"),
            "pause_generation_s_median": _median(ps, "pause_s"),
            "reload_s_median": _median(ps, "reload_s"),
            "resume_s_median": _median(ps, "resume_s"),
            "prefetched": sum(p["prefetched"] for p in ps),
            "continued_cached": _median(ps, "continued_cached"),
            "update_s_median": _median(ps, "total_s"),
        }
    return out


async def run(args: argparse.Namespace, workdir: Path, result: dict[str, Any]) -> None:
    rargs = rollout_bench.parse_args(
        [
            "--shape",
            args.shape,
            "--requests",
            str(args.requests),
            "--tokens",
            str(args.tokens),
            "--prompt-len",
            str(args.prompt_len),
        ]
        + (["--graphs"] if args.graphs else [])
    )
    rollout_bench.resolve_defaults(rargs, rollout_bench.cuda_available())
    result["config"] = {**vars(args), "device": rargs.device, "dtype": rargs.dtype}
    model = rollout_bench.write_model(workdir, args.shape, rargs.dtype)
    (file,) = model.glob("*.safetensors")
    progress(f"model written ({file.stat().st_size / 1e9:.3f} GB); starting the engine")
    engine = await rollout_bench.VllmEngine.start(rollout_bench.engine_settings(rargs, model))
    try:
        rounds: dict[str, list[tuple[float, int]]] = {k: [] for k in KINDS}
        pauses: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
        for kind in KINDS:  # warm-up: the first reloads of a process set things up
            await one_round(engine, kind, args, file, f"warm-{kind}")
        for r in range(args.repeat):
            for kind in KINDS:
                tok_s, ps = await one_round(engine, kind, args, file, f"{kind}-{r}")
                rounds[kind].append((tok_s, len(ps)))
                pauses[kind] += ps
                progress(f"round {r} {kind}: {tok_s:,.0f} tok/s, {len(ps)} updates {ps[:3]}")
        result.update(summarize(rounds, pauses, args.requests * args.tokens))
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"bench": "update_pause", "versions": rollout_bench.versions()}
    with tempfile.TemporaryDirectory(prefix="bench-update-pause-") as tmp:
        asyncio.run(run(args, Path(tmp), result))
    print(
        f"generation under an update every {args.every_s} s, against none: "
        + ", ".join(
            f"{k} {result[k]['ratio']:.3f} ({result[k]['lost_s_per_update']} s lost an update, "
            f"pause {result[k]['pause_s_median']} s)"
            for k in KINDS
            if k != "none"
        )
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
