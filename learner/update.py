"""The loss of one micro-batch for the actor and the critic, as a worker computes it.

Design: the objective is assembled from `learner.algorithms` (PPO clip with dual clip and truncated
importance weights, entropy bonus, KL loss, clipped value loss); every term is aggregated with the
mini-batch's global counts (`LossNorm`), so summing micro-batch losses over micro-batches and ranks
(FSDP averages gradients over ranks; `dp_size` undoes that) gives the loss of the whole mini-batch.
Metrics are returned as token-weighted sums for the trainer to reduce across ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from learner.algorithms import LossNorm, agg_loss, kl_penalty, ppo_policy_loss, value_loss
from learner.samples import MiniBatchPlan


def loss_norm(plan: MiniBatchPlan, world: int) -> LossNorm:
    return LossNorm(dp_size=world, batch_num_tokens=max(plan.num_tokens, 1),
                    global_batch_size=max(plan.num_seqs, 1), loss_scale_factor=max(plan.max_response_len, 1))


def actor_micro_loss(model: torch.nn.Module, b: dict[str, torch.Tensor], plan: MiniBatchPlan,
                     s: Any, world: int) -> tuple[torch.Tensor, dict[str, float]]:
    mask = b["response_mask"]
    need_entropy = True  # always reported; the bonus only enters the loss when entropy_coeff > 0
    logp, ent = model(b["input_ids"], b["attention_mask"], b["gather_idx"], b["labels"], need_entropy)
    norm = loss_norm(plan, world)
    pg_loss, m = ppo_policy_loss(
        b["old_logprobs"], logp, b["advantages"], mask,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high, clip_ratio_c=s.clip_ratio_c,
        loss_agg_mode=s.loss_agg_mode, norm=norm, is_weights=b.get("is_weights"),
    )
    loss = pg_loss
    ntok = float(mask.sum())
    out = {"pg_loss": float(pg_loss.detach()) / world, "tokens": ntok,
           "clipfrac_tok": float(m["clipfrac"]) * ntok, "clipfrac_lower_tok": float(m["clipfrac_lower"]) * ntok,
           "ppo_kl_tok": float(m["ppo_kl"]) * ntok}
    assert ent is not None
    out["entropy_tok"] = float((ent.detach() * mask).sum())
    if s.entropy_coeff > 0:
        loss = loss - s.entropy_coeff * agg_loss(ent, mask, s.loss_agg_mode, norm)
    if s.use_kl_loss:
        kl = kl_penalty(logp, b["ref_logprobs"], s.kl_loss_type)
        kl_loss = agg_loss(kl, mask, s.loss_agg_mode, norm)
        loss = loss + s.kl_loss_coef * kl_loss
        out["kl_loss"] = float(kl_loss.detach()) / world
    return loss, out


def critic_micro_loss(model: torch.nn.Module, b: dict[str, torch.Tensor], plan: MiniBatchPlan,
                      s: Any, world: int) -> tuple[torch.Tensor, dict[str, float]]:
    mask = b["response_mask"]
    vpreds = model(b["input_ids"], b["attention_mask"], b["gather_idx"])
    loss, m = value_loss(vpreds, b["returns"], b["values"], mask, cliprange_value=s.cliprange_value,
                         loss_agg_mode=s.loss_agg_mode, norm=loss_norm(plan, world))
    ntok = float(mask.sum())
    return loss, {"value_loss": float(loss.detach()) / world, "tokens": ntok,
                  "vf_clipfrac_tok": float(m["vf_clipfrac"]) * ntok,
                  "vpred_tok": float((vpreds.detach() * mask).sum())}
