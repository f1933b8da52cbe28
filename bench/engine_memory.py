"""Memory of the vLLM engine's processes over many rounds of generation and weight reloads.

Design: one ``VllmEngine`` on the tiny model (in process, as a rollout server runs it). Each round
generates 16 requests of random prompt (4-200) and output (1-64) lengths, so the engine meets new
shapes as a real run does, and, with ``--mode both`` or ``reload``, reloads new weights from a file
as the learner's hand-over does. After every tenth of the rounds it prints each engine process's
RSS and anonymous memory (MiB, from /proc/PID/smaps_rollup) as a JSON line; the last line is the
summary: the growth over the second half of the rounds against the whole, the bound being a flat
line (ratio 0 = no growth once warm). Environment variables such as
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` pass through to the engine.

    .venv/bin/python bench/engine_memory.py --rounds 100 --mode both
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.safetensors_buffers import load_dir
from rollout_service.engine.base import SamplingSettings
from rollout_service.engine.vllm_engine import VllmEngine, VllmEngineSettings
from tools.make_tiny_model import make_tiny_model


def memory(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, *rest = line.split()
        if key.rstrip(":") in ("Rss", "Anonymous"):
            out[key.rstrip(":")] = int(rest[0]) // 1024
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.dir)
    model = root / "model"
    if not (model / "model.safetensors").exists():
        make_tiny_model(model)
    engine = await VllmEngine.start(VllmEngineSettings(model=str(model), max_model_len=512))
    procs = [psutil.Process(p) for p in engine.child_pids]
    rng = np.random.default_rng(args.seed)
    base = [
        (b.name, np.frombuffer(b.data, dtype=b.dtype).reshape(b.shape).copy())
        for b in load_dir(str(model))
    ]
    series: list[dict[str, Any]] = []

    def sample(i: int) -> None:
        row = {"round": i, **{f"{p.name()}/{p.pid}": memory(p.pid) for p in procs}}
        series.append(row)
        print(json.dumps(row), flush=True)

    async def generate(i: int) -> None:
        async def one(j: int) -> None:
            prompt = [int(x) for x in rng.integers(5, 200, int(rng.integers(4, 200)))]
            sampling = SamplingSettings(max_tokens=int(rng.integers(1, 64)), ignore_eos=True)
            await engine.generate(f"r{i}-{j}", prompt, sampling)

        await asyncio.gather(*(one(j) for j in range(16)))

    async def reload(i: int) -> None:
        from safetensors.numpy import save_file  # lazy: only the reload modes write files

        noise = [(n, a + (rng.standard_normal(a.shape) * 1e-3).astype(a.dtype)) for n, a in base]
        slot = root / f"slot{i % 2}"
        slot.mkdir(exist_ok=True)
        save_file(dict(noise), str(slot / "model.safetensors"))
        await engine.load_weights_file(i, str(slot / "model.safetensors"), mode="keep")

    sample(0)
    try:
        for i in range(1, args.rounds + 1):
            if args.mode in ("gen", "both"):
                await generate(i)
            if args.mode in ("reload", "both"):
                await reload(i)
            if i % max(1, args.rounds // 10) == 0:
                sample(i)
    finally:
        await engine.shutdown()
    first, middle, last = series[0], series[len(series) // 2], series[-1]
    growth = {}
    for key in first:
        if key == "round":
            continue
        whole = last[key]["Anonymous"] - first[key]["Anonymous"]
        late = last[key]["Anonymous"] - middle[key]["Anonymous"]
        growth[key] = {
            "anon_mib": [first[key]["Anonymous"], last[key]["Anonymous"]],
            "late_over_whole": round(late / whole, 3) if whole else 0.0,
        }
    return {"mode": args.mode, "rounds": args.rounds, "growth": growth}


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Memory of the vLLM engine over generation and reloads."
    )
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--mode", choices=("gen", "reload", "both"), default="both")
    ap.add_argument("--dir", default="runs/bench-engine-memory", help="the tiny model and slots")
    ap.add_argument("--seed", type=int, default=0)
    summary = asyncio.run(run(ap.parse_args()))
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":  # vLLM's engine process may be spawned: it re-imports this file
    sys.exit(main())
