"""bin/learner (intake) as a real child process on the tiny model passes bin/conformance, and
trains nothing of the suite's synthetic batches (they are acknowledged, never journaled)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.plan import free_port

# serial: whole bin/learner processes (each starts Ray) under the conformance suite's timeouts; one
# stalled after its handshake for 120 s beside the other worker
pytestmark = [pytest.mark.integration, pytest.mark.serial]

ROOT = Path(__file__).resolve().parents[2]


def test_learner_intake_passes_conformance(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    subprocess.run(
        [sys.executable, str(ROOT / "bin/make-tiny-model"), "--out", str(model)], check=True
    )
    addr = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    log = tmp_path / "learner.log"
    with open(log, "w") as out:
        learner = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bin/learner"),
                "--config",
                str(ROOT / "configs/default.yaml"),
                f"actor_rollout_ref.model.path={model}",
                f"learner.bind_address={addr}",
                f"trainer.run_dir={tmp_path / 'run'}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 60
        while "listening" not in log.read_text():
            assert learner.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "learner did not start"
            time.sleep(0.1)
        res = subprocess.run(
            [
                sys.executable,
                str(ROOT / "bin/conformance"),
                "--role",
                "learner",
                "--target",
                addr,
                "--model-dir",
                str(model),
                "--token-file",
                str(tmp_path / "run" / "learner.token"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        assert "0 failed" in res.stdout
        learner.send_signal(signal.SIGINT)
        assert learner.wait(timeout=20) == 0, log.read_text()
        stats = json.loads((tmp_path / "run" / "intake_stats.json").read_text())
        # Probing a live learner changes nothing it trains: every batch was a probe, none stored.
        assert stats["probe_batches"] > 0, stats
        assert (
            stats["batches"] == 0 and stats["trajectories"] == 0 and stats["journal_records"] == 0
        ), stats
        assert stats["buffered_groups"] == 0 and stats["buffered_batches"] == 0, stats
        assert not (tmp_path / "run" / "trained.jsonl").exists()
        assert (tmp_path / "run" / "config.resolved.yaml").is_file()
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()
