"""bin/learner's run target: the trainer (intake + Ray/FSDP workers) until the last step or a signal.

Heavy imports (torch, Ray, verl) happen here, after the config has been checked, so `--help` and
`--check` stay instant. The local Ray cluster started for the workers is shut down on every exit.
Once the workers are up the learner says so on the run's event channel (`common.run_events`), which
bin/train follows instead of the log.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from common.config.root import Config


class _Ready:
    """Trainer.run's task status: it reports its address once its workers are up and it trains."""

    def started(self, value: str | None = None) -> None:
        from common.run_events import Kind, emit

        emit(Kind.READY, "learner", address=value)


def run(config: Config, run_dir: Path) -> int:
    import sys

    from learner.sinks import missing_sink_packages

    # Before Ray and the workers: a sink that cannot be built would fail only after them.
    if missing := missing_sink_packages(config.trainer.logger):
        print("\n".join(missing), file=sys.stderr)
        return 2
    from learner.trainer import Trainer

    try:
        return anyio.run(partial(Trainer(config, run_dir).run, task_status=_Ready()))
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
