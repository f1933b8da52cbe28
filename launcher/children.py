"""bin/train's child processes: start each in its own session, watch it, stop its whole tree.

Design: every child (learner, rollout server, tool server) leads a new session and process group,
so what it starts (Ray's GCS, raylet and workers; vLLM's EngineCore) shares its group and can be
stopped with it even after the leader is gone. Stopping is bounded: SIGTERM to each leader (its own
shutdown stops its children in order: ray.shutdown, the engine's), up to `grace` seconds, then
SIGKILL to every group that still has a live member. Every child also carries the launch's id in
its environment (`LAUNCH_ID_ENV`), inherited by everything it starts, so a final sweep finds a
process that left the group (a daemon that called setsid) and no process of a run outlives it.
Output goes to one log file per child, appended, so a restarted child continues its file. Each
child's environment (`child_env`) also carries its GPUs (``CUDA_VISIBLE_DEVICES`` from
``launch.learner_gpus`` / ``launch.rollout_gpus``), a local rollout server its own CPUs for
vLLM-CPU (`cpu_share`), and NVLink multicast switched off. On a CPU run with
``launch.rollout_cpu_nice`` a local rollout server also yields the cores to the learner (`yield_cpu`).
A `RemoteChild` (a rollout server placed on a Ray node, `launcher.ray_placement`) is the same
child seen through its host: signals and the group kill go through the host, and `stop_all` and
`kill_tree` treat it exactly like a local one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.disk_full import EXIT_DISK_FULL
from common.multicast import MULTICAST_OFF
from common.run_events import EVENTS_ENV

LAUNCH_ID_ENV = "AGENTRL_LAUNCH_ID"
"""Environment variable naming the bin/train run a process belongs to (inherited by descendants)."""


@dataclass
class Child:
    """One supervised process: its command, log file, and the current incarnation."""

    name: str
    """Short name used on the console and for the log file (learner, rollout-0, tool-server)."""
    title: str
    """How messages name it (learner, rollout server rs0, tool server)."""
    argv: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    nice: int = 0
    """> 0: started at this lower CPU priority, its session too (`yield_cpu`)."""
    restarts: int = 0
    pids: list[int] = field(default_factory=list)
    """Every leader pid it has had (restarts included)."""

    def start(self, note: str) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(
                f"----- bin/train: {note} at {time.strftime('%Y-%m-%d %H:%M:%S')} -----\n".encode()
            )
            out.flush()
            # start_new_session: its own group (stopped as one) and no terminal signals (Ctrl-C
            # reaches bin/train only, which then stops the children in order).
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        if self.nice > 0:
            yield_cpu(self.proc.pid, self.nice)
        self.pids.append(self.proc.pid)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def returncode(self) -> int | None:
        """Its exit status once it has exited (negative: killed by that signal), else None."""
        return self.proc.poll() if self.proc is not None else None

    def describe_exit(self) -> str:
        code = self.returncode()
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        if code == EXIT_DISK_FULL:
            return f"exit status {code}: the disk is full"
        return f"exit status {code}"

    def tail(self, lines: int = 20) -> str:
        """The last `lines` lines of its log (for an error message)."""
        try:
            with self.log.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
                text = f.read().decode("utf-8", errors="replace")
        except OSError as e:
            return f"(cannot read {self.log}: {e})"
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class RemoteChild(Child):
    """A child started by a host elsewhere (`launcher.ray_placement.RayChild`): ``proc`` stays None
    and the host signals the process and kills its group."""

    node: str | None = None
    """Where it runs (host name and IP), once placed."""

    def terminate(self) -> None:
        """SIGTERM to the process (its own shutdown stops what it started), if it runs."""
        raise NotImplementedError

    def kill_group(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL its whole process group and wait until no member is alive; the pids killed."""
        raise NotImplementedError


VLLM_CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM-CPU's list of cores an engine pins its OpenMP threads to (ignored by vLLM on GPUs)."""


def cpu_share(index: int, count: int, cpus: Sequence[int] | None = None) -> list[int]:
    """The cores local rollout server `index` of `count` pins vLLM-CPU's threads to: `cpus`
    (default: those this process may run on) split into `count` contiguous shares (a remainder is
    left to the learner), or one core each, round robin, when there are fewer cores than servers.

    Why not vLLM's own default ("auto"): each engine picks its cores knowing nothing of its
    siblings, so every server of a run pins to the same ones: on 2 cores both engines bound
    themselves to core 0 and took turns on it while core 1 idled. On GPUs vLLM ignores the
    variable, so it is set for every local server alike."""
    pool = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(pool) < count:
        return [pool[index % len(pool)]]
    per = len(pool) // count
    return pool[index * per : (index + 1) * per]


