#!/usr/bin/env python3
"""What encryption costs the trajectory path: token CURVE (the default ``transport.auth``) against
plain ZeroMQ on the same bytes, over TCP loopback.

Each run streams the same realistic trajectory batches (``bench/protocol.py``'s raw phase: encoded
batches, 32 distinct buffers cycled, ``copy=False``) from a DEALER process to a ROUTER process,
once with no security mechanism and once as a CURVE client and server holding a token's derived
keys, alternating, so both see the same machine. Timed: first batch sent to the receiver's ack of
the last. The bound is the plain run of the same repeat; ratio = CURVE throughput / plain.

Prints progress lines to stderr, a summary, and as its last line a JSON object with every run and
the median ratio. Run: ``.venv/bin/python bench/auth_cost.py --repeat 3`` (``--help`` for knobs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import Progress, ratio
from bench.protocol import Config, raw_receiver, raw_sender, run_pair

TOKEN = "0123456789abcdef" * 4  # any token: only the cipher's cost is measured


def one_run(cfg: Config) -> dict[str, float]:
    sent, received = run_pair(raw_receiver, raw_sender, cfg)
    mb = received["bytes"] / 1e6
    return {
        "mb_per_s": round(mb / sent["elapsed_s"], 1),
        "elapsed_s": round(sent["elapsed_s"], 3),
        "sender_cpu_s": round(sent["cpu_s"], 3),
        "receiver_cpu_s": round(received["cpu_s"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    d = Config(batches=200)
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--trajectories", type=int, default=d.trajectories, help="per batch")
    ap.add_argument("--prompt", type=int, default=d.prompt, help="prompt tokens per trajectory")
    ap.add_argument("--response", type=int, default=d.response, help="response tokens")
    ap.add_argument("--batches", type=int, default=d.batches, help="batches per run")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each (median reported)")
    a = ap.parse_args(argv)
    cfg = dataclasses.replace(
        d, trajectories=a.trajectories, prompt=a.prompt, response=a.response, batches=a.batches
    )
    progress = Progress("auth_cost")
    runs: list[dict[str, object]] = []
    for i in range(a.repeat):
        plain = one_run(cfg)
        curve = one_run(dataclasses.replace(cfg, token=TOKEN))
        r = ratio(curve["mb_per_s"], plain["mb_per_s"])
        progress(
            f"run {i + 1}/{a.repeat}: plain {plain['mb_per_s']} MB/s, token CURVE "
            f"{curve['mb_per_s']} MB/s, ratio {r}"
        )
        runs.append({"plain": plain, "curve": curve, "ratio": r})
    ratios = [float(r["ratio"]) for r in runs if r["ratio"] is not None]  # type: ignore[arg-type]
    median = round(statistics.median(ratios), 3) if ratios else None
    batch_mb = cfg.trajectories * (cfg.prompt + cfg.response) * 17 / 1e6  # canonical dtypes
    print(
        f"token CURVE / plain ZeroMQ throughput: {median} (median of {len(ratios)}; "
        f"{cfg.batches} batches of {cfg.trajectories} x {cfg.prompt + cfg.response} tokens, "
        f"~{batch_mb:.1f} MB each)"
    )
    print(json.dumps({"ratio_median": median, "runs": runs, "config": dataclasses.asdict(cfg)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
