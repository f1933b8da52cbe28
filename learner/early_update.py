"""A step's first mini-batch trained while the learner waits for the rest of its batch
(``actor_rollout_ref.actor.first_mini_batch_in_waits``).

Design: a learner that waits for its batch waits for groups its step must train now: their oldest
token is ``max_staleness`` versions old, so the next step would be too late for them (admission
waits for them rather than drop them). Groups that are due now come first in the batch
(`learner.buffer.GroupBuffer.take`: earliest deadline first, arrival order among equals), and
nothing can come before them: an earlier deadline is stale and dropped, and a later arrival with
the same deadline sorts after them. So once the first groups of the buffer are all due and fill the
step's first mini-batch, that mini-batch is fixed whatever else arrives. It is fixed too when
admission knows that every group still generating starts on those groups' newest version or later
(`Intake.generating_from`): the case of a learner that waits for groups of the current version,
not for due ones. While the learner waits,
`EarlyUpdate.run` finds that moment, gives those samples their advantages (per group: the
estimators of `PER_GROUP`) and their reference logprobs (`learner.early_reference`), and has the
workers run the mini-batch's forward and backward, holding its optimizer step
(`learner.worker_api.UpdateRequest.hold`). When the batch is taken, `take` checks that the
step's first mini-batch is exactly these samples; the update then continues with the later
mini-batches (``continues``): the held step first, after the prepare ran the later mini-batches'
old-logprob forward on the weights before it, as always. The step trains what it would have
trained without this, in the same order; only the first mini-batch's compute moved into the wait.

A batch whose first mini-batch is not the held one (a group of another size, a restart's replayed
group) runs its update as usual: that drops the held gradients, and ``timing/early_update_wasted_s``
counts what they cost. The rule covers the config where one mini-batch's result cannot depend on the
rest of the batch (`unavailable`): old logprobs from the update's own forward, one epoch, advantages
per group, no critic, no dynamic sampling and no dataset mix. Nothing is persisted: a restart
between the hold and the step loses only the held gradients.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from common.config.root import Config
from common.timeline import EARLY_UPDATE_SPAN, TimelineWriter, Track
from learner.buffer import Group, GroupKey
from learner.early_reference import EarlyReference, arrival_or_take
from learner.intake import Intake, TakenBatch
from learner.prepare import (
    mini_batch_count,
    old_logprobs_from_update,
    rewards_and_advantages,
    to_samples,
)
from learner.samples import Batching, even_chunks, split_for_ranks
from learner.worker_api import UpdateRequest
from learner.worker_settings import WorkerSettings
from learner.workers import WorkerGroup

if TYPE_CHECKING:
    from learner.algorithms.kl import KLController

PER_GROUP = frozenset({"grpo", "rloo"})
"""Advantage estimators whose advantage of a sample depends on its group alone."""


def unavailable(config: Config) -> str | None:
    """Why a step's first mini-batch cannot be trained before its batch is complete (None: it can)."""
    alg = config.algorithm
    reasons = [
        (mini_batch_count(config) < 2, "one mini-batch a step: nothing would be left to wait for"),
        (
            old_logprobs_from_update(config, config.trainer.critic_warmup) is None,
            "the old logprobs must come from the update's own forward "
            "(actor.off_policy: recompute, skip_old_logprob_forward auto, one PPO epoch, no "
            "KL in the reward, no rollout correction)",
        ),
        (
            alg.adv_estimator not in PER_GROUP,
            f"algorithm.adv_estimator {alg.adv_estimator!r} is not one of "
            f"{sorted(PER_GROUP)}, whose advantages are per group",
        ),
        (config.critic.enable, "a critic's update is not split"),
        (alg.filter_groups.enable, "dynamic sampling decides the batch when it is taken"),
        (bool(config.data.datasets), "a dataset mix decides the batch when it is taken"),
    ]
    return next((why for bad, why in reasons if bad), None)


def first_groups(batch_samples: int, n: int, mini_batches: int) -> int:
    """Whole groups of ``n`` in a step's first mini-batch of ``batch_samples`` cut in
    ``mini_batches`` (`even_chunks`); 0 when the cut falls inside a group."""
    first = len(even_chunks(range(batch_samples), mini_batches)[0])
    return first // n if first % n == 0 else 0


def fixed_first(
    queued: Sequence[Group],
    groups: int,
    n: int,
    policy_version: int,
    max_staleness: int,
    generating_from: float = -math.inf,
) -> list[Group] | None:
    """The ``groups`` groups of ``n`` trajectories that will be the step's first mini-batch whatever
    arrives, if the buffer (``queued``, earliest deadline first) already holds them all: none can
    be displaced when every group that can still arrive starts at their newest oldest version or
    later (``generating_from``, `Intake.generating_from`: a later arrival with the same deadline
    sorts after them), or when they are all due now (an earlier deadline is stale). None also when
    the first mini-batch does not hold whole groups (``groups`` 0)."""
    head = list(queued[:groups])
    if groups == 0 or len(head) < groups:
        return None
    if any(g.oldest_version is None or g.carried or len(g.trajectories) != n for g in head):
        return None
    newest = max(g.oldest_version or 0 for g in head)
    due = all(g.staleness(policy_version) == max_staleness for g in head)
    return head if due or newest <= generating_from else None


