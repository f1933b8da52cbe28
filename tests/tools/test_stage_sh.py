"""tools/gpu/stage.sh from a fresh clone: without the vLLM fetch script it says what it needs
(FETCH_VLLM_WHEELS) at once, exit 2, and stages nothing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGE = REPO / "tools" / "gpu" / "stage.sh"


@pytest.mark.integration
def test_missing_fetch_script_is_a_clear_error(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    env = {**os.environ, "FETCH_VLLM_WHEELS": str(tmp_path / "no-such-fetch.sh")}
    result = subprocess.run(
        ["bash", str(STAGE), str(dest)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert "FETCH_VLLM_WHEELS" in result.stderr and "no-such-fetch.sh" in result.stderr
    assert list(dest.iterdir()) == []


@pytest.mark.integration
def test_help_names_the_requirement() -> None:
    result = subprocess.run(
        ["bash", str(STAGE), "--help"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0 and "FETCH_VLLM_WHEELS" in result.stdout
