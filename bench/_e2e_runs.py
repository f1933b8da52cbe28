"""One bin/train run of bench/e2e.py as a bounded child process: its command line, its steps
followed as metrics.jsonl grows, its stop, and its record (the figures from bench/_e2e_summary.py,
its weight updates against their bound from its logs, whether it finished all its steps, else why
not, and its logs).

Design: a run gets a session of its own and a marker in its environment (MARKER_ENV), and however
it ends (done, past its limit, every batch refused, the bench interrupted) it leaves nothing behind:
SIGTERM to bin/train with STOP_GRACE_S of grace, SIGKILL to its group, then to every process still
carrying the marker (its children run in sessions of their own). A run is a figure only once all
its steps are in metrics.jsonl. ``preflight`` runs ``bin/train --check`` with the runs' overrides
first, so a config mistake fails in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench._common import GpuMemory, tail
from bench._e2e_summary import (
    episode_lengths,
    progress,
    read_episodes,
    summarize,
)
from bench._e2e_variants import BASE, Variant, label
from common.file_tail import LineTail

ROOT = Path(__file__).resolve().parent.parent

MARKER_ENV = "AGENTRL_E2E_BENCH_ID"
"""Set in bin/train's environment; every process of a run inherits it (the final sweep's key)."""
STOP_GRACE_S = 60.0
"""What bin/train gets between SIGTERM and SIGKILL when a run is stopped."""


def preflight(args: argparse.Namespace, overrides: list[str], variant: Variant = BASE) -> None:
    """``bin/train --check`` with every override the runs of ``variant`` will get (the model path
    pointed at an existing directory): a config mistake fails here, in seconds, not after the
    warm-up."""
    cmd = [
        sys.executable,
        str(ROOT / "bin" / "train"),
        "--config",
        str(args.config),
        *overrides,
        f"trainer.total_training_steps={args.steps}",
        f"actor_rollout_ref.rollout.max_staleness={max(args.staleness_values)}",
        *args.overrides,
        *variant.overrides,
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
    progress(
        f"config{' of variant ' + variant.name if variant.name else ''}: bin/train --check passes"
    )


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
    variant: Variant = BASE,
) -> dict[str, Any]:
    """One bin/train run of ``max_staleness`` ``staleness`` and ``variant`` (repeat ``repeat``),
    followed step by step, stopped at ``limit_s``, its peak GPU memory sampled throughout. Returns
    its record."""
    suffix = f"-{variant.name}" if variant.name else ""
    name = f"run-{args.workload}-{args.placement.slug}-s{staleness}{suffix}-r{repeat}"
    run_dir = work / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    log = work / f"{name}.train.log"
    marker = uuid.uuid4().hex
    tag = f"{label(staleness, variant)} r{repeat}"
    progress(
        f"run {tag} (max_staleness={staleness}, {args.placement.spec}): bin/train, {args.steps} "
        f"steps, limit {limit_s:.0f} s, logs {run_dir / 'logs'}"
    )
    result: dict[str, Any] = {
        "label": label(staleness, variant),
        "max_staleness": staleness,
        "variant": variant.name,
        "variant_overrides": list(variant.overrides),
        "repeat": repeat,
        "placement": args.placement.spec,
        "run_dir": str(run_dir),
        "steps_asked": args.steps,
    }
    t0 = time.monotonic()
    with log.open("wb") as out, GpuMemory() as memory:
        proc = subprocess.Popen(
            train_command(args, staleness, overrides, run_dir, variant.overrides),
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
    args: argparse.Namespace,
    staleness: int,
    overrides: list[str],
    run_dir: Path,
    variant: tuple[str, ...] = (),
) -> list[str]:
    """The variant's overrides come last: they win over the bench's and the caller's."""
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
        *variant,
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
    result |= summarize(records, drain=args.drain_steps)
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
    """Counts the batches the learner refused (its "invalid message" warnings: e.g. token ids outside
    the tokenizer's vocabulary, or logprobs that are not finite). A run whose batches are refused
    before its first step takes none: better to stop it at once than to wait out its time limit.
    The learner logs a few refusals a minute in full and then one "suppressed N invalid messages"
    line, so ``LIMIT`` is below what it logs in full, and a summary line counts its N."""

    LIMIT = 4

    def __init__(self, log: Path) -> None:
        self.tail, self.count, self.first = LineTail(log, from_start=True), 0, ""

    def poll(self) -> bool:
        for raw in self.tail.read_lines():
            line = raw.decode("utf-8", errors="replace")
            if "invalid message" not in line:
                continue
            summary = SUPPRESSED.search(line)
            self.count += int(summary.group(1)) if summary else 1
            if not self.first and not summary:
                self.first = line.split("invalid message", 1)[1].strip()[:300]
        return self.count >= self.LIMIT


SUPPRESSED = re.compile(r"\bsuppressed=(\d+)")


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
