"""bin/chaos's verdict: the invariants over what a chaos run left behind.

Design: `check` reads only the run directory and the machine after the job has ended: the steps
were reached and the last bin/train exited 0, every scheduled fault was injected, no trajectory was
trained twice by the weights that survived (``learner.trained_log``, rollbacks applied), policy
versions only went up, no process of the run is left and no weight file of it in its weights
directory, and memory and descriptors of each long-lived process stayed within the stated bounds.
Each failure is appended to the report as a violation that says what was seen.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import yaml

from learner import trained_log
from learner.trained_log import TRAINED_IDS
from protocol.slot_files import NAME as WEIGHTS_DIR_NAME
from protocol.slot_files import PREFIX
from rollout_service.recording import BatchFileError, read_recording

if TYPE_CHECKING:
    from tools.chaos.state import Report
    from tools.chaos.state import RunState as Chaos


def check(ctx: Chaos, report: Report) -> None:
    """The invariants over what the run left behind; violations appended to ``report``."""
    run, v = ctx.run, report.violations
    reached = ctx.steps_reached()
    report.facts["steps_reached"] = reached
    if reached < report.steps:
        v.append(f"the run reached step {reached} of {report.steps}")
    if report.facts.get("exit_code") != 0:
        v.append(f"the last bin/train exited {report.facts.get('exit_code')}")
    if missed := [f.at_s for f in report.faults if f.done_at_s is None]:
        # a run that ended before its faults tested nothing: a PASS would say otherwise
        v.append(
            f"{len(missed)} of {len(report.faults)} faults (due at {missed} s) fell after the "
            "run's end: raise --steps or shorten --window-s"
        )
    log = trained_log.read(run / TRAINED_IDS)
    ids = [t for step in log.trajectory_ids().values() for t in step]
    twice = len(ids) - len(set(ids))
    report.facts |= {"trained_trajectories": len(ids), "rollbacks": len(log.rollbacks)}
    if twice:
        v.append(f"{twice} trajectories trained twice by the surviving weights")
    versions = []
    if (run / "metrics.jsonl").exists():
        for line in (run / "metrics.jsonl").read_text().splitlines():
            try:
                versions.append(int(json.loads(line)["policy/version"]))
            except (ValueError, KeyError):
                continue
    if any(b <= a for a, b in itertools.pairwise(versions)):
        v.append(f"policy versions did not only go up: {versions}")
    shipped = _shipped_ids(run)
    report.facts["shipped_not_trained"] = len(shipped - set(ids))
    report.facts["shipped"] = len(shipped)
    _leftovers(ctx, report)
    _growth(ctx, report)


def _shipped_ids(run: Path) -> set[str]:
    out: set[str] = set()
    for directory in sorted((run / "recordings").glob("*")):
        try:
            for _, trajectories in read_recording(directory):
                out |= {t.trajectory_id for t in trajectories}
        except BatchFileError:
            continue
    return out


def _leftovers(ctx: Chaos, report: Report) -> None:
    time.sleep(2)
    left = []
    for pid, started in ctx.seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            continue
    if left:
        report.violations.append(f"{len(left)} processes of the run left: {left[:5]}")
    try:
        cfg = yaml.safe_load((ctx.run / "config.resolved.yaml").read_text())
        directory = Path(cfg["learner"].get("weights_file_dir") or "/dev/shm")
    except (OSError, ValueError, KeyError, TypeError):
        directory = Path("/dev/shm")
    shm = []
    for d in directory.glob(f"{PREFIX}*"):  # named by the learner's pid: ours if it was the run's
        m = WEIGHTS_DIR_NAME.fullmatch(d.name)
        if m and int(m.group(1)) in ctx.seen:
            shm.append(str(d))
    if shm:
        report.violations.append(f"weight files of the run left in {directory}: {shm[:5]}")


def _growth(ctx: Chaos, report: Report) -> None:
    """Per process incarnation observed for ``--min-observed-s``: RSS and fd growth from the middle
    of that span (start-up allocations and a warm-up peak settled) to its end, per hour; the
    bounds. Its samples go into the report too, one a minute, for a plot or a second look."""
    a = ctx.args
    for name, series in ctx.samples.items():
        start, end = series[0][0], series[-1][0]
        if end - start < a.min_observed_s:  # too short-lived to say
            continue
        t0, rss0, fd0 = next(s for s in series if s[0] >= (start + end) / 2)
        t1, rss1, fd1 = series[-1]
        hours = max((t1 - t0) / 3600, 1e-9)
        minutes: dict[int, tuple[float, float, int]] = {}
        for t, rss, fds in series:
            minutes.setdefault(int((t - start) // 60), (round(t - start), round(rss, 1), fds))
        report.growth[name] = {
            "rss_mib": round(rss1, 1),
            "rss_mib_per_h": round((rss1 - rss0) / hours, 1),
            "fds": fd1,
            "fds_growth": fd1 - fd0,
            "seconds": round(t1 - t0),
            "samples_s_rss_fds": list(minutes.values()),
        }
        if rss1 - rss0 > a.max_rss_growth_mib:
            report.violations.append(
                f"{name}: RSS grew {rss1 - rss0:.0f} MiB (bound {a.max_rss_growth_mib})"
            )
        if fd1 - fd0 > a.max_fd_growth:
            report.violations.append(
                f"{name}: {fd1 - fd0} more open files (bound {a.max_fd_growth})"
            )
