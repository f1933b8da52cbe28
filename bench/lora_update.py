#!/usr/bin/env python3
"""LoRA's adapter-only weight update against the full one, end to end, both measured in this run.

``bench/e2e.py`` runs the whole job twice on one prepared model, workload and placement: full
fine-tuning (the bound: every weight update moves the whole model), then LoRA (rank ``--rank``,
``lora.merge`` false: every update moves the adapter alone and the servers' vLLM serves it beside
the base weights). Per update, ``weights/applied_s`` is the time from the learner starting to
gather a version until every rollout server generates with it. The figure is
``update_speedup`` = median full ``applied_s`` / median LoRA ``applied_s`` (issue 38's target on a
GPU with the 0.5B shape: >= 5), printed with each one's spread (``applied_s_spread``: min, quartiles,
max), the bytes each update moved and the step times. Run at least 20 steps for a figure.

Both runs use the same ``max_staleness`` (``--staleness``, default 2) and the same steps; step 1 is
left out of the medians (first use of everything). Progress goes to stderr; the last line of stdout
is one JSON object. Run: ``.venv/bin/python bench/lora_update.py`` (CPU: the tiny model, a few
minutes); on a GPU ``--shape 0.5b --steps 20``. Arguments after ``--`` go to bench/e2e.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench._common import Progress, ratio  # noqa: E402

progress = Progress("lora_update")


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="lora_update", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--alpha", type=int, default=32, help="LoRA alpha (default 32)")
    p.add_argument("--steps", type=int, default=5, help="steps per run (default 5)")
    p.add_argument("--staleness", type=int, default=2, help="max_staleness of both runs")
    p.add_argument("--shape", default="auto", help="bench/e2e.py --shape (default auto)")
    p.add_argument("--device", default="auto", help="bench/e2e.py --device (default auto)")
    p.add_argument(
        "--work-dir", type=Path, default=ROOT / "runs" / "lora-update", help="models, data, runs"
    )
    args, rest = p.parse_known_args(argv)
    return args, [a for a in rest if a != "--"]


def run_e2e(args: argparse.Namespace, name: str, extra: list[str], more: list[str]) -> Path:
    """One bench/e2e.py run on the calculator workload; the directory its logs were saved to."""
    logs = args.work_dir / f"logs-{name}"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "e2e.py"),
        "--workload=calc",
        f"--steps={args.steps}",
        f"--staleness={args.staleness}",
        f"--shape={args.shape}",
        f"--device={args.device}",
        f"--work-dir={args.work_dir}",
        f"--results={args.work_dir / f'{name}.json'}",
        f"--save-logs={logs}",
        *more,
        *extra,
    ]
    progress(f"{name}: {' '.join(cmd[1:])}")
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise SystemExit(f"lora_update: the {name} run failed (exit {done.returncode})")
    return logs


def figures(logs: Path) -> dict[str, Any]:
    """Medians over the steps after the first of the run saved in ``logs``."""
    files = sorted(logs.glob("*/metrics.jsonl"))
    if not files:
        raise SystemExit(f"lora_update: no metrics.jsonl under {logs}")
    records = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
    later = [r for r in records if r.get("step", 0) > 1]

    def median(key: str) -> float | None:
        values = [float(r[key]) for r in later if key in r]
        return round(statistics.median(values), 4) if values else None

    def spread(key: str) -> list[float] | None:
        """[min, first quartile, third quartile, max] over the same steps."""
        values = sorted(float(r[key]) for r in later if key in r)
        if len(values) < 2:
            return None
        q1, _, q3 = statistics.quantiles(values, n=4)
        return [round(v, 4) for v in (values[0], q1, q3, values[-1])]

    return {
        "steps": len(records),
        "applied_s": median("weights/applied_s"),
        "applied_s_spread": spread("weights/applied_s"),
        "publish_s": median("weights/publish_s"),
        "bytes": median("weights/bytes"),
        "step_s": median("timing/step_s"),
        "tokens_per_s": median("perf/tokens_per_s"),
    }


def main(argv: list[str] | None = None) -> int:
    args, more = parse(argv)
    lora = [
        f"actor_rollout_ref.model.lora_rank={args.rank}",
        f"actor_rollout_ref.model.lora_alpha={args.alpha}",
    ]
    full = figures(run_e2e(args, "full", [], more))
    adapter = figures(run_e2e(args, "lora", lora, more))
    result = {
        "full": full,
        "lora": adapter,
        "rank": args.rank,
        "update_speedup": ratio(full["applied_s"], adapter["applied_s"]),
        "bytes_ratio": ratio(adapter["bytes"], full["bytes"]),
        "step_speedup": ratio(full["step_s"], adapter["step_s"]),
    }
    progress(
        f"weight update end to end: full {full['applied_s']} s ({full['bytes']} B), LoRA "
        f"{adapter['applied_s']} s ({adapter['bytes']} B): {result['update_speedup']}x faster; "
        f"spread (min, quartiles, max) full {full['applied_s_spread']}, LoRA "
        f"{adapter['applied_s_spread']}; "
        f"step {full['step_s']} s vs {adapter['step_s']} s"
    )
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
