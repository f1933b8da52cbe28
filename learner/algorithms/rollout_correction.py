"""verl's rollout correction in decoupled mode: importance weights, rejection and the mismatch
metrics between the rollout's logprobs and the learner's (pi_old), by verl's own function.

Design: one call of ``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask``
over the whole step's batch, with verl's ``algorithm.rollout_correction`` keys as they are, where
the trainer has both logprobs (`learner.prepare.rewards_and_advantages`, after the separate
old-logprob forward, before the advantages, as verl's trainer calls it). So every mode of verl
0.9.1 (``rollout_is`` token / sequence with a truncation or an IcePop band,
``rollout_is_batch_normalize``, every ``rollout_rs`` option and their chains) gives verl's numbers:
the weights go to the loss as ``rollout_is_weights``, the rejected tokens leave the response mask
(hence the advantages and the loss's counts), and verl's metrics (``rollout_corr/kl``, ``k3_kl``,
``chi2_token``, ``chi2_seq``, ``ppl_ratio``, ``rollout_is_*``, ``rollout_rs_*``...) are the step's.
Bypass mode runs verl's bypass loss instead (`learner.algorithms.policy_losses`), which applies the
same settings per micro-batch against the current policy, as verl does.
"""

from __future__ import annotations

import torch
from verl.trainer.ppo.rollout_corr_helper import (
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    compute_rollout_correction_and_rejection_mask,
)

from common.config.training import RolloutCorrectionConfig

__all__ = ["SUPPORTED_ROLLOUT_RS_OPTIONS", "rollout_correction"]


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(importance weights or None, response mask with the rejected tokens 0, ``rollout_corr/*``
    metrics) of a [B, R] batch, by verl's function."""
    mask = response_mask.to(old_log_prob.dtype)
    if not bool(mask.any()):
        return None, mask, {}
    weights, new_mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_log_prob,
        rollout_log_prob=rollout_log_prob,
        response_mask=mask,
        rollout_is=cfg.rollout_is,
        rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_is_batch_normalize=cfg.rollout_is_batch_normalize,
        rollout_rs=cfg.rollout_rs,
        rollout_rs_threshold=cfg.rollout_rs_threshold,
    )
    w = None if weights is None else weights.batch["rollout_is_weights"]
    return w, new_mask, {k: float(v) for k, v in metrics.items()}
