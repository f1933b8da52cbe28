"""bin/rollout-server's run target. The engine and agent loop are not built yet (issue 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.logging import get_logger


def run(config: Any, run_dir: Path) -> int:
    get_logger("rollout_service").error(
        "the vLLM rollout engine is not part of this build yet; `bin/rollout-server --check` "
        "validates a config, and `python -m protocol.reference rollout-server --connect ADDR` "
        "streams synthetic trajectories to a learner"
    )
    return 2
