"""bin/chaos, short and seeded: a real bin/train job with rollout servers killed and stalled while it
trains ends with every invariant held (steps reached, nothing trained twice, versions up, nothing
left behind)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # a real bin/train job (vLLM, Ray, FSDP)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_a_short_seeded_chaos_run_holds_every_invariant(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bin" / "chaos"),
            *("--seed", "1", "--steps", "5", "--faults", "3", "--window-s", "15"),
            *("--kinds", "server-kill,server-stall,server-term"),
            *("--dir", str(tmp_path), "--timeout-s", "780"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=840,
    )
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert out.returncode == 0, (out.stdout[-3000:], report["violations"])
    assert report["verdict"].startswith("PASS")
    assert sum(f["done_at_s"] is not None for f in report["faults"]) == 3
    assert report["facts"]["steps_reached"] == 5
    assert report["facts"]["trained_trajectories"] == 5 * 2 * 2  # steps x groups x n, once each
