"""The ``actor.policy_loss`` settings as the trainer hands them to its workers.

Design: a frozen, hashable dataclass of plain values that imports neither torch nor verl, so that
`learner.worker_settings.WorkerSettings` stays cheap to import; `learner.algorithms.policy_losses` turns it
into the ActorConfig that verl's loss functions read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config.actor_rollout_ref import ActorConfig

__all__ = ["PolicyLossSettings", "policy_loss_settings"]


@dataclass(frozen=True)
class PolicyLossSettings:
    """``actor.policy_loss`` keys, SAPO's taus and bypass_mode's importance-sampling settings; the
    clip ratios and ``loss_agg_mode`` are the actor's own keys (`learner.worker_settings.WorkerSettings`)."""

    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    rollout_is: str | None = None  # bypass_mode: "token", "sequence" or None
    rollout_is_threshold: float = 2.0  # bypass_mode: truncation of its IS weights


def policy_loss_settings(actor: ActorConfig) -> PolicyLossSettings:
    """The settings of a loaded ``actor_rollout_ref.actor`` section."""
    pl, op = actor.policy_loss, actor.off_policy
    return PolicyLossSettings(
        loss_mode=pl.loss_mode,
        clip_cov_ratio=pl.clip_cov_ratio,
        clip_cov_lb=pl.clip_cov_lb,
        clip_cov_ub=pl.clip_cov_ub,
        kl_cov_ratio=pl.kl_cov_ratio,
        ppo_kl_coef=pl.ppo_kl_coef,
        dro_beta=pl.dro_beta,
        tau_pos=actor.tau_pos,
        tau_neg=actor.tau_neg,
        rollout_is=None if op.is_level == "off" else op.is_level,
        rollout_is_threshold=op.is_cap,
    )
