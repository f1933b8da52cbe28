"""End-to-end step split and async vs sync: the whole job (bin/train: learner + rollout server) on a
workload, run once per ``max_staleness``, with each step's time split into wait / prepare / update /
broadcast, the waste, the staleness and the reward against wall-clock.

Workloads (``--workload``):
- ``longtail`` (default): multi-turn calculator chains with a heavy tail of episode lengths, like
  agentic and reasoning RL (configs/longtail_e2e.yaml, data from tools/make_tiny_data.py's
  ``longtail`` set). A row adds (or subtracts) a number ``steps`` times, one calculator call per
  turn; the number packs the value and the steps left (value * 100 + steps left), so one step is
  one addition ("6402 - 801" -> 5601: value 64 - 8, one step less) and the episode ends when the
  number ends in 00, boxed (math reward). ``steps`` ~ round(lognormal(ln 2, 1.1)) clipped to 1..31
  per row: turns per episode (steps + 1) have median 3, p90 9, p99 27, and the right episodes'
  response tokens (model + tool, ~37 a turn) median 107, p90 415, p99 1,079 in the 256 training
  rows (p99 / median 10). In real agentic RL too, most episodes of a batch are short and a few run
  an order of magnitude longer (tool calls per task, reasoning length), so a synchronous trainer
  waits for the longest episode of every batch while the rollout engine idles: the case
  asynchronous RL is for. The tail comes from the model itself: the warm-up teaches the format on
  whole demonstrations, and the episodes are what the warmed model samples (their lengths are read
  from the recordings and reported).
- ``calc``: the demo's task (configs/gpu_e2e.yaml): "What is a op b?", one calculator call, at
  most 3 turns; almost no tail.

Runs: ``max_staleness`` 0 is the synchronous baseline, labelled ``sync`` (the learner admits one
batch per policy version: generate on the current weights, train, publish, repeat), the others
``async-sK``; each is a configuration. Default ``0,1,2,4`` for longtail, ``0,2`` for calc.
``--repeats N`` runs every configuration N times, interleaved (sync, async-s1, ..., then again), so
that drift of the machine hits every configuration alike.

Placement (``--placement``, bench/_placement.py): the learner's GPUs and each rollout server's, e.g.
``learner=0,1;rollout=2;rollout=3`` (2 FSDP ranks on GPUs 0-1, a rollout server on each of GPUs 2
and 3) or ``learner=0;rollout=0@0.3;rollout=1`` (a second server on the learner's GPU, with 30% of
its memory for vLLM); ``--gpus 1`` is ``learner=0;rollout=0``, ``--gpus 2`` is
``learner=0;rollout=1``. It becomes bin/train's launch.learner_gpus, trainer.n_gpus_per_node,
launch.rollout_servers, launch.rollout_gpus and launch.rollout_gpu_memory_utilization overrides
(on the CPU the counts only: as many gloo ranks and rollout servers). GPUs the machine lacks are
refused before anything runs. The JSON names it (``placement``, and each run's).

What it does, every stage bounded in time and reported on stderr as it goes:
1. writes the model and the data into ``--work-dir`` (kept and reused by later calls: a second
   call with the same shape skips straight to the runs): on a GPU a Qwen2-0.5B-shaped random
   model in bfloat16 (hidden 896, 24 layers, 14 / 2 heads, intermediate 4864; the tiny tokenizer),
   on the CPU the tiny model in float32; and the workload's data;
2. warms the model up (tools/warmup.py in a child process, so its GPU memory is gone before vLLM
   starts; on CUDA with bfloat16 autocast) on the workload's demonstrations: calc calls the
   calculator half of the time, as bin/demo's first stage; longtail shows whole right episodes of
   its warm-up rows (more long chains than the workload), in batches of similar lengths
   (``--bucket``: a step costs about the mean length, not the longest), so that the warmed model
   follows long chains and some episodes earn a reward. The warm-up is seeded (``--warmup-seed``)
   and stops when its probe (the held-out chance that sampling writes a whole right episode,
   computed exactly, not sampled) reaches the workload's target: where the documented runs landed
   (longtail on a GPU: 0.2). ``--warmup-steps`` and ``--warmup-seconds`` are caps that should not
   bind: a warm-up stopped by a cap landed wherever the machine's speed left it, so its probe is
   checked against ``--min-probe`` (default: the target) and one below it stops the bench (exit
   status 3) before any run is timed. On the CPU the same seed gives the same model and probe; on
   a GPU the kernels are not bit-deterministic, so two warm-ups differ a little, both at or above
   the target. ``--no-warmup`` trains the random model;
3. runs ``bin/train --config <workload config>`` once per configuration and repeat (overrides:
   model, data, run directory, steps, ``actor_rollout_ref.rollout.max_staleness``, the placement;
   on the CPU also the device, dtype, eager mode and small batches), each in its own session and
   bounded by ``--timeout-s``: past it bin/train gets SIGTERM (it stops its children), then its
   group gets SIGKILL, then every process still carrying this bench's marker in its environment
   (the children run in sessions of their own) is killed. With ``--deadline-s`` a run starts only
   when the time left fits it (as long as the longest run so far, ``RUN_FLOOR_S`` before the
   first); the others are left ``pending``, and the same command with ``--resume`` runs them later,
   keeping the finished runs of ``--results``. nvidia-smi is sampled through each run for its peak
   GPU memory (summed and per GPU);
4. reads each run's RUN_DIR/metrics.jsonl and prints, per run, the mean over the steps after the
   first (step 1 pays the start-up: compilation, first weight load) of timing/wait_s, prepare_s,
   update_s, broadcast_s, step_s and perf/tokens_per_s, staleness (mean, max), the waste
   (``rollout/waste_frac`` when the learner logs it, else the share of groups the intake dropped as
   stale), the reward and turns curves, the reward against wall-clock (seconds since the end of
   step 1, which every mode spends the same way: start-up and one batch on the first weights),
   every ``weights/*`` metric, and from the recordings the episodes' lengths (response tokens and
   turns: median, p90, p99; all episodes, and those sampled by the warmed model alone);
5. compares each async run with the sync run of its repeat: ``throughput_vs_sync`` (sync's step
   time / the run's, the run's tokens/s / sync's) and the reward criterion: the wall-clock time at
   which the run's trailing mean reward (5 steps) first reaches sync's final mean reward (mean of
   its last 5 steps), against sync's total time (``comparisons``, one per repeat;
   ``comparison`` too with one repeat). ``summary`` (bench/_repeats.py) gives per configuration
   every figure's per-repeat values with median, min and max, and per async configuration the
   headline ratios against sync: the median of the per-repeat ratios with their min and max, the
   ratio of the medians and the pooled ratio. Table on stderr, one JSON line on stdout (also
   written to ``--results`` after every run, so a run cut short still leaves the earlier ones),
   and the reward curves against wall-clock in one PNG beside it (``--results`` with ``.png``).

Exit status 0 when every run finished all its steps, 1 otherwise (the JSON says which and why,
with the tail of the failed run's log, or which runs are still ``pending``), 2 on bad arguments
(a placement the machine cannot run included), 3 when the warm-up's probe is below
``--min-probe``.

    python3 bench/e2e.py                          # GPU: longtail, 4 runs, ~10 minutes on one H100
    python3 bench/e2e.py --gpus 2                 # learner on GPU 0, rollout server on GPU 1
    python3 bench/e2e.py --gpus 2 --staleness 0,2 --repeats 3 --resume   # until all 6 runs are done
    python3 bench/e2e.py --placement 'learner=0,1;rollout=2;rollout=3'  # 4 GPUs
    python3 bench/e2e.py --workload calc          # the demo's task, max_staleness 0 and 2
    .venv/bin/python bench/e2e.py                 # CPU: the tiny model, few steps, small batches
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import _placement  # noqa: E402  (after the checkout is on the path)
from bench._common import GpuMemory, Progress, gpu_count, gpu_names, ratio, tail  # noqa: E402
from bench._repeats import summarize_repeats, summary_text  # noqa: E402
from common.file_tail import LineTail  # noqa: E402
from rollout_service.recording import read_recording  # noqa: E402
from tools.make_tiny_data import make_longtail_data, make_tiny_data  # noqa: E402
from tools.make_tiny_model import (  # noqa: E402
    TinyModelSpec,
    make_tiny_model,
)
from tools.timeline import draw_beside  # noqa: E402

MARKER_ENV = "AGENTRL_E2E_BENCH_ID"
"""Set in bin/train's environment; every process of a run inherits it (the final sweep's key)."""
TIMINGS = (
    "timing/wait_s",
    "timing/prepare_s",
    "timing/update_s",
    "timing/broadcast_s",
    "timing/step_s",
    "perf/tokens_per_s",
)
EXTRA_MEANS = (
    "staleness/mean",
    "staleness/max",
    "intake/dropped_stale",
    "response/length_mean",
    "perf/update_tokens_per_s",
    "actor/entropy",
    "episode/turns_max",
    "rollout/waste_frac",
)
WASTE = "rollout/waste_frac"
"""The learner's share of generated tokens never trained (cumulative), where it logs it."""
REWARD_WINDOW = 5
"""Steps of the trailing mean in the reward criterion (sync's final reward: its last 5 steps)."""
# TinyModelSpec fields per --shape (vocab_size 512 is the tiny tokenizer's).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},  # TinyModelSpec's defaults: hidden 128, 2 layers, ~0.4M parameters
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "max_position_embeddings": 4096,
    },
}
QWEN2_VOCAB = 151936
"""Qwen2-0.5B's embedding rows (--vocab qwen2). The tokenizer has 512 ids: a random model samples the
ids above them, which the learner refuses (token ids are checked against the tokenizer's vocabulary)."""
# Overrides on the CPU: the GPU configs' settings that only a GPU runs, and a small batch.
CPU_OVERRIDES = [
    "trainer.device=cpu",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.enforce_eager=true",
    "actor_rollout_ref.rollout.compilation_config=null",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.rollout.max_num_seqs=32",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.optim.lr=3.0e-4",
    "rollout_server.max_concurrent_episodes=32",
    "ray.num_cpus=2",
]
DEADLINE_CUDA_S = 570.0
"""longtail on a GPU: the four runs fit a 10-minute command (after a --prepare-only one)."""
RUN_FLOOR_S = 100.0
"""With a deadline, the time left that the first run of a command needs to start."""
LEGACY_WORDS = {
    "learner=0;rollout=0": "one shared GPU",
    "learner=0;rollout=1": "learner GPU 0, rollout GPU 1",
}
"""``gpus_used`` of the --gpus 1|2 placements, as bench/simulate.py and bench/clustersim read it."""
EXIT_WARMUP_MISSED = 3
"""Exit status when the warm-up's probe is below --min-probe (nothing was timed)."""
RESUME_KEYS = (
    "workload",
    "device",
    "shape",
    "vocab",
    "dtype",
    "steps",
    "config",
    "overrides",
    "model",
)
"""What the runs kept by --resume must share with this call (and the placement's spec)."""


