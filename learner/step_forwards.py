"""The forward-only passes a training step runs before its update.

Design: which forwards run is decided by the config alone (and by what the wait already computed):
old logprobs, unless the rollout's stand for them or the update takes the first mini-batch's from
its own forward (then only the later mini-batches run here, `learner.prepare.old_logprob_parts`);
reference logprobs, for the samples the wait did not give them to (`learner.early_reference`);
values, with a critic. Each lands in its samples' field; nothing is returned.
"""

from __future__ import annotations

from common.config.root import Config
from learner.prepare import old_logprob_parts
from learner.samples import Batching, Sample
from learner.worker_settings import WorkerSettings
from learner.workers import WorkerGroup


async def forward_passes(
    config: Config,
    settings: WorkerSettings,
    workers: WorkerGroup,
    passes: Batching,
    samples: list[Sample],
    *,
    in_update: bool,
    ref_missing: list[int] | None,
) -> None:
    """``in_update``: the update takes (some) old logprobs from its own forward;
    ``ref_missing``: the samples still without reference logprobs (None: all of them)."""
    if config.actor_rollout_ref.actor.off_policy.old_logprobs == "rollout":
        for s in samples:
            s.old_logprobs = s.rollout_logprobs
    elif not in_update:
        await workers.forward("actor", samples, "old_logprobs", passes)
    elif parts := old_logprob_parts(config, len(samples)):
        await workers.forward("actor", samples, "old_logprobs", passes, parts=parts)
    if settings.need_ref and ref_missing is None:
        await workers.forward("ref", samples, "ref_logprobs", passes)
    elif settings.need_ref and ref_missing:
        await workers.forward("ref", samples, "ref_logprobs", passes, parts=[ref_missing])
    if settings.critic_model_path:
        await workers.forward("critic", samples, "values", passes)