def yield_cpu(pid: int, nice: int) -> None:
    """Lower the CPU priority of process `pid` (a child that leads its own session, before it
    starts anything) to `nice`, and of its session where the kernel shares the CPU between sessions
    first (autogroup: there a process's own niceness only ranks it within its session).

    Why: on a CPU run the rollout servers and the learner share the cores, and the learner's step is
    the run's critical path (the servers generate ahead, up to max_staleness). At equal priority each
    session gets an equal share, so while two servers generate the next batch (right after each
    weights update, during the learner's prepare) the learner's session gets a third of the cores,
    and its torch thread pool, which waits at every parallel region for whichever of its threads is
    off a core, all but stops. Best effort: a kernel without autogroup has no /proc/PID/autogroup,
    and the niceness alone then does it."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError:
        pass  # the process is gone: nothing to lower
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass  # no autogroup here (or no /proc): the niceness above is the whole of it


def child_env(
    launch_id: str,
    gpus: Sequence[int] | None = None,
    base: Mapping[str, str] | None = None,
    *,
    events_file: Path | None = None,
    cpus: Sequence[int] | None = None,
) -> dict[str, str]:
    """A child's environment: `base` (default: ours) plus the launch id, unbuffered output, the
    multicast switches of `MULTICAST_OFF` (unless `base` sets them), the event channel's file
    (`common.run_events.EVENTS_ENV`) when given, when `gpus` is not None,
    ``CUDA_VISIBLE_DEVICES`` naming exactly those GPUs (an empty list hides every GPU) and, when
    `cpus` is not None, those cores for vLLM-CPU's threads (`VLLM_CPU_BIND_ENV`, unless `base`
    sets it: a user's own binding, or "auto" for vLLM's, wins)."""

    env = dict(os.environ if base is None else base)
    env[LAUNCH_ID_ENV] = launch_id
    if events_file is not None:
        env[EVENTS_ENV] = str(events_file)
    env["PYTHONUNBUFFERED"] = "1"  # log files follow the process as it runs
    for key, value in MULTICAST_OFF.items():
        env.setdefault(key, value)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    if cpus is not None:
        env.setdefault(VLLM_CPU_BIND_ENV, ",".join(str(c) for c in cpus))
    return env


def python_argv(script: Path, args: Sequence[str]) -> list[str]:
    return [sys.executable, str(script), *args]


# ---------------------------------------------------------------- process groups


def live_group_members(pgids: Iterable[int]) -> dict[int, list[int]]:
    """Live (not zombie) processes of each process group in `pgids`."""
    import psutil

    wanted = set(pgids)
    found: dict[int, list[int]] = {g: [] for g in wanted}
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            group = os.getpgid(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
        if group in wanted:
            found[group].append(p.pid)
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(child: Child, timeout: float = 10.0) -> None:
    """SIGKILL a child's whole process group now and wait until no member is alive (a dead
    rollout server's vLLM EngineCore would otherwise hold its memory and inherited files)."""
    if isinstance(child, RemoteChild):
        child.kill_group(timeout)
        return
    if child.proc is None:
        return
    pgid = child.proc.pid  # a session leader's group id is its pid
    _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    child.proc.wait(timeout=timeout)
    while live_group_members([pgid])[pgid] and time.monotonic() < deadline:
        time.sleep(0.1)


def stop_all(
    children: Sequence[Child], grace: float, *, hurry: Callable[[], bool] | None = None
) -> dict[str, list[int]]:
    """Stop every child: SIGTERM to the leaders, up to `grace` seconds for them to exit, then
    SIGKILL to every group with a live member. `hurry()` true (a second Ctrl-C) skips the grace.
    Returns, per child name, the pids that had to be SIGKILLed."""
    started = [c for c in children if c.proc is not None]
    remote = [c for c in children if isinstance(c, RemoteChild) and c.pids]
    for c in started:
        if c.returncode() is None:
            try:
                c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            except ProcessLookupError:
                pass
    for c in remote:
        c.terminate()
    deadline = time.monotonic() + grace
    while any(c.returncode() is None for c in [*started, *remote]) and time.monotonic() < deadline:
        if hurry is not None and hurry():
            break
        time.sleep(0.1)
    # The leaders are gone (or out of time): whatever is left in their groups is killed.
    by_group = {c.proc.pid: c for c in started}  # type: ignore[union-attr]
    killed: dict[str, list[int]] = {}
    for c in remote:
        if members := c.kill_group():
            killed[c.name] = members
    for pgid, members in live_group_members(by_group).items():
        if members:
            killed[by_group[pgid].name] = members
            _signal_group(pgid, signal.SIGKILL)
    for c in started:
        try:
            c.proc.wait(timeout=10)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 10
    while any(live_group_members(by_group).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return killed


def sweep(launch_id: str) -> list[int]:
    """SIGKILL every process whose environment carries this launch's id (except ourselves): what
    left its child's process group. Returns their pids."""
    import psutil

    me = os.getpid()
    killed: list[int] = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE or p.environ().get(LAUNCH_ID_ENV) != launch_id:
                continue
            p.kill()
            killed.append(p.pid)
        except psutil.Error:
            continue
    return killed