@dataclass(frozen=True)
class Workload:
    """What a workload runs: its config, data set, warm-up and defaults (per device: cuda, cpu)."""

    config: Path
    data: str  # folder under the work dir
    staleness: str
    steps: dict[str, int]
    timeout_s: dict[str, float]
    warmup_args: dict[
        str, list[str]
    ]  # tools/warmup.py's arguments besides model, data, out, steps, seconds, device, target, seed
    warmup_target: dict[str, float]  # the probe it stops at, and --min-probe's default
    warmup_steps: dict[str, int]
    warmup_seconds: dict[str, float]
    warm_suffix: str  # the warmed model is <model>-warm<suffix>
    warmup_data: str = "train.jsonl"  # the warm-up's rows, in the data folder
    deadline_s: dict[str, float] = field(
        default_factory=dict
    )  # of the whole bench; a device not named: none
    cpu_overrides: list[str] = field(default_factory=list)


WORKLOADS = {
    # The long-tail set: whole right episodes (never cut: a model trained on the first turns only
    # loses its way in long contexts) of warmup.jsonl (more long chains than the workload, so that
    # every count of steps left is copied, not only the common small ones), in length-bucketed
    # batches, until the held-out probe reaches the target: the warmed model must follow long chains
    # to their end, the tail comes from its own sampling. On a GPU the target is where the runs of
    # docs/performance.md start (0.2); the caps leave room for a slower GPU to get there, and for
    # a warm-up whose kernels part from the usual path (2 of 6 H200 leases were at 0.08-0.10 after
    # 360 s, still rising): 480 s plus the model's writing fit one 10-minute device command.
    "longtail": Workload(
        config=ROOT / "configs" / "longtail_e2e.yaml",
        data="data-longtail",
        staleness="0,1,2,4",
        steps={"cuda": 10, "cpu": 4},
        timeout_s={"cuda": 240.0, "cpu": 420.0},
        warmup_args={
            d: ["--tools", "calculator", "--bucket", "--drill-weight", "1.0"]
            for d in ("cuda", "cpu")
        },
        warmup_target={"cuda": 0.2, "cpu": 0.7},
        warmup_steps={"cuda": 1500, "cpu": 3000},
        warmup_seconds={"cuda": 480.0, "cpu": 2700.0},
        warm_suffix="-longtail",
        deadline_s={"cuda": DEADLINE_CUDA_S},
        warmup_data="warmup.jsonl",
        cpu_overrides=["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
    ),
    # bin/demo's first stage: half the demonstrations call the calculator, half box a guess; stop at
    # a 0.15 chance of a whole right episode.
    "calc": Workload(
        config=ROOT / "configs" / "gpu_e2e.yaml",
        data="data",
        staleness="0,2",
        steps={"cuda": 6, "cpu": 3},
        timeout_s={"cuda": 420.0, "cpu": 420.0},
        warmup_args={d: ["--guess-fraction", "0.5"] for d in ("cuda", "cpu")},
        warmup_target={"cuda": 0.15, "cpu": 0.15},
        warmup_steps={"cuda": 1000, "cpu": 500},
        warmup_seconds={"cuda": 300.0, "cpu": 1200.0},
        warm_suffix="",
        cpu_overrides=["actor_rollout_ref.rollout.max_model_len=768"],
    ),
}
STOP_GRACE_S = 60.0
progress = Progress("e2e")
T0 = progress.t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="e2e",
        description=(__doc__ or "").split("\n\n")[0],
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
    return a


def apply_device_defaults(a: argparse.Namespace, device: str) -> None:
    """The workload's defaults for ``device`` where an argument was not given."""
    w = WORKLOADS[a.workload]
    a.steps = a.steps or w.steps[device]
    a.timeout_s = a.timeout_s or w.timeout_s[device]
    a.warmup_steps = a.warmup_steps or w.warmup_steps[device]
    a.warmup_seconds = a.warmup_seconds or w.warmup_seconds[device]
    a.deadline_s = (
        a.deadline_s if a.deadline_s is not None else w.deadline_s.get(device)
    ) or None  # 0: none
    a.warmup_target = max(w.warmup_target[device], a.min_probe or 0.0)
    a.min_probe = w.warmup_target[device] if a.min_probe is None else a.min_probe


def run_limit(a: argparse.Namespace, walls: list[float]) -> float | None:
    """The next run's wall-clock limit: ``--timeout-s``, and with ``--deadline-s`` what is left of
    it; None when what is left is shorter than the longest run of this call so far (``walls``;
    RUN_FLOOR_S before the first): a run cut short is not a figure, so it waits for --resume."""
    if a.deadline_s is None:
        return a.timeout_s
    left = a.deadline_s - (time.monotonic() - T0) - STOP_GRACE_S / 2
    return min(a.timeout_s, left) if left >= max(walls, default=RUN_FLOOR_S) else None


def schedule(staleness: list[int], repeats: int) -> list[tuple[int, int]]:
    """(repeat, max_staleness) in run order: every configuration once, then again (interleaved,
    so that a drift of the machine hits every configuration alike)."""
    return [(r, s) for r in range(1, repeats + 1) for s in staleness]


def label(staleness: int) -> str:
    return "sync" if staleness == 0 else f"async-s{staleness}"


def resolve_device(asked: str) -> str:
    if asked != "auto":
        return asked
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- model and data


def model_spec(shape: str, vocab: str) -> Any:

    fields = dict(SHAPES[shape])
    if vocab == "qwen2":
        fields["vocab_multiple"] = QWEN2_VOCAB  # the 512-id tokenizer rounded up to 151936 rows
    return TinyModelSpec(**fields)


def write_model(out: Path, shape: str, vocab: str, dtype: str) -> Path:
    """The random model in `dtype`, reused when an earlier call wrote the same one."""
    import inspect
    from dataclasses import asdict

    spec = model_spec(shape, vocab)
    stamp = (
        out.parent / f"{out.name}.json"
    )  # outside the model directory: make_tiny_model refuses stray files
    want = {"spec": asdict(spec), "dtype": dtype}
    if stamp.is_file() and (out / "model.safetensors").is_file():
        try:
            if json.loads(stamp.read_text()) == want:
                progress(f"model: reusing {out}")
                return out
        except ValueError:
            pass
    stamp.unlink(missing_ok=True)
    if out.exists():
        shutil.rmtree(out)
    progress(f"model: writing {shape} ({vocab} vocabulary, {dtype}) to {out}")
    t0 = time.monotonic()
    if (
        "dtype" in inspect.signature(make_tiny_model).parameters
    ):  # tools/make_tiny_model.py's --dtype, if there
        make_tiny_model(out, spec, dtype=dtype)  # pyright: ignore[reportCallIssue]  (checked just above)
    else:
        make_tiny_model(out, spec)
    if dtype != "float32":
        convert_dtype(out, dtype)
    stamp.write_text(json.dumps(want, sort_keys=True))
    progress(
        f"model: written in {time.monotonic() - t0:.1f} s ({params_of(out) / 1e6:.0f}M parameters)"
    )
    return out


def convert_dtype(model_dir: Path, dtype: str) -> None:
    """Rewrite model.safetensors (floating tensors) and config.json's dtype in `dtype`, unless they
    already are."""
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    if all(t.dtype == target for t in tensors.values() if t.is_floating_point()):
        return
    save_file(
        {
            k: (t.to(target) if t.is_floating_point() else t).contiguous()
            for k, t in tensors.items()
        },
        str(path),
        metadata={"format": "pt"},
    )
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = dtype
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (model_dir / "tiny_model.json").unlink(missing_ok=True)  # its file hashes no longer hold


def params_of(model_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        for k in f.keys():
            size = 1
            for d in f.get_slice(k).get_shape():
                size *= d
            n += size
    return n


def write_data(out: Path, workload: str) -> Path:
    """The workload's train.jsonl / val.jsonl: reused for calc; rewritten for longtail (milliseconds,
    deterministic), so a changed generator never leaves stale rows behind."""

    if workload == "longtail":
        make_longtail_data(out)
        progress(f"data: long-tail set written to {out}")
        return out
    if (out / "train.jsonl").is_file() and (out / "val.jsonl").is_file():
        progress(f"data: reusing {out}")
        return out
    make_tiny_data(out)
    progress(f"data: written to {out}")
    return out


def file_digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def run_warmup(
    model: Path, data: Path, out: Path, device: str, steps: int, seconds: float, extra: list[str]
) -> dict[str, Any]:
    """tools/warmup.py on the rows in ``data`` in a child process (its own session, bounded); reused
    when an earlier call warmed the same model on the same rows with the same settings (``extra``
    holds the seed and the target). Returns its summary."""
    want = {
        "source_model": str(model),
        "device": device,
        "max_steps": steps,
        "cap_seconds": seconds,
        "args": extra,
        "data": file_digest(data),
    }
    stamp = out.parent / f"{out.name}.json"
    if stamp.is_file() and (out / "warmup.json").is_file():
        try:
            kept = json.loads(stamp.read_text())
            if kept.get("want") == want:
                progress(
                    f"warm-up: reusing {out} ({kept['summary'].get('steps')} steps, "
                    f"probe {kept['summary'].get('probe')})"
                )
                return dict(kept["summary"])
        except (ValueError, KeyError):
            pass
    stamp.unlink(missing_ok=True)
    if out.exists():
        shutil.rmtree(out)
    cmd = [
        sys.executable,
        str(ROOT / "bin" / "warmup"),
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(out),
        *extra,
        "--steps",
        str(steps),
        "--max-seconds",
        str(seconds),
        "--device",
        device,
    ]
    if device == "cuda":  # a 0.5B model from random weights: smaller steps, clipped
        cmd += ["--lr", "5e-4", "--grad-clip", "1.0"]
    progress(f"warm-up: at most {steps} steps / {seconds:g} s on {device} -> {out}")
    t0 = time.monotonic()
    limit = seconds + 180.0  # loading the model and building the demonstrations come on top
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=None, start_new_session=True, cwd=ROOT
    )
    try:
        stdout, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.wait()
        raise RuntimeError(f"warm-up did not finish within {limit:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"warm-up failed (exit status {proc.returncode}); its errors are above")
    summary = json.loads(stdout.decode().strip().splitlines()[-1])
    stamp.write_text(json.dumps({"want": want, "summary": summary}, sort_keys=True))
    progress(
        f"warm-up: {summary['steps']} steps in {time.monotonic() - t0:.1f} s (stopped: {summary['stopped']}, "
        f"probe {summary['probe']})"
    )
    return summary


# ---------------------------------------------------------------- runs


def preflight(args: argparse.Namespace, overrides: list[str]) -> None:
    """``bin/train --check`` with every override the runs will get (the model path pointed at an
    existing directory): a config mistake fails here, in seconds, not after the warm-up."""
    cmd = [
        sys.executable,
        str(ROOT / "bin" / "train"),
        "--config",
        str(args.config),
        *overrides,
        f"trainer.total_training_steps={args.steps}",
        f"actor_rollout_ref.rollout.max_staleness={max(args.staleness_values)}",
        *args.overrides,
        "--check",
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise RuntimeError("bin/train --check did not answer within 120 s") from None
    if out.returncode != 0:
        raise RuntimeError(
            f"bin/train --check refuses the config (exit status {out.returncode}):\n"
            f"{out.stderr.strip()[-3000:]}"
        )
    progress("config: bin/train --check passes")


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def sweep(marker: str) -> list[int]:
    """SIGKILL every process (but us) whose environment carries this bench run's marker."""
    import psutil

    killed = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(MARKER_ENV) == marker:
                p.kill()
                killed.append(p.pid)
        except psutil.Error:
            continue
    return killed


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The per-step records of metrics.jsonl (a half-written last line is skipped)."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "timing/step_s" in rec:
            out.append(rec)
    by_step = {int(r["step"]): r for r in out}  # a step logged twice: the later record counts
    return [by_step[s] for s in sorted(by_step)]


def run_train(
    args: argparse.Namespace,
    staleness: int,
    repeat: int,
    overrides: list[str],
    work: Path,
    limit_s: float,
) -> dict[str, Any]:
    """One bin/train run of ``max_staleness`` ``staleness`` (repeat ``repeat``), followed step by
    step, stopped at ``limit_s``, its peak GPU memory sampled throughout. Returns its record."""
    name = f"run-{args.workload}-{args.placement.slug}-s{staleness}-r{repeat}"
    run_dir = work / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    log = work / f"{name}.train.log"
    marker = uuid.uuid4().hex
    tag = f"{label(staleness)} r{repeat}"
    progress(
        f"run {tag} (max_staleness={staleness}, {args.placement.spec}): bin/train, {args.steps} "
        f"steps, limit {limit_s:.0f} s, logs {run_dir / 'logs'}"
    )
    result: dict[str, Any] = {
        "label": label(staleness),
        "max_staleness": staleness,
        "repeat": repeat,
        "placement": args.placement.spec,
        "run_dir": str(run_dir),
        "steps_asked": args.steps,
    }
    t0 = time.monotonic()
    with log.open("wb") as out, GpuMemory() as memory:
        proc = subprocess.Popen(
            train_command(args, staleness, overrides, run_dir),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, **{MARKER_ENV: marker}),
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            result |= follow(proc, run_dir, args.steps, tag, t0, limit_s)
        finally:
            stop_run(proc, marker, tag)
    result |= {
        "exit_status": proc.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
        "gpu_memory": memory.summary(),
    }
    close_run(args, result, run_dir, log, limit_s, tag)
    if args.save_logs is not None:
        save_logs(args.save_logs / name, run_dir, log)
    return result


def train_command(
    args: argparse.Namespace, staleness: int, overrides: list[str], run_dir: Path
) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "bin" / "train"),
        "--config",
        str(args.config),
        *overrides,
        f"trainer.run_dir={run_dir}",
        f"trainer.total_training_steps={args.steps}",
        f"actor_rollout_ref.rollout.max_staleness={staleness}",
        *args.overrides,
    ]


def follow(
    proc: subprocess.Popen[bytes], run_dir: Path, steps: int, tag: str, t0: float, limit_s: float
) -> dict[str, Any]:
    """Report each step as metrics.jsonl gets it until bin/train exits, ``limit_s`` passes, or the
    learner refuses every batch before a first step. Returns timed_out, first_step_after_s and
    what was refused."""
    seen, first_step_at = 0, None
    out: dict[str, Any] = {"timed_out": False}
    refused = RefusalWatch(run_dir / "logs" / "learner.log")
    while proc.poll() is None:
        if time.monotonic() > t0 + limit_s:
            out["timed_out"] = True
            break
        if refused.poll() and seen == 0:
            out["refused"] = refused.first
            progress(
                f"  {tag}: the learner refuses the rollout server's batches ({refused.count} times; "
                f"no step done), giving up: {refused.first}"
            )
            break
        records = read_metrics(run_dir / "metrics.jsonl")
        for r in records[seen:]:
            if first_step_at is None:
                first_step_at = time.monotonic() - t0
            progress(
                f"  {tag} step {r['step']}/{steps}: reward {r.get('reward/mean', float('nan')):.3f} "
                f"turns {r.get('episode/turns_mean', float('nan')):.2f}  step {r['timing/step_s']:.2f} s "
                f"(wait {r.get('timing/wait_s', 0):.2f} prep {r.get('timing/prepare_s', 0):.2f} "
                f"upd {r.get('timing/update_s', 0):.2f} bcast {r.get('timing/broadcast_s', 0):.2f})"
            )
        seen = max(seen, len(records))
        time.sleep(1.0)
    out["first_step_after_s"] = round(first_step_at, 1) if first_step_at is not None else None
    return out


def stop_run(proc: subprocess.Popen[bytes], marker: str, tag: str) -> None:
    """bin/train and everything it started, gone: SIGTERM (it stops its children) with
    STOP_GRACE_S of grace if it still runs, then SIGKILL to its group and to every process carrying
    the run's marker."""
    if proc.poll() is None:  # timed out, or this bench was interrupted
        progress(f"  {tag}: stopping bin/train (SIGTERM, {STOP_GRACE_S:g} s grace)")
        kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
    kill_group(proc.pid)  # anything left in its group
    if stray := sweep(marker):
        progress(f"  {tag}: killed {len(stray)} stray processes of the run")


def close_run(
    args: argparse.Namespace,
    result: dict[str, Any],
    run_dir: Path,
    log: Path,
    limit_s: float,
    tag: str,
) -> None:
    """The run's figures (metrics, weight updates, episodes' lengths) into ``result``, and whether
    it finished all its steps (else why not, with the tail of its log)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    result |= summarize(records)
    result["weight_updates"] = weight_updates(records, run_dir / "logs")
    try:
        result["_episodes"] = read_episodes(run_dir / "recordings")  # main() pools and drops them
        result["lengths"] = episode_lengths(result["_episodes"])
    except Exception as e:  # a damaged recording costs the lengths, not the run's figures
        result["lengths"] = {"error": f"{type(e).__name__}: {e}"}
    timed_out = result["timed_out"]
    all_steps = result["steps_done"] >= args.steps
    # A limit reached after the last step (the final checkpoint, the shutdown) costs no figure:
    # they are all in metrics.jsonl by then.
    result["ok"] = all_steps and (timed_out or result["exit_status"] == 0)
    if result["ok"]:
        late = (
            f" (stopped at its limit of {limit_s:.0f} s after its last step)" if timed_out else ""
        )
        progress(f"  {tag}: done in {result['wall_s']:.1f} s{late}")
        return
    why = (
        f"timed out after {limit_s:.0f} s"
        if timed_out
        else f"bin/train exit status {result['exit_status']}"
    )
    if "refused" in result:
        why = f"the learner refused every batch ({result['refused']})"
    result["error"] = f"{why}, {result['steps_done']}/{args.steps} steps"
    result["log_tail"] = tail(log)
    progress(f"  {tag}: FAILED ({result['error']}); bin/train's output ends:\n{result['log_tail']}")


class RefusalWatch:
    """Counts the learner's "invalid message" warnings (a batch it refused: e.g. token ids outside the
    tokenizer's vocabulary). A run whose every batch is refused never takes a step: better to stop
    it at once than to wait out its time limit."""

    LIMIT = 20

    def __init__(self, log: Path) -> None:
        self.tail, self.count, self.first = LineTail(log, from_start=True), 0, ""

    def poll(self) -> bool:
        for raw in self.tail.read_lines():
            line = raw.decode("utf-8", errors="replace")
            if "invalid message" in line:
                self.count += 1
                if not self.first:
                    self.first = line.split("invalid message", 1)[1].strip()[:300]
        return self.count >= self.LIMIT


def tokens_per_s(steps: list[dict[str, Any]]) -> float | None:
    """The steps' tokens over their time. Not the mean of each step's ``perf/tokens_per_s``: an
    async run alternates short steps and steps that wait for data, with about the same tokens, and
    that mean would count the short ones as the run's pace."""
    pairs = [
        (float(r["perf/tokens_per_s"]) * float(r["timing/step_s"]), float(r["timing/step_s"]))
        for r in steps
        if isinstance(r.get("perf/tokens_per_s"), (int, float))
        and isinstance(r.get("timing/step_s"), (int, float))
    ]
    seconds = sum(t for _, t in pairs)
    return round(sum(n for n, _ in pairs) / seconds, 4) if seconds > 0 else None


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the steps after the first (all of them when there is only one), curves, weights/*."""
    out: dict[str, Any] = {"steps_done": len(records)}
    if not records:
        return out
    body = records[1:] or records
    out["mean_over_steps"] = [int(r["step"]) for r in body]

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in body if isinstance(r.get(key), (int, float))]
        return round(sum(vals) / len(vals), 4) if vals else None

    out["means"] = {k: mean(k) for k in (*TIMINGS, *EXTRA_MEANS)}
    out["means"]["perf/tokens_per_s"] = tokens_per_s(body)
    weight_keys = sorted({k for r in records for k in r if k.startswith("weights/")})
    out["weights"] = {k: mean(k) for k in weight_keys}
    out["step1"] = {
        k: (round(float(records[0][k]), 4) if k in records[0] else None) for k in TIMINGS
    }
    out["reward_curve"] = [round(float(r.get("reward/mean", float("nan"))), 4) for r in records]
    out["turns_curve"] = [
        round(float(r.get("episode/turns_mean", float("nan"))), 3) for r in records
    ]
    turns = [float(r["episode/turns_mean"]) for r in records if "episode/turns_mean" in r]
    out["turns_mean"] = round(sum(turns) / len(turns), 3) if turns else None
    maxima = [
        float(r["staleness/max"])
        for r in records
        if isinstance(r.get("staleness/max"), (int, float))
    ]
    out["staleness_max"] = max(maxima) if maxima else None
    out["waste"] = waste(records)
    if all(isinstance(r.get("time"), (int, float)) for r in records):
        # Wall-clock from the end of step 1: start-up and the first batch (on the first weights,
        # nothing ahead of it) cost every mode the same; what differs is what follows.
        out["clock_curve"] = [
            round(float(r["time"]) - float(records[0]["time"]), 2) for r in records
        ]
        out["train_s"] = out["clock_curve"][-1]
    return out


def waste(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The share of generation never trained, up to the last step: the learner's own
    ``rollout/waste_frac`` (tokens, counting groups dropped on the servers too) when it logs it,
    else the share of groups the intake dropped as stale (groups, not tokens; server-side drops
    unseen)."""
    if not records:
        return {}
    last = records[-1]
    logged = {
        k: round(float(v), 4)
        for k, v in last.items()
        if k.startswith("rollout/waste") and isinstance(v, (int, float))
    }
    if WASTE in logged:
        return {"frac": logged[WASTE], "source": WASTE, "last_step": logged}
    trained = sum(
        float(r.get("batch/trajectories", 0.0)) / max(float(r.get("rollout/n", 1.0)), 1.0)
        for r in records
    )
    if isinstance(last.get("intake/dropped_stale_total"), (int, float)):
        dropped = float(last["intake/dropped_stale_total"])
    else:
        dropped = sum(float(r.get("intake/dropped_stale", 0.0)) for r in records)
    total = dropped + trained
    return {
        "frac": round(dropped / total, 4) if total else None,
        "source": "intake/dropped_stale_total (groups)",
        "dropped_groups": dropped,
        "trained_groups": round(trained, 1),
    }


def quantiles(values: list[float]) -> dict[str, float | None]:
    """Median, p90, p99 (nearest rank), max and p99 / median of ``values``."""
    v = sorted(values)
    if not v:
        return {}

    def q(p: float) -> float:
        return v[max(0, min(len(v) - 1, math.ceil(p * len(v)) - 1))]

    med = statistics.median(v)
    return {
        "median": med,
        "p90": q(0.9),
        "p99": q(0.99),
        "max": v[-1],
        "p99_over_median": round(q(0.99) / med, 2) if med else None,
    }


def length_summary(episodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Distribution of response tokens (model + tool), model tokens and turns over ``episodes``."""
    if not episodes:
        return {"episodes": 0}
    terms: dict[str, int] = {}
    for e in episodes:
        terms[e["termination"]] = terms.get(e["termination"], 0) + 1
    return {
        "episodes": len(episodes),
        "response_tokens": quantiles([e["response_tokens"] for e in episodes]),
        "model_tokens": quantiles([e["model_tokens"] for e in episodes]),
        "turns": quantiles([e["turns"] for e in episodes]),
        "reward_mean": round(statistics.fmean(e["reward"] for e in episodes), 4),
        "terminations": dict(sorted(terms.items())),
    }


def read_episodes(recordings: Path) -> list[dict[str, Any]]:
    """Every episode the rollout servers shipped (rollout_server.record=true), trained or not."""
    if not recordings.is_dir():
        return []

    out = []
    for server in sorted(p for p in recordings.iterdir() if p.is_dir()):
        for _, trajectories in read_recording(server):
            for t in trajectories:
                out.append(
                    {
                        "response_tokens": len(t.response_ids),
                        "model_tokens": int(t.response_mask.sum()),
                        "turns": int(t.num_turns),
                        "version": int(t.versions.max()) if len(t.versions) else 0,
                        "termination": t.termination,
                        "reward": float(t.reward),
                    }
                )
    return out


def episode_lengths(episodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Lengths of all shipped episodes and of those the warmed model sampled alone (version 0)."""
    return {
        "all": length_summary(episodes),
        "warmed_model": length_summary([e for e in episodes if e["version"] == 0]),
    }


APPLIED = re.compile(r"weights applied.*")
PART = re.compile(r"\b(version|prefetch_s|reload_s)=([0-9.]+)")


def weight_updates(records: list[dict[str, Any]], logs: Path) -> dict[str, Any]:
    """Each weight update end to end against its bound, both from this run. End to end
    (``weights/applied_s``): from the learner starting to gather version v until every rollout
    server generates with it. Bound: the bare ``reload_weights`` of that same file inside the
    rollout server (``prefetch_s`` + ``reload_s`` in its "weights applied" log line: the copy of the
    file onto the device before the pause and the reload inside it; slowest server) plus the
    learner's device-to-host copy of the weights at its best speed in the run (``weights/copy_s``
    of a publish into a slot file whose pages already exist; the first publishes into each new
    file also pay for faulting its pages in, which the end-to-end time includes)."""
    reload: dict[int, float] = {}
    for log in sorted(logs.glob("*.log")):
        for line in APPLIED.finditer(log.read_text(errors="replace")):
            parts = {k: float(x) for k, x in PART.findall(line.group(0))}
            if "version" in parts and "reload_s" in parts:
                v, seconds = int(parts["version"]), parts["reload_s"] + parts.get("prefetch_s", 0.0)
                reload[v] = max(reload.get(v, 0.0), seconds)
    copy = {int(r["step"]): float(r["weights/copy_s"]) for r in records if "weights/copy_s" in r}
    rows = []
    for r in records:
        if "weights/applied_s" not in r:
            continue
        v = int(r["weights/version"])
        if v in reload and copy:
            bound = reload[v] + min(copy.values())
            rows.append(
                {
                    "version": v,
                    "applied_s": round(float(r["weights/applied_s"]), 4),
                    "reload_s": reload[v],
                    "d2h_s": round(min(copy.values()), 4),
                    "bound_s": round(bound, 4),
                    "ratio": round(float(r["weights/applied_s"]) / bound, 3),
                }
            )
    if not rows:
        return {"versions": []}
    return {
        "versions": rows,
        "median_applied_s": statistics.median(x["applied_s"] for x in rows),
        "median_bound_s": statistics.median(x["bound_s"] for x in rows),
        "median_ratio": statistics.median(x["ratio"] for x in rows),
    }


def save_logs(dest: Path, run_dir: Path, train_log: Path, max_bytes: int = 2 * 1024 * 1024) -> None:
    """Copy what explains a run (metrics, resolved config, the tail of every log) to `dest`."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        files = [
            run_dir / "metrics.jsonl",
            run_dir / "config.resolved.yaml",
            train_log,
            *sorted((run_dir / "logs").glob("*")),
        ]
        for f in files:
            if not f.is_file():
                continue
            with f.open("rb") as src:
                src.seek(max(0, f.stat().st_size - max_bytes))
                (dest / f.name).write_bytes(src.read())
    except OSError as e:
        progress(f"could not copy the logs to {dest}: {e}")


# ---------------------------------------------------------------- report


def fmt(v: Any, width: int = 9) -> str:
    if v is None:
        return "-".rjust(width)
    if isinstance(v, float):
        return (f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3f}").rjust(width)
    return str(v).rjust(width)


def table(runs: list[dict[str, Any]]) -> str:
    cols = [
        ("wait", "timing/wait_s"),
        ("prepare", "timing/prepare_s"),
        ("update", "timing/update_s"),
        ("bcast", "timing/broadcast_s"),
        ("step", "timing/step_s"),
        ("tok/s", "perf/tokens_per_s"),
        ("stale", "staleness/mean"),
        ("dropped", "intake/dropped_stale"),
    ]
    head = (
        "run            steps "
        + "".join(n.rjust(9) for n, _ in cols)
        + "".join(n.rjust(9) for n in ("st max", "waste", "turns", "GPU MiB"))
    )
    lines = ["mean over steps 2.. (seconds unless named):", head]
    for r in runs:
        means = r.get("means", {})
        name = f"{r.get('label', r['max_staleness'])} r{r.get('repeat', 1)}"
        row = f"{name:<13}  {r.get('steps_done', 0):>5} "
        row += "".join(fmt(means.get(k)) for _, k in cols)
        row += (
            fmt(r.get("staleness_max"))
            + fmt((r.get("waste") or {}).get("frac"))
            + fmt(r.get("turns_mean"))
            + fmt((r.get("gpu_memory") or {}).get("peak_gpu_mib"))
        )
        if not r.get("ok"):
            row += f"   FAILED: {r.get('error')}"
        lines.append(row)
    for r in runs:
        name = f"{r.get('label', r['max_staleness'])} r{r.get('repeat', 1)}"
        lines.append(
            f"{name}: reward {r.get('reward_curve')}  turns {r.get('turns_curve')}  "
            f"step 1 {fmt((r.get('step1') or {}).get('timing/step_s')).strip()} s, first step after "
            f"{r.get('first_step_after_s')} s, wall {r.get('wall_s')} s"
        )
        if r.get("clock_curve"):
            lines.append(f"{name}: seconds since the end of step 1 {r['clock_curve']}")
        for which, d in (r.get("lengths") or {}).items():
            if isinstance(d, dict) and d.get("episodes"):
                rt, tu = d["response_tokens"], d["turns"]
                lines.append(
                    f"{name}: {which} episodes {d['episodes']}: response tokens median {rt['median']:g} "
                    f"p90 {rt['p90']:g} p99 {rt['p99']:g} (p99/median {rt['p99_over_median']}), turns "
                    f"median {tu['median']:g} p90 {tu['p90']:g} p99 {tu['p99']:g}, reward {d['reward_mean']}"
                )
        if (wu := r.get("weight_updates") or {}).get("versions"):
            lines.append(
                f"{name}: weight update end to end vs bound (reload_weights + D2H, same "
                f"run): median {wu['median_applied_s']:.3f} s vs {wu['median_bound_s']:.3f} s, ratio "
                f"{wu['median_ratio']:.2f}; per version "
                + ", ".join(
                    f"v{x['version']} {x['applied_s']:.3f}/{x['bound_s']:.3f}"
                    for x in wu["versions"]
                )
            )
        if r.get("weights"):
            lines.append(
                f"{name}: "
                + "  ".join(
                    f"{k.removeprefix('weights/')} {fmt(v).strip()}"
                    for k, v in r["weights"].items()
                )
            )
    return "\n".join(lines)


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each async run against sync (max_staleness 0): throughput (sync's mean step time / the run's,
    the run's tokens/s / sync's) and the reward criterion: when the run's trailing mean reward
    (REWARD_WINDOW steps) first reaches sync's final mean reward (its last REWARD_WINDOW steps), in
    seconds since the end of step 1, against sync's total time on the same clock."""
    sync = next((r for r in runs if r["max_staleness"] == 0 and r.get("steps_done")), None)
    if sync is None:
        return {}
    sm = sync.get("means", {})
    out: dict[str, Any] = {"throughput_vs_sync": {}}
    for r in runs:
        if r is sync or not r.get("steps_done"):
            continue
        m = r.get("means", {})
        out["throughput_vs_sync"][r["label"]] = {
            "step_time_ratio": ratio(sm.get("timing/step_s"), m.get("timing/step_s")),
            "tokens_per_s_ratio": ratio(m.get("perf/tokens_per_s"), sm.get("perf/tokens_per_s")),
        }
    rewards, clock = sync.get("reward_curve") or [], sync.get("clock_curve") or []
    finite = [x for x in rewards if not math.isnan(x)]
    if not finite or not clock:
        return out
    w = min(REWARD_WINDOW, len(finite))
    target = round(statistics.fmean(finite[-w:]), 4)
    crit: dict[str, Any] = {
        "window": w,
        "sync_final_reward": target,
        "sync_total_s": clock[-1],
        "runs": {},
    }
    for r in runs:
        if r is sync or not r.get("clock_curve"):
            continue
        reach = first_reach(r["reward_curve"], r["clock_curve"], w, target)
        crit["runs"][r["label"]] = reach | {"vs_sync_total": ratio(reach.get("reach_s"), clock[-1])}
    out["reward_vs_sync"] = crit
    return out


def first_reach(
    rewards: list[float], clock: list[float], window: int, target: float
) -> dict[str, Any]:
    """The first step whose trailing mean reward over ``window`` steps is >= ``target``."""
    for i in range(window - 1, len(rewards)):
        vals = [x for x in rewards[i - window + 1 : i + 1] if not math.isnan(x)]
        if vals and statistics.fmean(vals) >= target:
            return {"reach_step": i + 1, "reach_s": clock[i]}
    return {"reach_step": None, "reach_s": None}


def trailing(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        vals = [x for x in values[max(0, i - window + 1) : i + 1] if not math.isnan(x)]
        out.append(statistics.fmean(vals) if vals else float("nan"))
    return out


def plot(path: Path, result: dict[str, Any]) -> None:
    """The reward of every run against wall-clock (since the end of step 1) in one PNG: each step's
    mean reward (dots) and its trailing mean (line), one colour per configuration (its repeats
    alike); sync's final mean reward dashed (the median over its repeats)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5.5))
        colours: dict[str, str] = {}
        for r in result["runs"]:
            xs, ys = r.get("clock_curve"), r.get("reward_curve")
            if not xs or not ys:
                continue
            first = r["label"] not in colours
            colour = colours.setdefault(r["label"], f"C{len(colours) % 10}")
            ax.plot(
                xs,
                trailing(ys, REWARD_WINDOW),
                lw=2 if first else 1.2,
                color=colour,
                label=f"{r['label']} (mean of {REWARD_WINDOW})" if first else None,
            )
            ax.plot(xs, ys, "o", ms=3.5, alpha=0.6, color=colour)
        sync = ((result.get("summary") or {}).get("configurations") or {}).get("sync")
        target = sync["figures"]["final_reward"]["median"] if sync else None
        if target is not None:
            ax.axhline(target, ls="--", lw=1, color="grey", label=f"sync final reward {target:.3f}")
        ax.set_xlabel("wall-clock since the end of step 1 (s)")
        ax.set_ylabel("mean reward per step")
        ax.set_title(
            f"bench/e2e.py --workload {result.get('workload')}: {result.get('device')}, "
            f"{result.get('shape')}, {(result.get('placement') or {}).get('spec', '')}".rstrip(", ")
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        progress(f"plot: {path}")
    except Exception as e:  # the figures are in the JSON; a missing plot is not a failed bench
        progress(f"could not draw {path}: {type(e).__name__}: {e}")


def write_results(path: Path, result: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(result, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as e:
        progress(f"could not write {path}: {e}")


class WarmupMissed(RuntimeError):
    """The warm-up's probe is below --min-probe: no run is timed on that model."""


class ResumeRefused(RuntimeError):
    """--resume names a result made another way: it is left as it is."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    results_path = args.results or work / f"e2e-results-{args.workload}-{args.placement.slug}.json"
    result: dict[str, Any] = {"bench": "e2e", "workload": args.workload, "ok": False, "runs": []}
    try:
        overrides = prepare(args, work, result)
        if args.prepare_only:
            result["ok"] = True
            return finish(result, results_path)
        episodes = resume(args, result, results_path)
        done = {(r.get("repeat", 1), r["max_staleness"]) for r in result["runs"]}
        todo = [x for x in schedule(args.staleness_values, args.repeats) if x not in done]
        result["pending"] = [{"repeat": r, "max_staleness": s} for r, s in todo]
        walls: list[float] = []
        for repeat, s in todo:
            limit = run_limit(args, walls)
            if limit is None:
                progress(
                    f"--deadline-s: {len(result['pending'])} runs left for a later call with "
                    "--resume (the time left is shorter than a run)"
                )
                break
            run = run_train(args, s, repeat, overrides, work, limit)
            walls.append(run["wall_s"])
            episodes += run.pop("_episodes", [])
            # where the run's time went (PNG + trace), one pair per run: repeats too
            name = f"{run['label']}-r{repeat}" if args.repeats > 1 else run["label"]
            run["timeline"] = draw_beside(Path(run["run_dir"]), results_path, name)
            result["runs"].append(run)
            result["pending"].pop(0)
            report(result, episodes)
            write_results(results_path, result)
            if result["pending"]:  # the last table comes with the result
                progress("\n" + table(result["runs"]))
        result["ok"] = not result["pending"] and all(r.get("ok") for r in result["runs"])
        if result["pending"]:
            result["error"] = f"{len(result['pending'])} runs pending: run again with --resume"
    except _placement.PlacementError as e:
        result["error"] = f"--placement {e}"
        progress(f"error: {result['error']}")
        return finish(result, results_path, 2)
    except WarmupMissed as e:
        result["error"] = str(e)
        progress(f"error: {e}")
        return finish(result, results_path, EXIT_WARMUP_MISSED)
    except ResumeRefused as e:
        result["error"] = str(e)
        progress(f"error: {e}")
        return finish(result, results_path, 2, write=False)
    except KeyboardInterrupt:
        result["error"] = "interrupted"
        progress("interrupted")
    except Exception as e:  # reported in the JSON line: the caller may only see stdout
        result["error"] = f"{type(e).__name__}: {e}"
        progress(f"error: {result['error']}")
    return finish(result, results_path)


def prepare(args: argparse.Namespace, work: Path, result: dict[str, Any]) -> list[str]:
    """Device, placement (checked against the machine), config check, model, data and warm-up
    (its probe checked); the JSON's header into ``result``. Returns the overrides of every run."""
    device = resolve_device(args.device)
    apply_device_defaults(args, device)
    shape = args.shape if args.shape != "auto" else ("0.5b" if device == "cuda" else "tiny")
    dtype = "bfloat16" if device == "cuda" else "float32"
    placement: _placement.Placement = args.placement
    result |= {
        "device": device,
        "shape": shape,
        "vocab": args.vocab,
        "dtype": dtype,
        "steps": args.steps,
        "config": str(args.config),
        "overrides": args.overrides,
        "staleness": args.staleness_values,
        "repeats": args.repeats,
        "placement": placement.as_json(),
    }
    if device == "cuda":
        result["gpus"] = gpu_names()
        result["gpus_used"] = LEGACY_WORDS.get(placement.spec, placement.describe())
    check_placement(placement, args.overrides, device)
    workload = WORKLOADS[args.workload]
    progress(
        f"workload {args.workload}, device {device}, shape {shape}, dtype {dtype}, staleness "
        f"{args.staleness_values} x {args.repeats}, {args.steps} steps per run, placement "
        f"{placement.describe()}, work dir {work}"
    )
    data_dir = work / workload.data
    data_overrides = [
        f"data.train_files={data_dir / 'train.jsonl'}",
        f"data.val_files={data_dir / 'val.jsonl'}",
    ]
    device_overrides = [*CPU_OVERRIDES, *workload.cpu_overrides] if device == "cpu" else []
    device_overrides += placement.overrides(device)
    preflight(args, [f"actor_rollout_ref.model.path={work}", *data_overrides, *device_overrides])
    model = write_model(work / f"model-{shape}-{args.vocab}-{dtype}", shape, args.vocab, dtype)
    result["parameters"] = params_of(model)
    data = write_data(data_dir, args.workload)
    if not args.no_warmup:
        model, result["warmup"] = warm_up(args, model, data / workload.warmup_data, device)
        check_probe(result["warmup"], model)
    result["model"] = str(model)
    return [f"actor_rollout_ref.model.path={model}", *data_overrides, *device_overrides]


def check_placement(p: _placement.Placement, overrides: list[str], device: str) -> None:
    """No override contradicts the placement, and on a GPU machine every GPU it names exists."""
    if bad := _placement.conflicts(p, overrides, device):
        raise _placement.PlacementError(
            f"{p.spec!r}: the overrides {bad} set what the placement decides; say it in "
            "--placement (a server's vLLM share: rollout=GPUS@FRACTION)"
        )
    if device != "cuda":
        return
    available = gpu_count()
    if available is None:
        progress("nvidia-smi cannot count the GPUs: the placement is not checked against them")
        return
    _placement.check_gpus(p, available)


def warm_up(
    args: argparse.Namespace, model: Path, rows: Path, device: str
) -> tuple[Path, dict[str, Any]]:
    """The warmed model (run_warmup: seeded, until the probe reaches its target) and the JSON's
    record of it: the probe, its history, what stopped it, and the probe the runs need."""
    workload = WORKLOADS[args.workload]
    warm = model.parent / f"{model.name}-warm{workload.warm_suffix}"
    extra = [
        *workload.warmup_args[device],
        "--target",
        f"{args.warmup_target:g}",
        "--seed",
        str(args.warmup_seed),
    ]
    summary = run_warmup(model, rows, warm, device, args.warmup_steps, args.warmup_seconds, extra)
    keys = ("steps", "stopped", "probe", "probe_history", "seconds", "final_loss", "seed", "target")
    return warm, {k: summary.get(k) for k in keys} | {"min_probe": args.min_probe}


def check_probe(record: dict[str, Any], warm: Path) -> None:
    """Raise WarmupMissed when the warm-up's probe is below its minimum (recorded as probe_ok)."""
    probe, least = record.get("probe"), float(record["min_probe"])
    record["probe_ok"] = least <= 0 or (probe is not None and probe >= least)
    if record["probe_ok"]:
        progress(f"warm-up: probe {probe} >= --min-probe {least:g}")
        return
    raise WarmupMissed(
        f"warm-up missed: its probe is {probe} after {record.get('steps')} steps, "
        f"{record.get('seconds')} s (stopped by {record.get('stopped')}), below --min-probe "
        f"{least:g}; no run is timed on a model less competent than the documented one. Raise "
        f"--warmup-steps / --warmup-seconds (a new warm-up replaces {warm}), try another "
        "--warmup-seed, or pass --min-probe 0 to time this model anyway"
    )


def resume(args: argparse.Namespace, result: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """With --resume, the finished runs of the result at ``path`` go into ``result`` when it was
    made the same way (RESUME_KEYS and the placement); its failed runs are listed as
    ``earlier_failures`` and run again. Returns the kept runs' episodes (from their recordings)."""
    if not args.resume or not path.is_file():
        return []
    try:
        old = json.loads(path.read_text())
    except ValueError as e:
        raise ResumeRefused(f"--resume: cannot read {path}: {e}") from None
    differs = [k for k in RESUME_KEYS if old.get(k) != result.get(k)]
    if (old.get("placement") or {}).get("spec") != result["placement"]["spec"]:
        differs.append("placement")
    if differs:
        raise ResumeRefused(
            f"--resume: {path} holds runs made with another {', '.join(differs)}; name another "
            "--results, or drop --resume to start over"
        )
    result["runs"] = [r for r in old.get("runs", []) if r.get("ok")]
    result["earlier_failures"] = [
        {k: r.get(k) for k in ("label", "repeat", "error")}
        for r in [*old.get("earlier_failures", []), *old.get("runs", [])]
        if not r.get("ok")
    ]
    episodes = []
    for r in result["runs"]:
        if not r.get("run_dir"):
            continue
        try:
            episodes += read_episodes(Path(r["run_dir"]) / "recordings")
        except Exception as e:  # the lengths only: the run's figures are in its record
            progress(f"--resume: cannot read the episodes of {r['run_dir']}: {e}")
    progress(f"--resume: keeping {len(result['runs'])} finished runs of {path}")
    if result["runs"]:
        report(result, episodes)
    return episodes


def report(result: dict[str, Any], episodes: list[dict[str, Any]]) -> None:
    """From ``result["runs"]``: each repeat's comparison with its sync run (and each async run's
    reward criterion in its own record), the summary over the repeats, and the episodes' lengths
    pooled over the runs."""
    runs = result["runs"]
    repeats = sorted({int(r.get("repeat", 1)) for r in runs})
    result["comparisons"] = {
        str(k): compare([r for r in runs if r.get("repeat", 1) == k]) for k in repeats
    }
    for r in runs:
        crit = result["comparisons"][str(r.get("repeat", 1))].get("reward_vs_sync") or {}
        if r["label"] in crit.get("runs", {}):
            r["reward_vs_sync"] = crit["runs"][r["label"]]
    if len(repeats) == 1:
        result["comparison"] = result["comparisons"][str(repeats[0])]
    else:
        result.pop("comparison", None)  # one per repeat: comparisons, and the summary
    result["summary"] = summarize_repeats(runs)
    # every run starts from the warmed model: its version-0 episodes, pooled, are its lengths
    result["lengths_warmed_model"] = length_summary([e for e in episodes if e["version"] == 0])
    result["lengths_all"] = length_summary(episodes)


def finish(
    result: dict[str, Any], results_path: Path, status: int | None = None, *, write: bool = True
) -> int:
    """Print the table, comparisons and summary, draw the plot, write the JSON (to stdout, and to
    ``results_path`` unless ``write`` is false). Returns the exit status: ``status`` when given,
    else 0 when ``result`` is ok, else 1."""
    result["wall_s"] = round(time.monotonic() - T0, 1)
    if result["runs"]:
        print(table(result["runs"]), file=sys.stderr, flush=True)
        for k, c in (result.get("comparisons") or {}).items():
            if c:
                print(f"repeat {k}:\n{comparison_text(c)}", file=sys.stderr, flush=True)
        if text := summary_text(result.get("summary") or {}):
            print(f"over the repeats:\n{text}", file=sys.stderr, flush=True)
        for name in ("lengths_warmed_model", "lengths_all"):
            if (d := result.get(name)) and d.get("episodes"):
                print(f"{name}: {json.dumps(d, sort_keys=True)}", file=sys.stderr, flush=True)
        result["plot"] = str(results_path.with_suffix(".png"))
        plot(results_path.with_suffix(".png"), result)
    if write:
        write_results(results_path, result)
    print(json.dumps(result, sort_keys=True), flush=True)
    if status is not None:
        return status
    return 0 if result["ok"] else 1


def comparison_text(c: dict[str, Any]) -> str:
    lines = []
    for name, t in c.get("throughput_vs_sync", {}).items():
        lines.append(
            f"{name} vs sync: step time x{t['step_time_ratio']} shorter, tokens/s x{t['tokens_per_s_ratio']}"
        )
    if crit := c.get("reward_vs_sync"):
        lines.append(
            f"sync: final mean reward {crit['sync_final_reward']} (last {crit['window']} steps), "
            f"{crit['sync_total_s']} s after step 1"
        )
        for name, x in crit["runs"].items():
            when = (
                f"at step {x['reach_step']}, {x['reach_s']} s ({x['vs_sync_total']} of sync's time)"
                if x.get("reach_s") is not None
                else "never"
            )
            lines.append(f"{name}: reaches it {when}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
