"""A watchdog that ends a process's descendants once the process is gone, however it ended.

Design: vLLM runs its engine core in a child process that does not watch its parent, so a
``kill -9`` of a rollout server left the engine running under PID 1, holding its memory (on a GPU,
the GPU's). ``PR_SET_PDEATHSIG`` cannot be relied on here: it fires when the forking *thread* ends,
and multiprocessing's spawn forks in C, with no hook to set it in the child. So `watch` starts this
file as a small process of its own session (no terminal signal reaches it). While the watched
process runs, the reaper remembers every descendant it sees, by pid and start time. Once the
watched process is gone (or a zombie), it SIGKILLs those still alive whose start time matches (a
reused pid is never hit) and exits. A clean shutdown leaves nothing for it to kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
"""How often the watched process and its descendants are looked at."""


def watch(pid: int | None = None) -> subprocess.Popen[bytes]:
    """Start a reaper for `pid` (default: this process); it exits by itself after `pid` ends."""
    target = psutil.Process(os.getpid() if pid is None else pid)
    return subprocess.Popen(
        # -P: not common/ first on the path, where common/logging.py would shadow the standard one
        [sys.executable, "-P", __file__, str(target.pid), repr(target.create_time())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap(pid: int, create_time: float, poll_s: float = POLL_S) -> list[int]:
    """Follow `pid` until it ends, then kill its remembered descendants; returns the pids killed."""
    try:
        target = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    if abs(target.create_time() - create_time) > 0.01:
        return []  # the pid was reused before we started: not ours to follow
    seen: dict[int, psutil.Process] = {}
    me = os.getpid()
    while _alive(target):
        try:
            for child in target.children(recursive=True):
                if child.pid != me:
                    seen.setdefault(child.pid, child)  # Process keeps its start time
        except psutil.Error:
            pass  # it ended while we looked; the loop condition says so next
        time.sleep(poll_s)
    killed = []
    for child in seen.values():
        if _alive(child):  # is_running compares start times: a reused pid is another process
            try:
                child.send_signal(signal.SIGKILL)
                killed.append(child.pid)
            except psutil.Error:
                pass
    return killed


if __name__ == "__main__":
    reap(int(sys.argv[1]), float(sys.argv[2]))
