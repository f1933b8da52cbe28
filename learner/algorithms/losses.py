"""Per-token losses of the actor and critic, their aggregation, and the off-policy weights.

Design: pure torch on [B, T] tensors; verl's ``core_algos`` does the aggregation, the value loss
and the KL estimators. The truncated importance weights are our own, held to verl's numbers by
tests. The learner's policy loss is verl's, by ``actor.policy_loss.loss_mode``
(`learner.algorithms.policy_losses`); `ppo_policy_loss` is the hand-written vanilla PPO (dual
clip) that the tests hold verl's vanilla to, bit for bit.
Metrics are 0-dim detached tensors so that a micro-batch loop never forces a device sync.

Global normalisation (data parallel + gradient accumulation), what the caller must do:
  1. Build one ``LossNorm`` per mini-batch from the counts of the WHOLE mini-batch (all ranks, all
     micro-batches; all-reduce the local counts) and ``dp_size`` = data-parallel world size.
  2. Call ``backward()`` on every micro-batch loss as is: no division by the number of
     micro-batches (the global denominator already accounts for them).
  3. Let FSDP/DDP average gradients over ranks: verl's ``agg_loss`` multiplies by ``dp_size``, and
     that average divides it out again, so the update equals the single-process full-batch one.
  4. To log the loss: sum the micro-batch losses of a rank, then average over ranks.
  5. For ``seq-mean-token-sum-norm`` set ``loss_scale_factor`` to a constant (e.g. the maximum
     response length); otherwise each micro-batch divides by its own padded length.
With ``norm=None`` every count is the micro-batch's own (verl's single-process default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast, get_args

import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo import core_algos

__all__ = [
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "LossAggMode",
    "LossNorm",
    "agg_loss",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_from_logits",
    "ppo_policy_loss",
    "truncated_is_weights",
    "value_loss",
]

LossAggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

# k1/k2/k3 are verl's aliases of kl/mse/low_var_kl; a "+" suffix (e.g. "k3+") keeps the forward
# value and takes the gradient of k2 (unbiased KL gradient), for use as a loss.
KL_PENALTY_KINDS: tuple[str, ...] = ("kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3")

_LOG_RATIO_BOUND = 20.0  # exp(20) ~ 5e8: keeps ratios finite, as verl does


@dataclass(frozen=True)
class LossNorm:
    """Global counts of the mini-batch that a micro-batch loss is normalised by (see module doc)."""

    dp_size: int = 1
    """Data-parallel world size; the loss is multiplied by it to undo FSDP's gradient average."""
    batch_num_tokens: int | None = None
    """Valid (mask 1) tokens in the whole mini-batch: denominator of token-mean."""
    global_batch_size: int | None = None
    """Sequences with at least one valid token in the whole mini-batch: denominator of seq-mean-*."""
    loss_scale_factor: int | None = None
    """Constant divisor of seq-mean-token-sum-norm; None: the micro-batch's padded length."""

    @classmethod
    def from_mask(
        cls, response_mask: torch.Tensor, *, dp_size: int = 1, loss_scale_factor: int | None = None
    ) -> LossNorm:
        """Counts of ``response_mask``, which must be the whole mini-batch's mask (all ranks)."""
        return cls(
            dp_size=dp_size,
            batch_num_tokens=int(response_mask.sum().item()),
            global_batch_size=int((response_mask.sum(-1) > 0).sum().item()),
            loss_scale_factor=loss_scale_factor,
        )


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    norm: LossNorm | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar by ``mode`` (verl's ``agg_loss``)."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(LOSS_AGG_MODES)}")
    norm = norm or LossNorm()
    return core_algos.agg_loss(
        loss_mat=loss_mat,
        loss_mask=loss_mask.to(loss_mat.dtype),
        loss_agg_mode=mode,
        dp_size=norm.dp_size,
        batch_num_tokens=norm.batch_num_tokens,
        global_batch_size=norm.global_batch_size,
        loss_scale_factor=norm.loss_scale_factor,
    )


def ppo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    norm: LossNorm | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip around ``old_log_prob`` with dual clip for A < 0; ``is_weights`` scale each token.

    In decoupled PPO ``old_log_prob`` is the proximal policy (learner weights before the update) and
    ``is_weights`` = truncated pi_old / pi_rollout; in bypass mode it is the rollout's logprobs.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip bound), got {clip_ratio_c}")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pessimistic = torch.maximum(unclipped, clipped)
    # Dual clip: with A < 0 a huge ratio would make the loss unbounded; cap it at -A * c.
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    losses = torch.where(negative, torch.minimum(dual_bound, pessimistic), pessimistic)
    if is_weights is not None:
        losses = losses * is_weights.detach()
    loss = agg_loss(losses, mask, loss_agg_mode, norm)
    with torch.no_grad():
        metrics = {
            "clipfrac": verl_F.masked_mean((clipped > unclipped).to(mask.dtype), mask),
            "clipfrac_lower": verl_F.masked_mean(
                ((pessimistic > dual_bound) & negative).to(mask.dtype), mask
            ),
            "ppo_kl": verl_F.masked_mean(-log_ratio, mask),
        }
    return loss, metrics


def truncated_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float,
    level: Literal["token", "sequence"] = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights min(pi_old / pi_rollout, cap), detached, 0 where mask is 0.

    ``token``: one ratio per token; ``sequence``: exp(sum of the sequence's masked log-ratios),
    broadcast over its tokens. Metrics: ``is_weight_mean`` (of the truncated weights, the ones the
    loss uses), ``is_truncated_frac`` (share of tokens, or of sequences, above ``cap``) and
    ``is_weight_max`` (before truncation, to show how stale the data is).
    """
    if cap <= 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    with torch.no_grad():
        mask = response_mask.to(old_log_prob.dtype)
        # Masking first: tool tokens have no rollout logprob worth trusting, keep them out of sums.
        log_ratio = (old_log_prob - rollout_log_prob) * mask
        if level == "token":
            unit_mask = mask
        elif level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True)
            unit_mask = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
        else:
            raise ValueError(f"unknown importance-weight level {level!r}; known: token, sequence")
        raw = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)) * unit_mask
        weights = (raw.clamp(max=cap).expand_as(mask) * mask).detach()
        metrics = {
            "is_weight_mean": verl_F.masked_mean(weights, mask),
            "is_truncated_frac": verl_F.masked_mean((raw > cap).to(mask.dtype), unit_mask),
            "is_weight_max": raw.max() if raw.numel() else raw.new_zeros(()),
        }
    return weights, metrics


def _check_kl_kind(kind: str) -> None:
    base = kind.removesuffix("+")
    if base == "full":
        raise ValueError("kl_penalty 'full' needs full-vocabulary logits and is not supported")
    if base not in KL_PENALTY_KINDS:
        raise ValueError(f"unknown kl_penalty {kind!r}; known: {', '.join(KL_PENALTY_KINDS)}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (verl's): kl = logp - ref; abs; mse = 0.5 (logp - ref)^2; low_var_kl = k3."""
    _check_kl_kind(kind)
    # verl annotates torch.FloatTensor (the legacy float32 type); it computes on any float tensor.
    return core_algos.kl_penalty(
        cast(torch.FloatTensor, logprob), cast(torch.FloatTensor, ref_logprob), kind
    )


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str,
    norm: LossNorm | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2)) (verl's clipped value loss)."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; known: {', '.join(LOSS_AGG_MODES)}"
        )
    norm = norm or LossNorm()
    loss, clipfrac = core_algos.compute_value_loss(
        vpreds=vpreds,
        returns=returns,
        values=values,
        response_mask=response_mask.to(vpreds.dtype),
        cliprange_value=cliprange_value,
        loss_agg_mode=loss_agg_mode,
        dp_size=norm.dp_size,
        batch_num_tokens=norm.batch_num_tokens,
        global_batch_size=norm.global_batch_size,
        loss_scale_factor=norm.loss_scale_factor,
    )
    return loss, {"vf_clipfrac": clipfrac.detach()}


def _float32_at_least(x: torch.Tensor) -> torch.Tensor:
    # bf16 has 8 mantissa bits: softmax sums over 100k+ vocab entries lose most of them.
    return x.to(torch.promote_types(x.dtype, torch.float32))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, as logsumexp - sum(softmax * logits), float32+."""
    return verl_F.entropy_from_logits(_float32_at_least(logits))


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels] over the last dim, computed in float32 even for bf16 logits.

    The float32 copy of [..., V] logits is materialised (and kept for backward): callers with long
    sequences feed this micro-batch by micro-batch.
    """
    logits = _float32_at_least(logits)
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
