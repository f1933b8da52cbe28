"""bin/chaos, short and seeded: a real bin/train job (Ray, FSDP) with rollout servers killed,
terminated and stalled while it trains ends with every invariant held (steps reached, nothing
trained twice, versions up, nothing left behind).

The servers run the scripted engine (`rollout_server.engine=scripted`): the faults, the launcher's
restarts and the invariants are under test, not the model, and a restart takes a second instead of
a vLLM start, so the run can afford every server fault kind (seed 6: a stall, a kill, a SIGTERM,
on both servers); a second run takes the network and the disk: a connection partitioned and one
reset through the run's fault proxy, and the run directory's tmpfs filled (root only; elsewhere
packet loss instead), after which the job stops on exit 74 and is started again. A killed server restarted with its vLLM engine is tools/test_train.py's. With
rollouts that cost nothing a step takes 0.1-0.2 s on an idle machine and up to a second on a busy
one, so the faults fall 5-6 s after the first step (``--window-s 6``) and STEPS keeps the job
training past the last of them however fast it steps: on an idle machine the stall (2-8 s, the
others wait for it) ends near step 60, and the kill and the SIGTERM follow within a second.
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
STEPS = 100


def _chaos(tmp_path: Path, seed: int, steps: int, kinds: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bin" / "chaos"),
            *("--seed", str(seed), "--steps", str(steps), "--faults", "3", "--window-s", "6"),
            *("--kinds", kinds, "--disk-mib", "64"),
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
    return report


@pytest.mark.timeout(900)
def test_a_short_seeded_chaos_run_holds_every_invariant(tmp_path: Path) -> None:
    report = _chaos(tmp_path, 6, STEPS, "server-kill,server-stall,server-term")
    assert report["verdict"].startswith("PASS")
    assert sum(f["done_at_s"] is not None for f in report["faults"]) == 3
    assert {f["kind"] for f in report["faults"]} == {"server-kill", "server-stall", "server-term"}
    assert report["facts"]["steps_reached"] == STEPS
    # steps x groups x n, once each
    assert report["facts"]["trained_trajectories"] == STEPS * 2 * 2


@pytest.mark.timeout(900)
def test_the_network_and_a_full_disk_lose_nothing(tmp_path: Path) -> None:
    disk = "disk-full" if os.geteuid() == 0 else "net-loss"  # a tmpfs is mounted as root only
    kinds = {"net-partition", "net-reset", disk}
    report = _chaos(tmp_path, 1, 150, ",".join(sorted(kinds)))
    assert {f["kind"] for f in report["faults"] if f["done_at_s"] is not None} == kinds
    assert all(f["note"] not in ("no connection", "no such process") for f in report["faults"])
    assert report["facts"]["steps_reached"] == 150
    assert report["facts"]["trained_trajectories"] == 150 * 2 * 2
    if disk == "disk-full":  # the job stopped on the full disk, naming it, and was resumed
        full = next(f for f in report["faults"] if f["kind"] == "disk-full")
        assert report["restarts_of_the_job"] >= 1 and "the disk is full" in full["note"], full
        assert not any(Path(report["facts"]["run_dir_saved"]).rglob(".chaos-ballast"))
