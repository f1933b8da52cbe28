"""The fault kinds of bin/chaos: a registry from kind to what injects it.

Design: each fault is a function of the run (`tools.chaos.run.Chaos`) and the scheduled `Fault`
that injects it and returns a note for the report. Process faults signal a process named in
``RUN_DIR/processes.json`` (a rollout server, the tool server, the learner); network faults act on
the connection of one rollout server through the run's `FaultProxy`; the disk fault fills the run's
tmpfs. A fault after which the job is expected to end (the learner killed, a full disk it stops on)
sets ``job_must_restart`` or ``job_may_stop``: the run starts the job again with
``trainer.resume_mode=auto``, as an operator would.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from tools.chaos.netproxy import FaultProxy, Link
from tools.chaos.state import Fault

if TYPE_CHECKING:
    from tools.chaos.state import RunState as Chaos


def children(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / "processes.json").read_text()).get("children", {})
    except (OSError, ValueError):
        return {}


def pid_of(run: Path, name: str) -> int | None:
    child = children(run).get(name)
    return int(child["pid"]) if child and child.get("pid") else None


def _signal(pid: int | None, sig: int) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _kill(ctx: Chaos, fault: Fault) -> str:
    return "sent" if _signal(pid_of(ctx.run, fault.target), signal.SIGKILL) else "no such process"


def _term(ctx: Chaos, fault: Fault) -> str:
    return "sent" if _signal(pid_of(ctx.run, fault.target), signal.SIGTERM) else "no such process"


def _stall(ctx: Chaos, fault: Fault) -> str:
    pid = pid_of(ctx.run, fault.target)
    if not _signal(pid, signal.SIGSTOP):
        return "no such process"
    time.sleep(ctx.rng.uniform(2.0, 8.0))
    _signal(pid, signal.SIGCONT)
    return "stopped, then continued"


def _learner_kill(ctx: Chaos, fault: Fault) -> str:
    if not _signal(pid_of(ctx.run, "learner"), signal.SIGKILL):
        return "no such process"
    ctx.job_must_restart = True
    return "killed; the job restarts with resume_mode=auto"


# -- the network between the learner and one rollout server ------------------------------------
def _link(ctx: Chaos, server: str) -> Link | None:
    """The proxy's connection of ``server`` (its process's TCP connection to the proxy)."""
    pid = pid_of(ctx.run, server)
    if pid is None or ctx.proxy is None:
        return None
    try:
        ports = {
            c.laddr.port
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.raddr and c.raddr.port == ctx.proxy.port
        }
    except psutil.Error:
        return None
    return next((link for link in ctx.proxy.links() if link.client_port in ports), None)


LINK_WAIT_S = 90.0
"""How long a network fault waits for its server's connection: right after a restart of the job or
of the server (vLLM's start), it has none yet, and a fault that found none would test nothing."""


def _net(
    action: Callable[[Chaos, FaultProxy, Link], str],
) -> Callable[[Chaos, Fault], str]:
    def inject(ctx: Chaos, fault: Fault) -> str:
        end = time.monotonic() + LINK_WAIT_S
        while (link := _link(ctx, fault.target)) is None and time.monotonic() < end:
            if not ctx.job_alive():  # it will not connect: the run starts the job again first
                break
            ctx.sample()
            time.sleep(0.5)
        if link is None or ctx.proxy is None:
            return "no connection"
        return action(ctx, ctx.proxy, link)

    return inject


def _partition(ctx: Chaos, proxy: FaultProxy, link: Link) -> str:
    seconds = ctx.rng.uniform(3.0, 10.0)
    proxy.partition(link, seconds)
    return f"nothing carried for {seconds:.1f} s"


def _delay(ctx: Chaos, proxy: FaultProxy, link: Link) -> str:
    seconds, delay = ctx.rng.uniform(10.0, 20.0), ctx.rng.uniform(0.05, 0.3)
    proxy.impair(link, seconds, delay_s=delay)
    return f"{delay * 1000:.0f} ms each way for {seconds:.1f} s"


def _loss(ctx: Chaos, proxy: FaultProxy, link: Link) -> str:
    seconds, loss = ctx.rng.uniform(10.0, 20.0), ctx.rng.uniform(0.05, 0.25)
    proxy.impair(link, seconds, loss=loss)
    return f"{loss:.0%} of segments retransmitted (0.2-1 s each) for {seconds:.1f} s"


def _reset(ctx: Chaos, proxy: FaultProxy, link: Link) -> str:
    proxy.reset(link)
    return "reset"


# -- the disk -----------------------------------------------------------------------------------
def _disk_full(ctx: Chaos, fault: Fault) -> str:
    assert ctx.disk is not None
    ballast = ctx.disk.fill()
    seconds = ctx.rng.uniform(5.0, 15.0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ctx.sample()
        time.sleep(0.5)
    ctx.disk.empty()
    ctx.job_may_stop = True  # a clean stop naming the path is what a full disk may cause
    return f"full for {seconds:.1f} s ({ballast / 2**20:.0f} MiB of ballast)"


FAULTS: dict[str, Callable[[Chaos, Fault], str]] = {
    "server-kill": _kill,
    "server-term": _term,
    "server-stall": _stall,
    "learner-kill": _learner_kill,
    "tool-kill": _kill,
    "net-partition": _net(_partition),
    "net-delay": _net(_delay),
    "net-loss": _net(_loss),
    "net-reset": _net(_reset),
    "disk-full": _disk_full,
}
TARGETS: dict[str, str] = {"learner-kill": "learner", "tool-kill": "tool-server", "disk-full": ""}
"""The process a kind acts on when it is not a rollout server (picked at random)."""
NETWORK = {k for k in FAULTS if k.startswith("net-")}
