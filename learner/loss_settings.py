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
    from common.config.training import RolloutCorrectionConfig

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
    # bypass_mode: verl's rollout_correction settings (algorithm.rollout_correction when it is
    # active, else actor.off_policy.is_level / is_cap as a truncation)
    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    loss_type: str = "ppo_clip"


def policy_loss_settings(
    actor: ActorConfig, correction: RolloutCorrectionConfig | None = None
) -> PolicyLossSettings:
    """The settings of a loaded ``actor_rollout_ref.actor`` section (and of
    ``algorithm.rollout_correction`` when it is active)."""
    pl, op = actor.policy_loss, actor.off_policy
    if correction is not None and correction.active:
        is_settings: dict[str, object] = {
            "rollout_is": correction.rollout_is,
            "rollout_is_threshold": correction.rollout_is_threshold,
            "rollout_is_batch_normalize": correction.rollout_is_batch_normalize,
            "rollout_rs": correction.rollout_rs,
            "rollout_rs_threshold": correction.rollout_rs_threshold,
            "loss_type": correction.loss_type,
        }
    else:
        is_settings = {
            "rollout_is": None if op.is_level == "off" else op.is_level,
            "rollout_is_threshold": op.is_cap,
            "loss_type": correction.loss_type if correction is not None else "ppo_clip",
        }
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
        **is_settings,  # type: ignore[arg-type]
    )
