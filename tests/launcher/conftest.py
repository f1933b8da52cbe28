"""Shared by the launcher's tests: the overrides of a small job whose model and data exist."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def job_overrides(tmp_path: Path) -> list[str]:
    """A model directory and a one-row data file under ``tmp_path``, named by overrides with a
    2-step run in ``tmp_path / "run"`` (bin/train's own checks need both to exist)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "t.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    return [
        f"actor_rollout_ref.model.path={tmp_path / 'm'}",
        f"data.train_files={tmp_path / 't.jsonl'}",
        "trainer.total_training_steps=2",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
