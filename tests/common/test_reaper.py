"""common.reaper: the descendants of a process killed with SIGKILL do not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration  # child processes, killed

REPO = Path(__file__).resolve().parents[2]

# A stand-in for a rollout server: a reaper, then an engine-like child by fork and one by spawn
# (vLLM uses either), neither of which watches its parent.
SERVER = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    sys.path.insert(0, sys.argv[1])
    from common import reaper

    def sleep():
        time.sleep(600)

    if __name__ == "__main__":
        reaper.watch()
        kids = [mp.get_context(m).Process(target=sleep) for m in ("fork", "spawn")]
        for k in kids:
            k.start()
        print(" ".join(str(k.pid) for k in kids), flush=True)
        time.sleep(600)
    """
)


def test_sigkill_of_the_server_takes_its_children(tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    server = subprocess.Popen(
        [sys.executable, str(script), str(REPO)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        kids = [psutil.Process(int(p)) for p in server.stdout.readline().split()]
        assert len(kids) == 2
        reapers = [
            p for p in psutil.Process(server.pid).children() if "reaper.py" in " ".join(p.cmdline())
        ]
        assert len(reapers) == 1
        time.sleep(1.5)  # a few of the reaper's looks at the tree
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        _, alive = psutil.wait_procs(kids, timeout=10)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
        _, alive = psutil.wait_procs(reapers, timeout=10)
        assert not alive, "the reaper outlived its work"
    finally:
        server.kill()
        for p in psutil.Process().children(recursive=True):
            p.kill()