@dataclass(frozen=True)
class Held:
    """The first mini-batch the workers hold: its groups, in batch order, and its sample count."""

    keys: tuple[GroupKey, ...]
    samples: int
    seconds: float


class EarlyUpdate:
    def __init__(
        self,
        config: Config,
        settings: WorkerSettings,
        workers: WorkerGroup,
        batching: Callable[[], Batching],
        kl_ctrl: KLController,
        early_ref: EarlyReference | None,
        timeline: TimelineWriter,
    ) -> None:
        """``early_ref``: where the held samples' reference logprobs come from (None: no reference
        model); ``batching``: how the update cuts micro-batches (known once the workers run)."""
        self._config, self._settings, self._workers = config, settings, workers
        self._batching, self._kl_ctrl, self._early_ref = batching, kl_ctrl, early_ref
        self._timeline = timeline
        rollout = config.actor_rollout_ref.rollout
        self._n = rollout.n
        batch = config.data.train_batch_size * rollout.n
        self.first_groups = first_groups(batch, rollout.n, mini_batch_count(config))
        self.held: Held | None = None
        self._wasted = 0.0

    def first_mini_batch(
        self,
        queued: Sequence[Group],
        policy_version: int,
        max_staleness: int,
        generating_from: float = -math.inf,
    ) -> list[Group] | None:
        """`fixed_first` of this run's first mini-batch."""
        return fixed_first(
            queued, self.first_groups, self._n, policy_version, max_staleness, generating_from
        )

    async def run(
        self,
        intake: Intake,
        taken: anyio.Event,
        policy_version: int,
        max_staleness: int,
        step: int,
    ) -> None:
        """Until ``taken`` is set: hold the first mini-batch as soon as the buffer fixes it."""
        self.held = None
        while not taken.is_set():
            head = self.first_mini_batch(
                intake.buffered(), policy_version, max_staleness, intake.generating_from()
            )
            if head is not None:
                await self.hold(head, step)
                return
            await arrival_or_take(intake.arrival, taken)

    async def hold(self, groups: Sequence[Group], step: int) -> None:
        """The forward and backward of ``groups``' samples on the workers, their step held."""
        start, t0 = time.time(), time.perf_counter()
        trajs = [t for g in groups for t in g.trajectories]
        samples = to_samples(trajs)
        if self._settings.need_ref:
            assert self._early_ref is not None  # the trainer makes one whenever a KL term needs it
            await self._early_ref.ensure(trajs, step)
            self._early_ref.give(trajs, samples)
        rewards_and_advantages(
            self._config, trajs, samples, self._kl_ctrl, in_update=True, critic=False
        )
        if not self._settings.use_kl_loss:  # not read by the update: it does not travel
            for s in samples:
                s.ref_logprobs = None
        world = self._workers.world
        plans = split_for_ranks(samples, mini_batches=1, ranks=world, batching=self._batching())
        old = old_logprobs_from_update(self._config, step)
        assert old is not None  # `unavailable` said so
        await self._workers.update([UpdateRequest("actor", p, 1, old, hold=True) for p in plans])
        seconds = time.perf_counter() - t0
        self.held = Held(tuple(g.key for g in groups), len(samples), seconds)
        end = time.time()
        self._timeline.span(Track.STEP, EARLY_UPDATE_SPAN, start, end, step=step, n=len(samples))

    def take(self, taken: TakenBatch) -> Held | None:
        """The held first mini-batch if it is the step's (the update then continues it); else None,
        and the held gradients, which the update drops, count as wasted."""
        held, self.held = self.held, None
        if held is None:
            return None
        n = sum(taken.group_sizes)
        first = len(even_chunks(range(n), mini_batch_count(self._config))[0])
        if first == held.samples and tuple(taken.keys[: len(held.keys)]) == held.keys:
            return held
        self._wasted += held.seconds
        return None

    def metrics(self, held: Held | None) -> dict[str, float]:
        """``prepare/early_update``: the step continued a first mini-batch held in its wait (1) or
        not (0); ``timing/early_update_s``: that mini-batch's forward and backward, in the wait;
        ``timing/early_update_wasted_s``: held work no step used, since the last report."""
        out = {
            "prepare/early_update": float(held is not None),
            "timing/early_update_s": held.seconds if held is not None else 0.0,
            "timing/early_update_wasted_s": self._wasted,
        }
        self._wasted = 0.0
        return out
