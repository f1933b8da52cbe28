"""verl's policy losses by ``actor.policy_loss.loss_mode``, called through verl's own registry.

Design: every mode of ``core_algos.POLICY_LOSS_REGISTRY`` (vanilla, dppo_tv, dppo_kl, gspo, sapo,
gpg, clip_cov, kl_cov, geo_mean, dro, cispo, bypass_mode) runs verl's function with verl's calling
convention (``verl.workers.utils.losses.ppo_loss``): a ``verl.workers.config.ActorConfig`` built once
per worker from our settings (`verl_actor_config`), whose ``global_batch_info`` carries the
mini-batch's global counts (`LossNorm`: dp size, valid tokens, sequences, loss scale factor) for
each micro-batch, and ``rollout_is_weights`` = our truncated importance weights. So every
``loss_agg_mode`` aggregates over the whole mini-batch as verl's does, and the default (vanilla,
dual clip) gives the same numbers as `ppo_policy_loss`.

Every layout of the learner (padded, packed, token-capped micro-batches) hands the loss [B, R]
rows, one sequence per row, so the sequence-level modes (gspo, geo_mean, sapo's seq-mean) see each
sequence whole: a sequence is never split across micro-batches.

Two adjustments, both documented in docs/training.md:
- geo_mean: verl returns ``torch.mean`` over the micro-batch's rows and ignores the global counts;
  with a `LossNorm` we rescale it by rows / global sequences * dp_size, so the summed micro-batch
  losses are the mini-batch's sequence mean (what GMPO means) whatever the micro-batching.
- bypass_mode: verl's rollout correction with old = rollout logprobs; our
  ``off_policy.old_logprobs=rollout`` is that case (the config refuses it otherwise), and its
  settings are ``algorithm.rollout_correction``'s (every IS and rejection mode, ``loss_type``) when
  that section sets rollout_is or rollout_rs, else ``off_policy.is_level`` / ``is_cap`` (PPO clip).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

from learner.algorithms.losses import LOSS_AGG_MODES, LossNorm
from learner.loss_settings import PolicyLossSettings

__all__ = [
    "POLICY_LOSS_MODES",
    "PolicyLossSettings",
    "policy_loss",
    "verl_actor_config",
]

POLICY_LOSS_MODES: tuple[str, ...] = tuple(core_algos.POLICY_LOSS_REGISTRY)
"""verl's registered policy-loss modes (``actor.policy_loss.loss_mode``)."""

# verl's metric names -> ours (token-weighted means over the micro-batch)
_METRIC_NAMES = {
    "actor/pg_clipfrac": "clipfrac",
    "actor/pg_clipfrac_lower": "clipfrac_lower",
    "actor/ppo_kl": "ppo_kl",
}


@functools.lru_cache(maxsize=8)
def verl_actor_config(
    s: PolicyLossSettings,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> ActorConfig:
    """The ActorConfig that verl's loss functions read, made once per worker and settings (cached;
    only its ``global_batch_info`` changes, per micro-batch, as in verl)."""
    if s.loss_mode not in POLICY_LOSS_MODES:
        raise ValueError(
            f"unknown actor.policy_loss.loss_mode {s.loss_mode!r}; "
            f"valid: {', '.join(POLICY_LOSS_MODES)}"
        )
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; known: {', '.join(LOSS_AGG_MODES)}"
        )
    return ActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        use_dynamic_bsz=True,  # skips verl's micro-batch-size checks, which are not ours
        clip_ratio=clip_ratio_low,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        tau_pos=s.tau_pos,
        tau_neg=s.tau_neg,
        policy_loss=PolicyLossConfig(
            loss_mode=s.loss_mode,
            clip_cov_ratio=s.clip_cov_ratio,
            clip_cov_lb=s.clip_cov_lb,
            clip_cov_ub=s.clip_cov_ub,
            kl_cov_ratio=s.kl_cov_ratio,
            ppo_kl_coef=s.ppo_kl_coef,
            dro_beta=s.dro_beta,
            rollout_correction=RolloutCorrectionConfig(
                rollout_is=s.rollout_is,
                rollout_is_threshold=s.rollout_is_threshold,
                rollout_is_batch_normalize=s.rollout_is_batch_normalize,
                rollout_rs=s.rollout_rs,
                rollout_rs_threshold=s.rollout_rs_threshold,
                bypass_mode=s.loss_mode == "bypass_mode",
                loss_type=s.loss_type,
            ),
        ),
    )


def set_global_batch_info(config: ActorConfig, norm: LossNorm | None) -> None:
    """What verl's ``ppo_loss`` writes into ``config.global_batch_info`` before each micro-batch."""
    info = config.global_batch_info
    info.clear()
    if norm is not None:
        info.update(
            dp_size=norm.dp_size,
            batch_num_tokens=norm.batch_num_tokens,
            global_batch_size=norm.global_batch_size,
            loss_scale_factor=norm.loss_scale_factor,
        )


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: ActorConfig,
    norm: LossNorm | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of one micro-batch by ``config.policy_loss.loss_mode`` (verl's function).

    Metrics: ``clipfrac``, ``clipfrac_lower`` and ``ppo_kl`` (0 where a mode has none), plus any
    other metric the mode reports, under its verl name (bypass_mode's ``rollout_corr/...``).
    """
    mode = config.policy_loss.loss_mode
    fn = core_algos.get_policy_loss_fn(mode)
    set_global_batch_info(config, norm)
    mask = response_mask.to(log_prob.dtype)
    if mode == "bypass_mode" and not bool(mask.any()):
        # verl's rollout correction refuses a mask with no token; a rank's dummy micro-batch (kept
        # in step with the others) has none: it contributes nothing, as in every other mode
        return (log_prob * mask).sum(), {"clipfrac": 0.0, "clipfrac_lower": 0.0, "ppo_kl": 0.0}
    # verl's PolicyLossFn order: old_log_prob, log_prob, advantages, response_mask,
    # loss_agg_mode, config, rollout_is_weights
    loss, verl_metrics = fn(
        old_log_prob,
        log_prob,
        advantages,
        mask,
        config.loss_agg_mode,
        config,
        is_weights.detach() if is_weights is not None else None,
    )
    if mode == "geo_mean" and norm is not None and norm.global_batch_size is not None:
        # verl: torch.mean over this micro-batch's rows; make it a share of the global seq-mean
        loss = loss * (mask.shape[0] / norm.global_batch_size * norm.dp_size)
    metrics: dict[str, float] = {"clipfrac": 0.0, "clipfrac_lower": 0.0, "ppo_kl": 0.0}
    for k, v in verl_metrics.items():
        metrics[_METRIC_NAMES[k] if k in _METRIC_NAMES else str(k)] = _as_float(v)
    return loss, metrics


def _as_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean())
    return float(v)
