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
``--variant 'NAME:KEY=VALUE [KEY=VALUE ...]'`` (repeatable; bench/_e2e_variants.py) adds, for every
``max_staleness``, a configuration with those bin/train overrides, labelled ``sync+NAME`` /
``async-sK+NAME``, e.g. ``--variant 'early:actor_rollout_ref.actor.first_mini_batch_in_waits=true'``;
every run is compared with the base sync run. ``--repeats N`` runs every configuration N times,
interleaved (sync, async-s1, ..., then again), so that drift of the machine hits every
configuration alike.

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
   status 3) before any run is timed. The same seed gives the same model and probe, on the CPU
   and on a GPU (tools/deterministic.py: a strict backward, cuDNN attention off); the weights'
   sha256 in the results names the model, so runs of separate calls or leases can be checked to
   have trained the same one. ``--no-warmup`` trains the random model;
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

The code: this script holds the schedule of the runs, --resume and the report over the runs;
bench/_e2e_args.py the arguments; bench/_e2e_variants.py the configurations; bench/_e2e_setup.py
the workloads, model, data and warm-up; bench/_e2e_runs.py one bin/train run; bench/_e2e_summary.py
a run's figures, the comparisons, the table, plot and JSON.

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
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import _e2e_args, _placement  # noqa: E402  (after the checkout is on the path)
from bench._common import gpu_count, gpu_names  # noqa: E402
from bench._e2e_args import RUN_FLOOR_S, apply_device_defaults  # noqa: E402
from bench._e2e_runs import STOP_GRACE_S, preflight, run_train  # noqa: E402
from bench._e2e_setup import (  # noqa: E402
    CPU_OVERRIDES,
    WORKLOADS,
    WarmupMissed,
    check_probe,
    params_of,
    warm_up,
    write_data,
    write_model,
)
from bench._e2e_summary import (  # noqa: E402
    compare,
    comparison_text,
    length_summary,
    plot,
    progress,
    read_episodes,
    table,
    write_results,
)
from bench._e2e_variants import run_key, schedule  # noqa: E402
from bench._repeats import summarize_repeats, summary_text  # noqa: E402
from tools.timeline import draw_beside  # noqa: E402

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
    "variants",
)
"""What the runs kept by --resume must share with this call (and the placement's spec)."""
T0 = progress.t0
"""The bench's start, on the progress lines' clock: --deadline-s counts from here."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return _e2e_args.parse_args(argv, __doc__ or "")


def run_limit(a: argparse.Namespace, walls: list[float]) -> float | None:
    """The next run's wall-clock limit: ``--timeout-s``, and with ``--deadline-s`` what is left of
    it; None when what is left is shorter than the longest run of this call so far (``walls``;
    RUN_FLOOR_S before the first): a run cut short is not a figure, so it waits for --resume."""
    if a.deadline_s is None:
        return a.timeout_s
    left = a.deadline_s - (time.monotonic() - T0) - STOP_GRACE_S / 2
    return min(a.timeout_s, left) if left >= max(walls, default=RUN_FLOOR_S) else None


def resolve_device(asked: str) -> str:
    if asked != "auto":
        return asked
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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
        done = {run_key(r) for r in result["runs"]}
        todo = [
            (r, s, v)
            for r, s, v in schedule(args.staleness_values, args.repeats, args.configs)
            if (r, s, v.name) not in done
        ]
        result["pending"] = [
            {"repeat": r, "max_staleness": s, "variant": v.name} for r, s, v in todo
        ]
        walls: list[float] = []
        for repeat, s, variant in todo:
            limit = run_limit(args, walls)
            if limit is None:
                progress(
                    f"--deadline-s: {len(result['pending'])} runs left for a later call with "
                    "--resume (the time left is shorter than a run)"
                )
                break
            run = run_train(args, s, repeat, overrides, work, limit, variant)
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
    if named := {v.name: list(v.overrides) for v in args.configs if v.name}:
        result["variants"] = named  # absent without: results from before variants still resume
    if device == "cuda":
        result["gpus"] = gpu_names()
        result["gpus_used"] = LEGACY_WORDS.get(placement.spec, placement.describe())
    check_placement(
        placement, [*args.overrides, *(o for v in args.configs for o in v.overrides)], device
    )
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
    for variant in args.configs:
        preflight(
            args,
            [f"actor_rollout_ref.model.path={work}", *data_overrides, *device_overrides],
            variant,
        )
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
    # the model's path is the same on every machine; its weights' digest tells two warm-ups apart
    # (a call on another lease or after another warm-up); none on either side cannot be checked
    digests = [(r.get("warmup") or {}).get("weights_sha256") for r in (old, result)]
    if digests[0] != digests[1]:
        differs.append(f"warmed model (weights sha256 {digests[0]} there, {digests[1]} now)")
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


if __name__ == "__main__":
    raise SystemExit(main())
