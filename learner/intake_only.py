"""The intake-only learner: a learner link with no trainer behind it.

Design: every batch counts as trained as soon as it arrives, so rollout servers, the protocol and
the transport can be run and measured against a real learner endpoint without Ray, FSDP or a GPU.
The journal is compacted at every stats line (nothing is kept for a checkpoint).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from common.config.root import Config
from common.logging import get_logger
from common.safetensors_buffers import load_dir
from learner.intake import IntakeClosed
from learner.link import LOGGER, LearnerLink


async def serve(
    config: Config,
    run_dir: Path,
    *,
    stats_interval_s: float = 10.0,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> int:
    """The link alone (no trainer): batches count as trained as soon as they arrive. Stops on
    SIGINT/SIGTERM; a stats line is logged every ``stats_interval_s`` and written to
    ``RUN_DIR/intake_stats.json`` on exit."""
    log = get_logger(LOGGER)
    link = LearnerLink(config, run_dir, fresh=True)
    intake = link.intake
    # Version 0 is the checkpoint the run starts from: served to rollout servers that ask for it.
    link.weights.announce(0, load_dir(config.actor_rollout_ref.model.path))
    keys = (
        "peers",
        "batches",
        "trajectories",
        "traj_per_s",
        "tokens_per_s",
        "violations",
        "refused_connections",
        "duplicate_batches",
        "duplicate_trajectories",
    )
    try:
        async with anyio.create_task_group() as tg:
            # The group then waits for it to return (BYE sent to every peer).
            await tg.start(link.run)
            task_status.started(link.address)

            async def on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for sig in signals:
                        log.info("stopping", signal=signal.Signals(sig).name)
                        link.close()

            async def report() -> None:
                while True:
                    await anyio.sleep(stats_interval_s)
                    log.info("intake", **{k: v for k, v in link.summary().items() if k in keys})
                    intake.checkpoint_saved(intake.state_dict())  # nothing is kept: compact

            async with anyio.create_task_group() as helpers:
                helpers.start_soon(on_signal)
                helpers.start_soon(report)
                try:
                    while True:
                        taken = await intake.next_batch(
                            max(1, int(link.stats["buffered_groups"])), 0, sys.maxsize
                        )
                        intake.mark_trained(taken)
                except IntakeClosed:
                    pass
                helpers.cancel_scope.cancel()
    finally:
        link.close()
    return 0
