#!/usr/bin/env python3
"""The same GRPO job on verl's own trainer and on ours, one after the other on the same GPU machine.

What a verl user asks: is this faster than what I run today, for the same job, on the same GPU?

The job: bench/e2e.py's long-tail agentic workload (multi-turn calculator chains, heavy tail of
episode lengths), the same warmed Qwen2-0.5B-shaped model, the same rows, batch (16 prompts x 8),
response limits, optimizer (AdamW, lr 2e-5, weight decay 0.01, clip 1.0), KL loss (low_var_kl,
0.001), mini-batches (64 samples: 2 optimizer steps a step), micro-batches (8) and GPUs
(``--gpus 1``: one shared; ``--gpus 2``: each configuration's own two-GPU placement, named in its
result). verl runs at its best on these machines (bench/verl_side.py: FSDP2, packed sequences
through our learner's varlen kernel, token-capped micro-batches) in its maintained synchronous
trainer and in its asynchronous ones.
verl expresses the workload as it is: its tool agent loop (``tool_agent``) with our calculator as a
function tool (bench/verl_plugins/calculator_tool.py: our evaluator, our schema byte for byte, so
the prompts are the same tokens) and our math reward as its reward function
(bench/verl_plugins/reward.py). The rows are written as verl's parquet (chat-message ``prompt``,
``data_source``, ``reward_model.ground_truth``, ``extra_info``, ``agent_name``); ours reads the
same rows from the JSONL.

Differences that remain are named in the result's ``caveats`` (CAVEATS below).

Stages (``--stage``), each bounded to fit one 10-minute command on a GPU machine:
- ``prepare``: bench/e2e.py --prepare-only (model, data, warm-up) into ``--work-dir``;
- ``verl``: first the device check of the attention plugin on the warmed model (no verl run
  without it), then each configuration of ``--verl`` for ``--steps``, interleaved, until each has
  ``--repeats`` runs in ``--work-dir`` that reached their steps (earlier calls' and leases' count:
  the GPU warm-up of a seed repeats, and the report lists the models' digests); one result file
  per run (``vs_verl-verl-LABEL-rN.json``); with ``--deadline-s`` a run starts only when the time
  left fits it. verl's per-step metrics come from its file logger (VERL_FILE_LOGGER_PATH), stamped
  as they appear;
- ``ours``: bench/e2e.py with ``--staleness`` (0 = ours sync, 1, 2 and 4 async), ``--steps`` each,
  ``--repeats`` through its ``--resume``;
- ``report``: merges the stages' JSON files of ``--work-dir`` (the verl records and every
  ``ours-e2e*.json`` of bench/e2e.py, each configuration's repeat in one file only): per
  configuration the step time and its split, tokens/s ((prompt + response tokens of the batch) /
  step time, the same definition on both sides), peak GPU memory (nvidia-smi, sampled every 0.5 s by
  this script, the same way for both), the reward against wall-clock (seconds since the end of step
  1; step 1 pays start-up), and per-step speed-ups of every configuration against the best
  synchronous trainer of either side and against each verl configuration. One JSON line on stdout,
  the JSON and a PNG of the reward curves at ``--results``.
- ``all``: the four in order (a GPU machine with time for it).

    python3 bench/vs_verl.py --stage prepare --work-dir /root/vs
    python3 bench/vs_verl.py --stage verl --work-dir /root/vs --gpus 2 --steps 10 --verl sync
    python3 bench/vs_verl.py --stage verl --work-dir /root/vs --gpus 2 --steps 10 --verl fully-async-t1 --repeats 3 --deadline-s 1200
    python3 bench/vs_verl.py --stage ours --work-dir /root/vs --steps 10 --staleness 0,2
    python3 bench/vs_verl.py --stage report --work-dir /root/vs --results docs/gpu/h100_vs_verl.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import _placement, verl_side  # noqa: E402
from bench import vs_verl_report as reporting  # noqa: E402
from bench._common import GpuMemory, Progress, tail  # noqa: E402
from bench._verl_data import write_verl_data  # noqa: E402

REWARD_WINDOW = 5
CAVEATS = [
    "verl caps a turn only by the whole response budget; ours also at 64 tokens a turn",
    "verl's reward sees tool outputs: only a \\boxed answer counts (ours falls back to the last number)",
    "both sides train packed rows through the same varlen kernel (verl through "
    "bench/verl_plugins/varlen_attention.py); ours also runs a prefix shared by a micro-batch once",
    "verl's fully-async trainer takes the old logprobs from vLLM (bypass mode, forced); ours and "
    "verl's sync trainers recompute them in a forward pass (the job has 2 mini-batches a step)",
    "verl's step is the wall-clock between two versions' metric records (stamped as they appear); "
    "ours is the learner's own step time",
]
progress = Progress("vs_verl")
VERL_RUN_FLOOR_S = 450.0
"""A verl run's wall-clock before one of this call is known: its start-up (Ray, the vLLM engine,
FSDP, the weight-sync group) and 10 versions of the long-tail job on 2 H200s."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vs_verl",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--stage", choices=("prepare", "verl", "ours", "report", "all"), default="all")
    p.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "vs_verl")
    p.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    p.add_argument("--staleness", default="0,1,2,4", help="our runs (default 0,1,2,4; 0 = sync)")
    p.add_argument("--timeout-s", type=float, default=560.0, help="limit of a stage's run(s)")
    p.add_argument("--results", type=Path, default=None, help="report JSON (and .png beside it)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--gpus",
        type=int,
        choices=sorted(_placement.SHORTHANDS),
        help="1: both sides share GPU 0; 2: verl's sync trainer colocated on both, its async ones "
        "and ours with the learner on GPU 0 and the rollout server on GPU 1 (default 1)",
    )
    where.add_argument(
        "--placement",
        help="our placement, as bench/e2e.py takes it ('learner=0;rollout=0;rollout=1'); verl "
        "gets the same GPUs: sync colocated on all of them, async split in halves",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per configuration (default 1): ours through bench/e2e.py --repeats --resume; "
        "verl's counting the runs of --work-dir that reached their steps, earlier calls' too",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="verl stage: start a run only while the time left is at least the longest run of "
        f"this call ({VERL_RUN_FLOOR_S:g} s before the first); the others wait for another call",
    )
    p.add_argument(
        "--verl",
        default="sync,fully-async-t0,fully-async-t1,separate-async-s2",
        help="verl configurations, in order (bench/verl_side.py): sync (V1, colocated), v0-sync "
        "(the deprecated trainer), separate-async-sK (V1, at most K versions old) and "
        "fully-async-tT (staleness_threshold T), both with trainer and rollout on separate GPUs; "
        "default sync,fully-async-t0,fully-async-t1,separate-async-s2",
    )
    p.add_argument(
        "--verl-arg", action="append", default=[], help="one more hydra override for verl"
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'NAME:KEY=VALUE [KEY=VALUE ...]'",
        help="our runs: bench/e2e.py --variant (repeatable): more configurations of ours",
    )
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be >= 2 (step 1 pays the start-up and is left out of the means)")
    try:
        a.placement = _placement.parse(a.placement or _placement.SHORTHANDS[a.gpus or 1])
    except _placement.PlacementError as e:
        p.error(f"--placement {e}")
    a.gpus = len(a.placement.gpus)  # verl's configurations use as many GPUs as ours
    return a


