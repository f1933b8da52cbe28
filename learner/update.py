"""The loss of one micro-batch for the actor and the critic, as a worker computes it.

Design: the objective is assembled from `learner.algorithms` (verl's policy loss of
``actor.policy_loss.loss_mode``, PPO clip with dual clip by default, with truncated importance
weights; entropy bonus, KL loss, clipped value loss); every term is aggregated with the
mini-batch's global counts (`LossNorm`), so summing micro-batch losses over micro-batches and ranks
(FSDP averages gradients over ranks; `dp_size` undoes that) gives the loss of the whole mini-batch.
Metrics are returned as sums for the trainer to reduce across ranks (`learner.prepare.
reduce_worker_metrics`): ``*_tok`` token-weighted, ``*_seq`` sequence-weighted, ``*_max`` maxima;
a key with a ``/`` keeps its own section (``off_policy/...``, ``rollout/...``).

With `OldFromForward` the first mini-batch's old logprobs are this forward's own, detached: the PPO
ratio is exactly 1 and the gradient the same as with old logprobs from a separate forward of the
same weights; later mini-batches bring theirs, and every mini-batch's importance weights are
computed here.
"""

from __future__ import annotations

import torch

from learner.algorithms import (
    LossNorm,
    agg_loss,
    kl_penalty,
    policy_loss,
    truncated_is_weights,
    value_loss,
    verl_actor_config,
)
from learner.model import MicroBatch, policy_outputs, value_outputs
from learner.samples import MiniBatchPlan, OldFromForward
from learner.worker_settings import WorkerSettings


def loss_norm(plan: MiniBatchPlan, world: int) -> LossNorm:
    return LossNorm(
        dp_size=world,
        batch_num_tokens=max(plan.num_tokens, 1),
        global_batch_size=max(plan.num_seqs, 1),
        loss_scale_factor=max(plan.max_response_len, 1),
    )


def off_policy_terms(
    old: torch.Tensor, b: MicroBatch, spec: OldFromForward
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Importance weights and the old-vs-rollout metrics of one micro-batch, as the trainer computes
    them for the whole batch before the update when old logprobs come from a separate forward."""
    mask, rollout = b.response_mask, b.fields["rollout_logprobs"]
    out = {"rollout/logprob_diff_tok": float(((old - rollout).abs() * mask).sum())}
    if spec.is_level == "off":
        return None, out
    w, m = truncated_is_weights(old, rollout, mask, cap=spec.is_cap, level=spec.is_level)  # type: ignore[arg-type]
    out["off_policy/is_weight_mean_tok"] = float((w * mask).sum())
    out["off_policy/is_weight_max_max"] = float(m["is_weight_max"])
    if spec.is_level == "token":
        out["off_policy/is_truncated_frac_tok"] = float(m["is_truncated_frac"]) * float(mask.sum())
    else:
        out["off_policy/is_truncated_frac_seq"] = float(m["is_truncated_frac"]) * float(
            (mask.sum(-1) > 0).sum()
        )
    return w, out


def actor_micro_loss(
    model: torch.nn.Module,
    b: MicroBatch,
    plan: MiniBatchPlan,
    s: WorkerSettings,
    world: int,
    old_from_forward: OldFromForward | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = b.response_mask
    # entropy is always reported; the bonus only enters the loss when entropy_coeff > 0
    logp, ent = policy_outputs(model, b, with_entropy=True)
    assert ent is not None
    norm = loss_norm(plan, world)
    out: dict[str, float] = {}
    if old_from_forward is None:
        old, is_weights = b.fields["old_logprobs"], b.fields.get("is_weights")
    else:
        old = logp.detach() if old_from_forward.from_own_forward else b.fields["old_logprobs"]
        is_weights, out = off_policy_terms(old, b, old_from_forward)
    config = verl_actor_config(
        s.policy_loss,
        clip_ratio_low=s.clip_ratio_low,
        clip_ratio_high=s.clip_ratio_high,
        clip_ratio_c=s.clip_ratio_c,
        loss_agg_mode=s.loss_agg_mode,
    )
    pg_loss, m = policy_loss(
        old, logp, b.fields["advantages"], mask, config=config, norm=norm, is_weights=is_weights
    )
    loss = pg_loss
    ntok = float(mask.sum())
    out |= {
        "pg_loss": float(pg_loss.detach()) / world,
        "tokens": ntok,
        "seqs": float((mask.sum(-1) > 0).sum()),
        "clipfrac_tok": m["clipfrac"] * ntok,
        "clipfrac_lower_tok": m["clipfrac_lower"] * ntok,
        "ppo_kl_tok": m["ppo_kl"] * ntok,
        "entropy_tok": float((ent.detach() * mask).sum()),
    }
    # bypass mode: verl's rollout_corr/* of each micro-batch (against the current policy, as verl's
    # actor reports them), token-weighted over the step's micro-batches
    out |= {f"{k}_tok": v * ntok for k, v in m.items() if k.startswith("rollout_corr/")}
    if s.entropy_coeff > 0:
        loss = loss - s.entropy_coeff * agg_loss(ent, mask, s.loss_agg_mode, norm)
    if s.use_kl_loss:
        kl = kl_penalty(logp, b.fields["ref_logprobs"], s.kl_loss_type)
        kl_loss = agg_loss(kl, mask, s.loss_agg_mode, norm)
        loss = loss + s.kl_loss_coef * kl_loss
        out["kl_loss"] = float(kl_loss.detach()) / world
    return loss, out


def critic_micro_loss(
    model: torch.nn.Module,
    b: MicroBatch,
    plan: MiniBatchPlan,
    s: WorkerSettings,
    world: int,
    old_from_forward: OldFromForward | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    del old_from_forward  # the critic's old values always come from its own forward pass
    mask = b.response_mask
    vpreds = value_outputs(model, b)
    loss, m = value_loss(
        vpreds,
        b.fields["returns"],
        b.fields["values"],
        mask,
        cliprange_value=s.cliprange_value,
        loss_agg_mode=s.loss_agg_mode,
        norm=loss_norm(plan, world),
    )
    ntok = float(mask.sum())
    return loss, {
        "value_loss": float(loss.detach()) / world,
        "tokens": ntok,
        "vf_clipfrac_tok": float(m["vf_clipfrac"]) * ntok,
        "vpred_tok": float((vpreds.detach() * mask).sum()),
    }
