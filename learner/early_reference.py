"""Reference logprobs computed while the learner waits for its batch.

Design: the reference policy never changes during a run, so a trajectory's reference logprobs can
be computed as soon as it is buffered, not only once its step's batch is complete. While the
trainer waits in ``Intake.next_batch``, `EarlyReference.run` takes the buffered groups in the
order the next step takes them (earliest deadline first) and runs the reference forward over their
trajectories on the otherwise idle workers, at most ``chunk`` samples a call, keeping each result by
trajectory id. The trainer's prepare then runs the reference forward only over the samples that
have none (`take`). The loop starts no chunk once the batch is taken, so the wait grows by at most
the chunk in flight, and work done for groups the step does not take serves a later step. Results
of groups that left the buffer without being trained (dropped as stale) are forgotten at each
`take`, so what is kept never exceeds the buffer. Nothing is persisted: after a restart the
forward runs again. `ensure` computes them on demand, for the samples `learner.early_update`
trains in the wait; the loop (`run`, `learner.waits`) runs with ``ref.forward_in_waits`` only.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import anyio
import numpy as np

from common.timeline import EARLY_REF_SPAN, TimelineWriter, Track
from learner.buffer import Group
from learner.prepare import to_samples
from learner.samples import Batching, Sample
from learner.workers import WorkerGroup
from protocol.trajectory import Trajectory


async def arrival_or_take(arrival: Callable[[], Awaitable[None]], taken: anyio.Event) -> None:
    """Returns at the next arrival (``arrival()``), or once the batch is taken: a waiter's pause
    between two looks at the buffer."""
    async with anyio.create_task_group() as tg:

        async def stop_on_take() -> None:
            await taken.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(stop_on_take)
        await arrival()
        tg.cancel_scope.cancel()


class EarlyReference:
    def __init__(
        self,
        workers: WorkerGroup,
        batching: Callable[[], Batching],
        chunk: int,
        timeline: TimelineWriter,
    ) -> None:
        """``chunk``: the most samples one reference forward takes (a micro-batch per rank)."""
        self._workers, self._batching, self._chunk = workers, batching, max(1, chunk)
        self._timeline = timeline
        self._done: dict[str, np.ndarray] = {}  # trajectory id -> reference logprobs
        self._seconds = 0.0  # forward time spent in waits since the last take
        self._early = 0  # samples of the last taken batch that had them already

    @property
    def computed(self) -> int:
        """Trajectories whose reference logprobs are kept, waiting for their step."""
        return len(self._done)

    async def run(
        self,
        buffered: Callable[[], Sequence[Group]],
        arrival: Callable[[], Awaitable[None]],
        taken: anyio.Event,
        step: int,
    ) -> None:
        """Until ``taken`` is set: reference forwards over ``buffered()`` groups' trajectories
        that have none yet, waiting for an ``arrival()`` when all have them."""
        while not taken.is_set():
            todo = [
                t for g in buffered() for t in g.trajectories if t.trajectory_id not in self._done
            ][: self._chunk]
            if not todo:
                await arrival_or_take(arrival, taken)
                continue
            await self._forward(todo, step)

    async def _forward(self, todo: list[Trajectory], step: int) -> None:
        start, t0 = time.time(), time.perf_counter()
        samples = to_samples(todo)
        await self._workers.forward("ref", samples, "ref_logprobs", self._batching())
        for t, s in zip(todo, samples, strict=True):
            assert s.ref_logprobs is not None
            self._done[t.trajectory_id] = s.ref_logprobs
        self._seconds += time.perf_counter() - t0
        self._timeline.span(Track.STEP, EARLY_REF_SPAN, start, time.time(), step=step, n=len(todo))

    async def ensure(self, trajs: Sequence[Trajectory], step: int) -> None:
        """Reference logprobs for those of ``trajs`` that have none yet (`learner.early_update`
        needs them for the samples it trains in the wait), at most ``chunk`` a forward."""
        todo = [t for t in trajs if t.trajectory_id not in self._done]
        for i in range(0, len(todo), self._chunk):
            await self._forward(todo[i : i + self._chunk], step)

    def give(self, trajs: Sequence[Trajectory], samples: Sequence[Sample]) -> None:
        """Set ``samples`` (of ``trajs``) their reference logprobs, keeping them for `take`."""
        for t, s in zip(trajs, samples, strict=True):
            s.ref_logprobs = self._done[t.trajectory_id]

    def take(
        self, trajs: Sequence[Trajectory], samples: Sequence[Sample], still: Sequence[Group]
    ) -> list[int]:
        """Give ``samples`` (of ``trajs``, the step's batch) the reference logprobs computed
        early; the indices of those that have none. Forgets what belongs to neither the batch nor
        ``still`` (the groups left in the buffer)."""
        missing = []
        for i, (t, s) in enumerate(zip(trajs, samples, strict=True)):
            got = self._done.pop(t.trajectory_id, None)
            if got is None:
                missing.append(i)
            else:
                s.ref_logprobs = got
        alive = {t.trajectory_id for g in still for t in g.trajectories}
        for key in [k for k in self._done if k not in alive]:
            del self._done[key]
        self._early = len(samples) - len(missing)
        return missing

    def metrics(self, n: int) -> dict[str, float]:
        """``timing/ref_early_s``: reference forwards run in waits since the last step;
        ``prepare/ref_early_frac``: the share of this step's ``n`` samples that had theirs then."""
        out = {
            "timing/ref_early_s": self._seconds,
            "prepare/ref_early_frac": self._early / max(n, 1),
        }
        self._seconds = 0.0
        return out
