"""bin/learner's run target: the trainer (intake + Ray/FSDP workers) until the last step or a signal.

Heavy imports (torch, Ray, verl) happen here, after the config has been checked, so `--help` and
`--check` stay instant. The local Ray cluster started for the workers is shut down on every exit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio


def run(config: Any, run_dir: Path) -> int:
    from learner.trainer import Trainer

    try:
        return anyio.run(Trainer(config, run_dir).run)
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
