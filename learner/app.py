"""bin/learner's run target. Until the trainer lands (issue 4) the learner runs its intake alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio


def run(config: Any, run_dir: Path) -> int:
    from learner.intake import serve

    return anyio.run(serve, config, run_dir)