# -- running ----------------------------------------------------------------------------------------


def run_bounded(
    cmd: list[str],
    log: Path,
    timeout_s: float,
    env: dict[str, str],
    done: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Run ``cmd`` in its own session, output to ``log``; once ``done()`` (polled every second),
    or past ``timeout_s``, SIGTERM, then SIGKILL of its whole group. Returns exit status, wall
    time, whether it timed out or was stopped done, and the peak GPU memory seen meanwhile."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    with log.open("wb") as out, GpuMemory() as mem:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT
        )
        timed_out = stopped_done = False
        rc: int | None = None
        while rc is None:
            try:
                rc = proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                stopped_done = done is not None and done()
                timed_out = not stopped_done and time.monotonic() >= deadline
                if stopped_done or timed_out:
                    break
        if rc is None:
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.wait()
    peak = mem.summary() or {}
    return {
        "exit_status": rc,
        "timed_out": timed_out,
        "stopped_done": stopped_done,
        "wall_s": round(time.monotonic() - t0, 1),
        "peak_gpu_mib": peak.get("peak_gpu_mib"),
        "peak_per_gpu_mib": peak.get("peak_per_gpu_mib"),
    }


def stage_prepare(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "e2e.py"),
        "--prepare-only",
        "--work-dir",
        str(work),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout_s)
    sys.stderr.write(out.stderr[-4000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result.get("ok"):
        raise RuntimeError(f"bench/e2e.py --prepare-only failed: {result.get('error')}")
    data = write_verl_data(work / "data-longtail", work / "data-longtail-verl")
    return {
        "model": result["model"],
        "warmup": result.get("warmup"),
        "verl_data": str(data["train"]),
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return out


def check_plugin(a: argparse.Namespace, work: Path, model: str) -> dict[str, Any]:
    """bench/verl_plugins/varlen_attention.py's check on this machine's GPU, on the warmed model,
    in a child process (its GPU memory is gone before verl starts): packed logprobs through the
    varlen kernel equal per-sequence SDPA's to bf16 tolerance. verl is not timed without it."""
    cmd = [sys.executable, "-m", verl_side.ATTENTION_LIB, model, "--device", "cuda"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    (work / "verl-attention-check.log").write_text(out.stdout + out.stderr)
    try:
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        result = {"ok": False, "error": tail(work / "verl-attention-check.log", 15)}
    return result


def stage_verl(a: argparse.Namespace, work: Path, prep: dict[str, Any]) -> list[dict[str, Any]]:
    check = check_plugin(a, work, prep["model"])
    progress(f"verl attention plugin check: {json.dumps(check, sort_keys=True)}")
    if not check.get("ok") or not check.get("varlen_kernel"):
        raise RuntimeError(f"verl's packed attention failed its device check: {check}")
    out: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for _ in range(a.repeats):  # interleaved: each configuration's next run, then again
        for name in a.verl.split(","):
            cfg = verl_side.verl_config(name.strip(), a.gpus)
            kept = sorted(work.glob(f"vs_verl-verl-{cfg.label}-r*.json"))
            runs = [c for f in kept for c in (reporting.load(f) or {}).get("configs", [])]
            if sum(reporting.finished(r, a.steps) for r in runs) >= a.repeats:
                continue
            limit = run_limit(a, t0, [r["wall_s"] for r in out])
            if limit is None:
                progress(f"{cfg.label}: not started, the time left is shorter than a run")
                continue
            # one file per run, saved as it ends; a run cut short stays, numbered, not counted
            repeat = 1 + len(kept)
            result = {**run_verl(a, work, prep, cfg, repeat, limit), "attention_check": check}
            path = work / f"vs_verl-verl-{cfg.label}-r{repeat}.json"
            path.write_text(json.dumps({"configs": [result]}, indent=1) + "\n")
            out.append(result)
    return out


def run_limit(a: argparse.Namespace, t0: float, walls: list[float]) -> float | None:
    """The next verl run's limit: ``--timeout-s``, and with ``--deadline-s`` what is left of it;
    None when that is shorter than the longest run of this call (VERL_RUN_FLOOR_S before one)."""
    if a.deadline_s is None:
        return a.timeout_s
    left = a.deadline_s - (time.monotonic() - t0)
    return min(a.timeout_s, left) if left >= max(walls, default=VERL_RUN_FLOOR_S) else None


def run_verl(
    a: argparse.Namespace,
    work: Path,
    prep: dict[str, Any],
    cfg: verl_side.VerlConfig,
    repeat: int,
    limit_s: float,
) -> dict[str, Any]:
    run_dir = work / f"run-{cfg.label}-r{repeat}"
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ)
    env["VERL_FILE_LOGGER_PATH"] = str(metrics)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HYDRA_FULL_ERROR", "1")
    cmd = [
        sys.executable,
        "-m",
        cfg.module,
        *verl_side.overrides(cfg, a, prep["model"], work),
    ]
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    progress(f"{cfg.label}: {a.steps} steps, log {run_dir / 'train.log'}")
    stamped = run_dir / "stamped.jsonl"
    stamped.unlink(missing_ok=True)
    with verl_side.MetricsWatcher(metrics, out=stamped) as watch:
        run = run_bounded(
            cmd, run_dir / "train.log", limit_s, env, done=lambda: watch.has_versions(a.steps)
        )
    summary = verl_side.summarize(watch.records, cfg.timings)
    out = {
        "label": cfg.label,
        "side": "verl",
        "repeat": repeat,
        "gpus": a.gpus,
        "placement": cfg.placement(a.gpus),
        "staleness": cfg.staleness,
        "steps_asked": a.steps,
        "command": " ".join(cmd[2:]),
        "model_sha256": (prep.get("warmup") or {}).get("weights_sha256"),
        **run,
        **summary,
        "worker_plugins": verl_side.plugin_report(
            (run_dir / "train.log").read_text(errors="replace")
        ),
    }
    if not summary.get("steps_done") or (run["exit_status"] != 0 and not run["stopped_done"]):
        out["log_tail"] = tail(run_dir / "train.log")
    return out


def stage_ours(a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """bench/e2e.py on the same work directory (its warmed model), placement and steps, with its
    repeats; a call cut short leaves the rest for the next one (``--resume``)."""
    results = work / "ours-e2e.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "e2e.py"),
        *("--work-dir", str(work), "--staleness", a.staleness, "--steps", str(a.steps)),
        *("--results", str(results), "--deadline-s", str(max(a.timeout_s - 20, 100))),
        *("--placement", a.placement.spec, "--repeats", str(a.repeats), "--resume"),
        *(x for v in a.variant for x in ("--variant", v)),
    ]
    progress(f"ours: staleness {a.staleness}, {a.steps} steps, {a.repeats} repeat(s)")
    run = run_bounded(cmd, work / "ours-e2e.log", a.timeout_s, dict(os.environ))
    e2e = json.loads(results.read_text()) if results.exists() else {"runs": []}
    out = reporting.ours_configs(e2e)
    if e2e.get("pending"):
        progress(f"ours: {len(e2e['pending'])} runs pending: call --stage ours again")
    if not out:
        out.append(
            {"label": "ours", "side": "ours", **run, "log_tail": tail(work / "ours-e2e.log")}
        )
    return out


# -- report -----------------------------------------------------------------------------------------


def report(work: Path, results: Path | None) -> dict[str, Any]:
    out = reporting.report(work, CAVEATS)
    if results:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        title = "bench/vs_verl.py: verl's trainers and ours, long-tail workload"
        problem = reporting.plot(results.with_suffix(".png"), out["runs"], title)
        if problem:
            progress(f"could not draw the reward curves: {problem}")
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = a.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        return run_stages(a, work)
    except reporting.BadInput as e:
        print(f"vs_verl: {e}", file=sys.stderr)
        return 2


def run_stages(a: argparse.Namespace, work: Path) -> int:
    stages = ["prepare", "verl", "ours", "report"] if a.stage == "all" else [a.stage]
    for stage in stages:
        t0 = time.monotonic()
        if stage == "report":
            out = report(work, a.results)
            print(json.dumps(out, sort_keys=True))
            continue
        if stage == "prepare":
            saved: dict[str, Any] = stage_prepare(a, work)
        else:
            prep = reporting.load(work / "vs_verl-prepare.json")
            if prep is None:
                print(
                    f"vs_verl: run --stage prepare first (no {work}/vs_verl-prepare.json)",
                    file=sys.stderr,
                )
                return 2
            configs = stage_verl(a, work, prep) if stage == "verl" else stage_ours(a, work)
            saved = {"configs": configs}

        saved["stage_s"] = round(time.monotonic() - t0, 1)
        if stage != "verl":
            (work / f"vs_verl-{stage}.json").write_text(json.dumps(saved, indent=1) + "\n")
        progress(f"{stage}: done in {saved['stage_s']} s")
        print(json.dumps({"stage": stage, **saved}, sort_keys=True)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
