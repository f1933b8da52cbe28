"""bin/chaos, short and seeded: a real bin/train job (Ray, FSDP) under one fault of each kind the
suite can afford ends with every invariant held (steps reached, nothing trained twice, versions
up, nothing left behind).

The servers run the scripted engine (`rollout_server.engine=scripted`): the faults, the launcher's
restarts and the invariants are under test, not the model, and a restart takes a second instead of
a vLLM start. One run takes the processes (a rollout server stalled, killed and sent SIGTERM), the
network (a connection partitioned and one reset, through the run's fault proxy) and the disk (the
run directory's tmpfs filled: the job stops on exit 74 naming it and is started again with resume;
mounting a tmpfs needs root, so elsewhere packet loss takes its place). Learner kills are the long
run's (docs/chaos.md): a restart with vLLM costs about a minute here. A killed server restarted
with its vLLM engine is tools/test_train.py's.

With rollouts that cost nothing a step takes 0.1-0.2 s on an idle machine and up to a second on a
busy one, so the faults fall 5-8 s after the first step (``--window-s 8``), every kind once in a
seeded order, and STEPS keeps the job training past the last of them however fast it steps: the
stall (2-8 s) and the full disk (5-15 s) hold the others back while they last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # a real bin/train job (Ray, FSDP)

REPO = Path(__file__).resolve().parents[2]
STEPS = 200


@pytest.mark.timeout(900)
def test_a_short_seeded_chaos_run_holds_every_invariant(tmp_path: Path) -> None:
    disk = "disk-full" if os.geteuid() == 0 else "net-loss"  # a tmpfs is mounted as root only
    kinds = {"server-kill", "server-stall", "server-term", "net-partition", "net-reset", disk}
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bin" / "chaos"),
            *("--seed", "6", "--steps", str(STEPS), "--faults", str(len(kinds))),
            *("--window-s", "8", "--kinds", ",".join(sorted(kinds)), "--disk-mib", "64"),
            *("--dir", str(tmp_path), "--timeout-s", "780"),
            "rollout_server.engine=scripted",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=840,
    )
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert out.returncode == 0, (out.stdout[-3000:], report["violations"])
    assert report["verdict"].startswith("PASS")
    assert {f["kind"] for f in report["faults"] if f["done_at_s"] is not None} == kinds
    assert report["facts"]["steps_reached"] == STEPS
    # steps x groups x n, once each
    assert report["facts"]["trained_trajectories"] == STEPS * 2 * 2
    if disk == "disk-full":  # the job stopped on the full disk, naming it, and was resumed
        full = next(f for f in report["faults"] if f["kind"] == "disk-full")
        assert report["restarts_of_the_job"] >= 1 and "the disk is full" in full["note"], full
        assert not any(Path(report["facts"]["run_dir_saved"]).rglob(".chaos-ballast"))
