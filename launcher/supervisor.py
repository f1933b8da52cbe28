"""bin/train's supervision loop: start the children, follow the run, restart, stop, report.

Design: one loop on the main thread, every `POLL_S`: signals first (a handler only records them),
then the learner's exit, the tool server's, each rollout server's, then the event channel (where
the learner listens, who is connected; ``RUN_DIR/events.jsonl``) and metrics.jsonl (steps done).
The rollout servers start once the learner's address is known (it binds port 0 with
`launch.auto_port` and reports the port) and the tool server, if any, answers. Every start and
exit of a child is appended to the event channel too, so it holds the whole story of a launch.
A dead rollout server or tool server is restarted (`_restart`) up to `launch.max_restarts` times;
the tool server on the port the rollout servers were given, and rollout servers' restarts wait
until it answers again. Every way out of the loop goes through one `finally`
that stops all children and sweeps their stray descendants, so nothing of a run outlives bin/train
whatever ends it. Failures are reported after the stop, with the tail of the failed child's log.
With `launch.placement: ray` the rollout servers are placed on the Ray cluster first
(`launcher.ray_placement`); the loop supervises them as it does local ones, and the placement is
released after they are stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

from common.disk_full import EXIT_DISK_FULL
from common.file_tail import JsonlTail
from common.fileio import atomic_write_bytes
from common.metrics_file import read_metrics
from common.run_events import Event, Kind, append
from common.rundir import checkpoint_dir
from launcher.children import Child, RemoteChild, kill_tree, stop_all, sweep
from launcher.console import Connections, Display, metric_values, summary_lines
from launcher.plan import (
    POLL_S,
    PROCESSES_FILE,
    TAIL_LINES,
    Plan,
    _split_endpoint,
    is_loopback,
    rollout_overrides,
    tool_url,
)
from launcher.ray_placement import PlacementError
from tools.plot import plot_run
from tools.timeline import draw_timeline

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
EXIT_REFUSED = 2
"""How a process ends that refuses its config or data (common.cli, rollout_service.app)."""


class Supervisor:
    def __init__(self, plan: Plan, log: Any, display: Display | None = None) -> None:
        self.plan, self.log = plan, log
        self.display = display if display is not None else Display(plan.total_steps)
        self.signals: list[int] = []
        self.failure: tuple[str, Child | None, list[Child]] | None = None
        """(message, the child it names, children whose log tails to show)."""
        self.records: list[dict[str, Any]] = []
        self.metrics = JsonlTail(plan.run_dir / "metrics.jsonl")
        self.connections = Connections(
            plan.events_file, [f"rs{i}" for i in range(len(plan.rollouts))]
        )
        self.rollouts_started = False
        self.finished: set[str] = set()
        self.exited: set[str] = set()
        """Children whose exit is already on the event channel (one EXITED per incarnation)."""
        self.tool_restarted_at: float | None = None
        """When the tool server was last restarted, until it answers GET /health again."""

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> int:
        plan = self.plan
        start = time.monotonic()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        status = EXIT_FAILED
        try:
            self.log.info(
                "starting",
                run_dir=str(plan.run_dir),
                logs=str(plan.run_dir / "logs"),
                rollout_servers=len(plan.rollouts),
                tool_server=plan.tool_server is not None,
                steps=plan.total_steps,
            )
            if (status := self._place()) == EXIT_OK:
                if plan.tool_server is not None:
                    self._start(plan.tool_server, "start")
                self._start(plan.learner, "start")
                status = self._supervise(start)
        finally:
            self.display.close()
            if self.signals:
                self.log.warning("stopping", signal=signal.Signals(self.signals[0]).name)
            elif status == EXIT_OK:
                self.log.info("training done: stopping the other processes")
            t0 = time.monotonic()
            killed = stop_all(
                plan.children,
                plan.config.launch.stop_timeout_s,
                hurry=lambda: len(self.signals) > 1,
            )
            self._record_exits()
            if stray := sweep(plan.launch_id):
                self.log.warning("killed processes that had left their group", pids=stray)
            self.log.info(
                "every process stopped",
                seconds=round(time.monotonic() - t0, 1),
                sigkilled={name: len(pids) for name, pids in killed.items()},
            )
            if plan.fleet is not None:
                plan.fleet.close(self.log)
            for s, handler in previous.items():
                signal.signal(s, handler)
        self._write_processes()
        if status != EXIT_OK:
            self._report_failure()
            return status
        return self._finish(time.monotonic() - start)

    def _supervise(self, start: float) -> int:
        plan, launch = self.plan, self.plan.config.launch
        connect_deadline = start + launch.connect_timeout_s
        self.display.status("starting")
        while True:
            if self.signals:
                return EXIT_INTERRUPTED
            self._poll_files()
            code = plan.learner.returncode()
            if code is not None:
                self._poll_files()  # the last step's record
                return self._learner_exited(code)
            ts = plan.tool_server
            if ts is not None and (status := self._check_tool_server(ts)) is not None:
                return status
            if not self.rollouts_started:
                learner_known = (
                    not plan.learner_auto_port or self.connections.learner_address is not None
                )
                if learner_known and self._tool_server_ready():
                    extra = rollout_overrides(
                        plan, self.connections.learner_address, plan.tool_health_url
                    )
                    for child in plan.rollouts:
                        child.argv += (
                            extra  # restarts keep them: the learner's address does not change
                        )
                        self._start(child, "start")
                    self.rollouts_started = True
                elif time.monotonic() > connect_deadline:
                    if not learner_known:
                        return self._fail(
                            f"the learner did not bind its address within "
                            f"{launch.connect_timeout_s:g} s (launch.connect_timeout_s)",
                            plan.learner,
                        )
                    return self._fail(
                        f"tool server did not answer {plan.tool_health_url}/health within "
                        f"{launch.connect_timeout_s:g} s (launch.connect_timeout_s)",
                        ts,
                    )
            for child in plan.rollouts:
                if (status := self._check_rollout(child)) is not None:
                    return status
            waiting = self.connections.missing
            if waiting and time.monotonic() > connect_deadline:
                missing = [c for i, c in enumerate(plan.rollouts) if f"rs{i}" in waiting]
                names = ", ".join(c.title for c in missing)
                return self._fail(
                    f"{names} did not connect to the learner within "
                    f"{launch.connect_timeout_s:g} s (launch.connect_timeout_s)",
                    None,
                    missing or [plan.learner],
                )
            time.sleep(POLL_S)

    def _place(self) -> int:
        """launch.placement: ray: the rollout servers' bundles and hosts on the cluster (unless
        ray.address names it, the learner is pointed at it). EXIT_OK, else how the run ends (the
        cluster cannot hold them, or a signal came)."""
        fleet = self.plan.fleet
        if fleet is None:
            return EXIT_OK

        try:
            joins = fleet.open(self.log, lambda: bool(self.signals))
        except PlacementError as e:
            return EXIT_INTERRUPTED if self.signals else self._fail(str(e), None)
        except Exception as e:  # ray.init's errors (no cluster at the address, ...): exit 1
            return self._fail(f"could not use the Ray cluster: {type(e).__name__}: {e}", None)
        if joins is not None:
            self.plan.learner.argv.append(f"ray.address={json.dumps(joins)}")
        # Joining may have turned token authentication on in this process only (RAY_AUTH_MODE,
        # common.ray_auth): the learner needs the same mode (the token itself is in
        # ~/.ray/auth_token).
        for key, value in os.environ.items():
            if key.startswith("RAY_AUTH_"):
                self.plan.learner.env[key] = value
        config = self.plan.config
        bind, target = config.learner.bind_address, config.rollout_server.learner_address
        for child in fleet.elsewhere:  # ZeroMQ from their node to ours: loopback cannot work
            if is_loopback(_split_endpoint(bind)[1]):
                self.log.warning(
                    f"the learner binds a loopback address ({bind}): {child.title} on "
                    f"{child.node} cannot reach it; set learner.bind_address=tcp://0.0.0.0:PORT "
                    "and rollout_server.learner_address=tcp://THIS_HOST:PORT"
                )
            elif is_loopback(_split_endpoint(target)[1]):
                self.log.warning(
                    f"rollout_server.learner_address is a loopback address ({target}): "
                    f"{child.title} on {child.node} cannot reach the learner there; set it to "
                    "tcp://THIS_HOST:PORT"
                )
        if fleet.elsewhere and self.plan.tool_server is not None and self.plan.tool_remote:
            self.log.warning(
                "the tool server runs on this host and the rollout servers are sent its loopback "
                f"URL: {', '.join(c.title for c in fleet.elsewhere)} on other nodes cannot reach "
                "it; set tool_server.host=0.0.0.0 and tools.remote.url=http://THIS_HOST:PORT"
            )
        return EXIT_OK

    # -- events ----------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)  # acted on by the loop; a second one hurries the stop

    def _start(self, child: Child, note: str) -> None:
        child.start(note)
        self.exited.discard(child.name)
        where = {"node": child.node} if isinstance(child, RemoteChild) else {}
        self._event(Kind.STARTED, child.name, pid=child.pid, note=note, **where)
        self._write_processes()
        self.log.info(f"{child.title} started", pid=child.pid, log=str(child.log), **where)

    def _event(self, kind: Kind, source: str, **data: Any) -> None:
        try:
            append(self.plan.events_file, Event(kind, source, time.time(), data))
        except OSError as e:  # the channel informs; it must not end the run
            self.log.warning("could not append to the event channel", error=str(e))

    def _record_exits(self) -> None:
        """One EXITED event per child incarnation that has ended (deaths included)."""
        for child in self.plan.children:
            code = child.returncode()
            if code is not None and child.name not in self.exited:
                self.exited.add(child.name)
                self._event(
                    Kind.EXITED, child.name, pid=child.pid, code=code, exit=child.describe_exit()
                )

    def _poll_files(self) -> None:
        self._record_exits()
        for event, peer in self.connections.poll():
            if event == "ready":
                self.log.info("learner ready")
            elif event == "listening":
                self.log.info("learner listening", address=peer)
            elif event == "tool listening" and self.plan.tool_server is not None:
                self.plan.tool_health_url = tool_url(self.plan.config.tool_server.host, int(peer))
                self.log.info("tool server listening", url=self.plan.tool_health_url)
            elif event in ("joined", "rejoined"):
                n, total = len(self.connections.ever), len(self.connections.expected)
                self.log.info(
                    f"rollout server {peer} {'re' if event == 'rejoined' else ''}connected",
                    connected=f"{len(self.connections.connected)}/{total}",
                )
                if event == "joined":
                    self.display.status(f"{n}/{total} rollout servers connected")
        for record in self.metrics.read():
            if isinstance(record.get("step"), int):
                self.records.append(record)
                self.display.step(record["step"], metric_values(record))

    def _tool_server_ready(self) -> bool:
        """True when there is no tool server or it answers GET /health (rollout servers ask it
        for its tools as they start)."""
        url = self.plan.tool_health_url
        if self.plan.tool_server is None:
            return True
        if url is None:  # it binds port 0 and has not reported its port yet
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0) as response:
                ready = bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False
        if ready:
            self.log.info("tool server ready", url=url)
        return ready

    def _learner_exited(self, code: int) -> int:
        learner = self.plan.learner
        if code == EXIT_DISK_FULL:
            # its own line naming the file may not have reached its log: that disk is full
            free = shutil.disk_usage(self.plan.run_dir).free / 2**20
            return self._fail(
                f"learner stopped: the disk is full (run directory {self.plan.run_dir}, "
                f"{free:.0f} MiB free now)",
                learner,
            )
        if code != 0:
            return self._fail(f"learner failed ({learner.describe_exit()})", learner)
        done = self.records[-1]["step"] if self.records else self._last_step()
        if done < self.plan.total_steps:
            return self._fail(f"learner exited at step {done} of {self.plan.total_steps}", learner)
        return EXIT_OK

    def _last_step(self) -> int:

        try:
            records = read_metrics(self.plan.run_dir)
        except (OSError, ValueError):
            return 0
        return int(records[-1]["step"]) if records else 0

    def _check_rollout(self, child: Child) -> int | None:
        """None while it runs (or after it was restarted); an exit status when the run must end."""
        code = child.returncode()
        if code is None or child.name in self.finished:
            return None
        if code == 0:  # rollout_server.max_groups reached: finished, not dead
            self.finished.add(child.name)
            self.log.info(f"{child.title} finished", log=str(child.log))
            return None
        if self.tool_restarted_at is not None and code != EXIT_REFUSED:
            # A rollout server asks the tool server for its tools as it starts, and one it cannot
            # reach is a config error (exit 2, never restarted): the restart waits until the
            # tool server answers again (_check_tool_server).
            return None
        return self._restart(child)

    def _check_tool_server(self, child: Child) -> int | None:
        """None while it runs (or after it was restarted); an exit status when the run must end.
        Any exit is a death, 0 included: it serves until stopped (a SIGTERM ends it with 0)."""
        if child.returncode() is None:
            if self.tool_restarted_at is not None:
                return self._tool_server_back(child, self.tool_restarted_at)
            return None
        port = self.connections.tool_port
        if self.plan.tool_auto_port and port is not None:
            # The rollout servers were given the URL with the port it reported (tools.remote.url)
            # and keep it: its next incarnation binds that port again (SO_REUSEADDR,
            # tool_server.bind_socket), not port 0. The later override wins over the port=0 one.
            pinned = f"tool_server.port={port}"
            if pinned not in child.argv:
                child.argv.append(pinned)
        status = self._restart(child)
        if status is None:
            self.tool_restarted_at = time.monotonic()
        return status

    def _tool_server_back(self, child: Child, restarted_at: float) -> int | None:
        """After a restart of the tool server: None once it answers again (or while it may still
        start), an exit status when it has not answered within launch.connect_timeout_s."""
        if self._tool_server_ready():
            self.tool_restarted_at = None
            return None
        timeout = self.plan.config.launch.connect_timeout_s
        if time.monotonic() - restarted_at <= timeout:
            return None
        return self._fail(
            f"{child.title} did not answer {self.plan.tool_health_url}/health within "
            f"{timeout:g} s of its restart (launch.connect_timeout_s)",
            child,
        )

    def _restart(self, child: Child) -> int | None:
        """Restart a dead child (a rollout server, the tool server) under launch.max_restarts:
        None once restarted; an exit status when the run must end instead."""
        if child.returncode() == EXIT_REFUSED:
            return self._fail(
                f"{child.title} refused its config or data ({child.describe_exit()}); not "
                "restarted, since a restart would meet the same",
                child,
            )
        limit = self.plan.config.launch.max_restarts
        if child.restarts >= limit:
            return self._fail(
                f"{child.title} died ({child.describe_exit()}) and was restarted "
                f"{child.restarts} time(s) already (launch.max_restarts={limit})",
                child,
            )
        self.log.warning(
            f"{child.title} died ({child.describe_exit()}): restarting "
            f"({child.restarts + 1}/{limit})",
            log=str(child.log),
        )
        self._record_exits()  # its death, before the restart starts a new incarnation
        kill_tree(child)  # its vLLM engine (or sandboxed tool) processes too, before a new one
        child.restarts += 1
        self._start(child, f"restart {child.restarts} after {child.describe_exit()}")
        return None

    def _fail(self, message: str, child: Child | None, tails: list[Child] | None = None) -> int:
        if self.failure is None:
            self.failure = (
                message,
                child,
                tails if tails is not None else [child] if child else [],
            )
        self.log.error(message + ": stopping")
        return EXIT_FAILED

    # -- reporting -------------------------------------------------------------------------------
    def _report_failure(self) -> None:
        if self.failure is None:
            self.log.warning("interrupted", run_dir=str(self.plan.run_dir))
            return
        message, child, tails = self.failure
        self.log.error(message, log=str(child.log) if child else None)
        for c in tails:
            print(
                f"----- last {TAIL_LINES} lines of {c.log} ({c.title}) -----\n{c.tail(TAIL_LINES)}",
                file=sys.stderr,
                flush=True,
            )

    def _finish(self, wall_s: float) -> int:

        run_dir = self.plan.run_dir
        plot: Path | None = None
        try:
            plot = plot_run(run_dir)
            self.log.info("training curves drawn", path=str(plot))
        except Exception as e:  # the run itself succeeded; a missing plot is worth a warning only
            self.log.warning("could not draw the training curves", error=f"{type(e).__name__}: {e}")
        timeline: tuple[Path, Path] | None = None
        try:
            timeline = draw_timeline(run_dir)
            self.log.info("timeline drawn", png=str(timeline[0]), trace=str(timeline[1]))
        except Exception as e:  # as for the curves: the run succeeded all the same
            self.log.warning("could not draw the timeline", error=f"{type(e).__name__}: {e}")
        try:
            records = read_metrics(run_dir)
        except (OSError, ValueError):
            records = self.records
        restarts = {c.title: c.restarts for c in self.plan.children}  # the learner's stay 0
        for line in summary_lines(
            run_dir,
            records,
            self.plan.total_steps,
            wall_s,
            restarts,
            plot,
            checkpoint_dir(self.plan.config, run_dir),
            timeline,
        ):
            self.display.print(line)
        return EXIT_OK

    def _write_processes(self) -> None:
        plan = self.plan
        doc = {
            "launch_id": plan.launch_id,
            "pid": os.getpid(),
            "run_dir": str(plan.run_dir),
            "children": {
                c.name: {
                    "title": c.title,
                    "pid": c.pid,
                    "pids": c.pids,
                    "restarts": c.restarts,
                    "log": str(c.log),
                    "exit": c.returncode(),
                    **({"node": c.node} if isinstance(c, RemoteChild) else {}),
                }
                for c in plan.children
            },
        }
        atomic_write_bytes(
            plan.run_dir / PROCESSES_FILE, json.dumps(doc, indent=1).encode(), durable=False
        )
