"""bin/demo --help: prints its usage and bin/train's, and never deletes or makes anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_demo_help_touches_nothing(tmp_path: Path) -> None:
    last_run = tmp_path / "demo"
    last_run.mkdir()
    (last_run / "metrics.jsonl").write_text('{"step": 1}\n')
    for flag in ("--help", "-h"):
        env = {**os.environ, "DEMO_DIR": str(tmp_path)}
        result = subprocess.run(
            [str(REPO / "bin" / "demo"), "trainer.total_training_steps=2", flag],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert "DEMO_DIR" in result.stdout and "usage: train" in result.stdout
        assert (
            last_run / "metrics.jsonl"
        ).read_text() == '{"step": 1}\n'  # the last run is still there
        assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no model or data made
