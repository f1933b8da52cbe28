"""What the learner does while it waits for its batch.

Design: ``Intake.next_batch`` waits for the step's groups; beside it, in one task group, run the
waiters the config turned on: reference forwards over the buffered trajectories
(`learner.early_reference`, ``ref.forward_in_waits``) and the step's first mini-batch
(`learner.early_update`, ``actor.first_mini_batch_in_waits``). Each waiter stops starting work once
the batch is taken (``taken``), and the call returns when the work in flight is done, so the step
never races its own waiters for the workers. The intake's and the workers' errors come out as
themselves; a waiter's error cancels the wait.
"""

from __future__ import annotations

from collections.abc import Awaitable

import anyio

from learner.early_reference import EarlyReference
from learner.early_update import EarlyUpdate
from learner.intake import Intake, TakenBatch


async def next_batch(
    intake: Intake,
    n_groups: int,
    policy_version: int,
    max_staleness: int,
    step: int,
    *,
    early_ref: EarlyReference | None = None,
    early_update: EarlyUpdate | None = None,
) -> TakenBatch:
    """``intake.next_batch``, with ``early_ref``'s loop and ``early_update`` (if any) meanwhile."""
    if early_ref is None and early_update is None:
        return await intake.next_batch(n_groups, policy_version, max_staleness)
    got: list[TakenBatch] = []
    errors: list[Exception] = []
    taken = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def take() -> None:
            try:
                got.append(await intake.next_batch(n_groups, policy_version, max_staleness))
            except Exception as e:
                errors.append(e)
            finally:
                taken.set()

        async def waiter(work: Awaitable[None]) -> None:
            try:
                await work
            except Exception as e:
                errors.append(e)
                tg.cancel_scope.cancel()

        tg.start_soon(take)
        if early_ref is not None:
            tg.start_soon(waiter, early_ref.run(intake.buffered, intake.arrival, taken, step))
        if early_update is not None:
            run = early_update.run(intake, taken, policy_version, max_staleness, step)
            tg.start_soon(waiter, run)
    if errors:
        raise errors[0]
    return got[0]
