"""bench/e2e.py's arguments: the parser, its checks, and the workload's defaults per device.

Design: everything a run's configuration is made of is decided here, before anything is written or
started: the workload and its config, the staleness values, the variants (`bench._e2e_variants`),
the placement (`bench._placement`), and the device's defaults where an argument was left out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import _placement
from bench._e2e_setup import DEADLINE_CUDA_S, SHAPES, WORKLOADS
from bench._e2e_variants import variants

ROOT = Path(__file__).resolve().parent.parent
RUN_FLOOR_S = 100.0
"""With a deadline, the time left that the first run of a command needs to start."""


def parse_args(argv: list[str] | None, doc: str) -> argparse.Namespace:
    """bench/e2e.py's arguments, checked (``doc``: its docstring, whose first paragraph is the
    description)."""
    p = argparse.ArgumentParser(
        prog="e2e",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="longtail",
        help="longtail: long-tailed multi-turn calculator chains; calc: the demo's task (default %(default)s)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per run (default: longtail 10 on cuda, 4 on the CPU; calc 6 / 3)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=ROOT / "runs" / "e2e",
        help="model, data and runs; kept and reused (default %(default)s)",
    )
    p.add_argument(
        "--staleness",
        default=None,
        help="comma-separated max_staleness values, one run each; 0 is "
        "the sync baseline (default: longtail 0,1,2,4; calc 0,2)",
    )
    p.add_argument(
        "--drain-steps",
        type=int,
        default=None,
        help="leave the last N steps of every run out of its means: a run at max_staleness k "
        "trains its last k steps on groups admitted before, with no generation left to wait for "
        "(default: the largest --staleness value, so all runs share one window)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="wall-clock limit of each run (default: longtail 240 on cuda, 420 on the CPU; calc 420)",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="wall-clock limit of the whole bench: a run starts only when the time left is at least "
        f"the longest run so far ({RUN_FLOOR_S:g} s before the first), the others are left pending "
        f"for --resume; 0: none (default: longtail {DEADLINE_CUDA_S:g} on cuda, to fit a "
        "10-minute command; otherwise none)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--placement",
        default=None,
        help="the learner's GPUs and each rollout server's: 'learner=GPUS;rollout=GPUS[@FRACTION];...' "
        "(e.g. 'learner=0,1;rollout=2;rollout=3'; FRACTION: that server's vLLM share of its GPU; "
        "see bench/_placement.py) (default: --gpus 1)",
    )
    where.add_argument(
        "--gpus",
        type=int,
        choices=sorted(_placement.SHORTHANDS),
        default=None,
        help="shorthands: 1 is 'learner=0;rollout=0' (one shared GPU), 2 is 'learner=0;rollout=1'",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each configuration, interleaved (s0, s2, s0, s2, ...) (default %(default)s)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished runs of --results (same workload, model, steps, placement, "
        "overrides) and run only the missing ones",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: cuda when torch sees a GPU (default %(default)s)",
    )
    p.add_argument(
        "--shape",
        choices=("auto", *SHAPES),
        default="auto",
        help="model shape; auto: 0.5b on cuda, tiny on the CPU (default %(default)s)",
    )
    p.add_argument(
        "--vocab",
        choices=("tokenizer", "qwen2"),
        default="tokenizer",
        help="model vocabulary: the tokenizer's 512 ids, or Qwen2's 151936 rows (the full 494M "
        "parameters; only once the learner accepts ids the tokenizer lacks) (default %(default)s)",
    )
    p.add_argument(
        "--no-warmup", action="store_true", help="train the random model (episodes stay one turn)"
    )
    p.add_argument(
        "--min-probe",
        type=float,
        default=None,
        help="refuse to time runs after a warm-up whose probe is below this (exit status 3); the "
        "warm-up trains until it reaches it; 0: no check (default: the workload's target, "
        "longtail 0.2 on cuda, 0.7 on the CPU; calc 0.15)",
    )
    p.add_argument(
        "--warmup-seed", type=int, default=0, help="the warm-up's seed (default %(default)s)"
    )
    p.add_argument(
        "--warmup-seconds",
        type=float,
        default=None,
        help="cap of the warm-up's training loop (default: longtail 480 on cuda, 2700 on the CPU; calc 300 / 1200)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="cap of the warm-up's steps (default: longtail 1500 on cuda, 3000 on the CPU; calc 1000 / 500)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="bin/train config (default: the workload's, configs/longtail_e2e.yaml or gpu_e2e.yaml)",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="also write the JSON result here, after every run, and the reward plot beside it "
        "(.png) (default WORK/e2e-results-<workload>-<placement>.json, e.g. "
        "e2e-results-longtail-l0-1_r2_r3.json)",
    )
    p.add_argument(
        "--save-logs",
        type=Path,
        default=None,
        help="copy each run's metrics.jsonl, resolved config and log tails here (e.g. $OUT/e2e)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'NAME:KEY=VALUE [KEY=VALUE ...]'",
        help="one more configuration per max_staleness, with these bin/train overrides, labelled "
        "+NAME (repeatable)",
    )
    p.add_argument(
        "--prepare-only", action="store_true", help="write model, data and warm-up, then stop"
    )
    p.add_argument(
        "overrides", nargs="*", help="more key=value overrides for bin/train (every run)"
    )
    a = p.parse_args(argv)
    w = WORKLOADS[a.workload]
    a.config = a.config or w.config
    staleness = a.staleness if a.staleness is not None else w.staleness
    try:
        a.staleness_values = [int(x) for x in staleness.split(",") if x.strip()]
    except ValueError:
        p.error(f"--staleness must be comma-separated integers (got {staleness!r})")
    if not a.staleness_values or any(s < 0 for s in a.staleness_values):
        p.error("--staleness needs at least one value >= 0")
    if len(set(a.staleness_values)) != len(a.staleness_values):
        p.error("--staleness values must differ (one run directory each)")
    if a.drain_steps is None:
        a.drain_steps = max(a.staleness_values)
    if a.drain_steps < 0:
        p.error("--drain-steps must be >= 0")
    if a.steps is not None and a.steps < 1:
        p.error("--steps must be >= 1")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.min_probe is not None and not 0 <= a.min_probe <= 1:
        p.error("--min-probe is a probability, in [0, 1]")
    try:
        a.placement = _placement.parse(a.placement or _placement.SHORTHANDS[a.gpus or 1])
    except _placement.PlacementError as e:
        p.error(f"--placement {e}")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        p.error(f"overrides must be key=value (got {bad})")
    try:
        a.configs = variants(a.variant)
    except ValueError as e:
        p.error(f"--variant {e}")
    return a


def apply_device_defaults(a: argparse.Namespace, device: str) -> None:
    """The workload's defaults for ``device`` where an argument was not given."""
    w = WORKLOADS[a.workload]
    a.steps = a.steps or w.steps[device]
    a.timeout_s = a.timeout_s or w.timeout_s[device]
    a.warmup_steps = a.warmup_steps or w.warmup_steps[device]
    a.warmup_seconds = a.warmup_seconds or w.warmup_seconds[device]
    # a deadline of 0: none
    a.deadline_s = (a.deadline_s if a.deadline_s is not None else w.deadline_s.get(device)) or None
    a.warmup_target = max(w.warmup_target[device], a.min_probe or 0.0)
    a.min_probe = w.warmup_target[device] if a.min_probe is None else a.min_probe
