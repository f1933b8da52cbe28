"""From received trajectories to what the workers train on: samples, rewards, advantages, metrics.

Design: pure functions over numpy/torch on the trainer process, so every transformation between the
wire and the loss can be unit-tested without workers. Per-token quantities live in padded
[trajectories, longest response] tensors while advantages are computed (verl's layout, so the
estimators are verl's), then are cut back to each sample's own length. The episode's reward is put
on its last trained token (the last token with mask 1), where verl puts the score.

The step's plan also starts here: how passes cut micro-batches (`batching`), whether the update
takes the first mini-batch's old logprobs from its own forward (`old_logprobs_from_update`, the rule
is its docstring) and so which samples the separate old-logprob forward still runs
(`old_logprob_parts`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.config.root import Config
from learner.algorithms import (
    KLController,
    apply_kl_in_reward,
    compute_advantages,
    truncated_is_weights,
)
from learner.algorithms.rollout_correction import rollout_correction
from learner.reward_shaping import overlong_penalties, shaping_metrics
from learner.samples import Batching, OldFromForward, Sample, TokenField, even_chunks
from learner.worker_api import UpdateResult
from protocol.trajectory import Trajectory

REMAX_BASELINE = (
    "remax_baseline"  # reward_extras key set by the rollout side (rollout_service.groups)
)


def to_samples(trajs: Sequence[Trajectory]) -> list[Sample]:
    out = []
    for t in trajs:
        ids = np.concatenate(
            [np.asarray(t.prompt_ids, np.int64), np.asarray(t.response_ids, np.int64)]
        )
        out.append(
            Sample(
                ids,
                len(t.prompt_ids),
                np.asarray(t.response_mask, np.float32),
                rollout_logprobs=np.asarray(t.rollout_logprobs, np.float32),
            )
        )
    return out


def mini_batch_count(config: Config) -> int:
    """Optimizer steps per epoch: data.train_batch_size * rollout.n / actor.ppo_mini_batch_size."""
    arr = config.actor_rollout_ref
    return max(1, config.data.train_batch_size * arr.rollout.n // arr.actor.ppo_mini_batch_size)


def batching(
    config: Config,
    micro_size: int | None = None,
    *,
    can_pack: bool = True,
    can_share: bool = True,
) -> Batching:
    """How a learner pass cuts micro-batches: the actor's token cap with use_dynamic_bsz, else
    ``micro_size`` samples (default actor.ppo_micro_batch_size_per_gpu); packed with
    model.use_remove_padding when the workers ``can_pack`` (`learner.workers.WorkerGroup.can_pack`:
    a varlen attention kernel on their GPU, or CPU workers), sharing their prefix with
    model.share_prefix where they ``can_share`` (`WorkerGroup.can_share_prefix`: the token cap
    counts a shared prefix once, so it must be shared)."""
    arr = config.actor_rollout_ref
    actor = arr.actor
    return Batching(
        micro_size=micro_size or actor.ppo_micro_batch_size_per_gpu,
        max_tokens=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else 0,
        packed=arr.model.use_remove_padding and can_pack,
        share_prefix=arr.model.use_remove_padding
        and can_pack
        and can_share
        and arr.model.share_prefix,
    )


def old_logprobs_from_update(config: Config, step: int) -> OldFromForward | None:
    """Whether this step's actor update takes the first mini-batch's old logprobs from its own
    forward (returned: what the workers need for it) instead of from a separate forward of every
    sample before it (None).

    The rule: actor.off_policy.old_logprobs is recompute, skip_old_logprob_forward is auto, the
    actor is updated this step (past trainer.critic_warmup), one PPO epoch. Then the first
    mini-batch's forward runs on the weights the separate pass would have used, so its logprobs,
    detached, are the old logprobs: the ratio is 1 and the gradient unchanged. The later
    mini-batches run after an optimizer step, so their old logprobs still come from a forward
    before the update, over their samples only, cut into the micro-batches the update will run
    (`old_logprob_parts`). The importance weights old/rollout and rollout/logprob_diff only need
    old and rollout logprobs of the same token, so the workers compute them in the update, for every
    mini-batch. algorithm.use_kl_in_reward is the exception: the reward, and so the advantages,
    need the old logprobs before the update starts, so a step with it keeps the separate forward.

    "The same numbers" needs the update's forward to compute what the forward-only pass computes:
    that pass runs in eval() under no_grad, the update in train(); FSDP's bf16 cast, gradient
    checkpointing (a recompute of the same function) and the micro-batch layout are the same in
    both, and the Qwen2-family models have no dropout (attention_dropout 0). A model that drops out
    in training would see another function: set skip_old_logprob_forward to never for it.
    algorithm.rollout_correction keeps the separate forward too: verl's weights, rejection and
    metrics are of the whole batch (batch normalisation, rejection before the advantages)."""
    actor, alg = config.actor_rollout_ref.actor, config.algorithm
    off = actor.off_policy
    if (
        off.old_logprobs != "recompute"
        or off.skip_old_logprob_forward == "never"
        or alg.use_kl_in_reward
        or alg.rollout_correction.active
        or step < config.trainer.critic_warmup
        or actor.ppo_epochs != 1
    ):
        return None
    return OldFromForward(is_level=off.is_level, is_cap=off.is_cap)


def old_logprob_parts(config: Config, samples: int) -> list[list[int]]:
    """With old logprobs from the update (`old_logprobs_from_update`): the sample indices the
    forward before the update still runs, one part per mini-batch after the first, each as the
    update's `learner.samples.split_for_ranks` takes it (`even_chunks`). A part cut on its own
    (`learner.samples.split_forward`) gets the micro-batches the update runs it in, so its old
    logprobs are those the update's forward of the same weights would give."""
    return even_chunks(range(samples), mini_batch_count(config))[1:]


def pad(rows: Sequence[np.ndarray], width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.zeros((len(rows), max(width, 1)), dtype=dtype)
    for i, r in enumerate(rows):
        # wire arrays are read-only
        out[i, : len(r)] = torch.from_numpy(np.array(r, copy=True)).to(dtype)
    return out


def response_tensors(samples: Sequence[Sample], key: TokenField | None = None) -> torch.Tensor:
    """[N, R] padded response mask (key None) or per-token field ``key``."""
    width = max((s.response_len for s in samples), default=1)
    rows = [s.response_mask if key is None else s.get(key) for s in samples]
    return pad(rows, width)


def set_tokens(samples: Sequence[Sample], key: TokenField, padded: torch.Tensor) -> None:
    arr = padded.detach().float().cpu().numpy()
    for i, s in enumerate(samples):
        s.set(key, np.ascontiguousarray(arr[i, : s.response_len], dtype=np.float32))


def token_level_scores(
    trajs: Sequence[Trajectory], mask: torch.Tensor, shaping: np.ndarray | None = None
) -> torch.Tensor:
    """Each episode's reward (plus its ``shaping``, e.g. the over-long penalty) on its last trained
    token."""
    scores = torch.zeros_like(mask)
    for i, t in enumerate(trajs):
        trained = torch.nonzero(mask[i]).flatten()
        if len(trained):  # an episode without a trained token carries no reward anywhere
            extra = float(shaping[i]) if shaping is not None else 0.0
            scores[i, int(trained[-1])] = float(t.reward) + extra
    return scores


def remax_baselines(trajs: Sequence[Trajectory]) -> torch.Tensor:
    missing = [t.trajectory_id for t in trajs if REMAX_BASELINE not in t.reward_extras]
    if missing:
        raise ValueError(
            f"algorithm.adv_estimator=remax needs the greedy baseline reward_extras[{REMAX_BASELINE!r}] "
            f"on every trajectory; {len(missing)} lack it (e.g. {missing[0]}): are the rollout servers "
            "running with the same algorithm.adv_estimator?"
        )
    return torch.tensor([float(t.reward_extras[REMAX_BASELINE]) for t in trajs])


def rewards_and_advantages(
    config: Config,
    trajs: Sequence[Trajectory],
    samples: Sequence[Sample],
    kl_ctrl: KLController,
    *,
    in_update: bool,
    critic: bool,
) -> dict[str, float]:
    """After the step's forwards: token-level rewards (KL in the reward when configured, which
    updates ``kl_ctrl``), advantages and returns, and truncated importance weights, set on
    ``samples``; returns the step's ``kl_in_reward/*``, ``off_policy/*``, ``advantages/mean``,
    ``rollout/logprob_diff`` and, with over-long shaping, ``reward/overlong_*`` and
    ``reward/shaped_mean`` (`learner.reward_shaping`). ``in_update``: the update takes the old
    logprobs from its own forward (``old_logprobs_from_update``), so none are here; ``critic``:
    ``samples`` carry values."""
    cfg, alg = config.actor_rollout_ref.actor, config.algorithm
    metrics: dict[str, float] = {}
    mask = response_tensors(samples)
    old = None if in_update else response_tensors(samples, "old_logprobs")
    penalties = overlong_penalties(
        [len(t.response_ids) for t in trajs], config.reward, config.data.max_response_length
    )
    metrics |= shaping_metrics([t.reward for t in trajs], penalties)
    rewards = token_level_scores(trajs, mask, penalties)
    if alg.use_kl_in_reward:
        assert old is not None  # the rule keeps the separate forward with KL in the reward
        rewards, km = apply_kl_in_reward(
            rewards,
            old,
            response_tensors(samples, "ref_logprobs"),
            mask,
            controller=kl_ctrl,
            kl_penalty_kind=alg.kl_penalty,
        )
        kl_ctrl.update(float(km["kl"]), n_steps=len(samples))
        metrics |= {f"kl_in_reward/{k}": float(v) for k, v in km.items()}
    corr = alg.rollout_correction
    corr_weights = None
    # in bypass mode old is the rollout's: nothing to compare here (verl's bypass loss reports it);
    # rollout_correction keeps the separate forward, so old is here (old_logprobs_from_update)
    if corr.active and old is not None and cfg.off_policy.old_logprobs == "recompute":
        # verl's order: weights and rejection after the rewards, before the advantages; a
        # rejected token leaves the mask of the advantages and of the loss
        rollout = response_tensors(samples, "rollout_logprobs")
        corr_weights, new_mask, cm = rollout_correction(old, rollout, mask, corr)
        metrics |= cm
        if not torch.equal(new_mask, mask):
            mask = new_mask
            for i, s in enumerate(samples):
                s.response_mask = np.ascontiguousarray(
                    mask[i, : s.response_len].numpy(), dtype=np.float32
                )
    kwargs: dict[str, Any] = {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": np.array([t.group_uid for t in trajs], dtype=object),
        "gamma": alg.gamma,
        "lam": alg.lam,
        "norm_adv_by_std_in_grpo": alg.norm_adv_by_std_in_grpo,
    }
    if critic:
        kwargs["values"] = response_tensors(samples, "values")
    if alg.adv_estimator == "remax":
        kwargs["reward_baselines"] = remax_baselines(trajs)
    adv, returns = compute_advantages(alg.adv_estimator, **kwargs)
    set_tokens(samples, "advantages", adv)
    set_tokens(samples, "returns", returns)
    if corr_weights is not None:
        set_tokens(samples, "is_weights", corr_weights)
    elif (
        old is not None
        and not corr.active
        and cfg.off_policy.old_logprobs == "recompute"
        and cfg.off_policy.is_level != "off"
    ):
        w, wm = truncated_is_weights(
            old,
            response_tensors(samples, "rollout_logprobs"),
            mask,
            cap=cfg.off_policy.is_cap,
            level=cfg.off_policy.is_level,
        )
        set_tokens(samples, "is_weights", w)
        metrics |= {f"off_policy/{k}": float(v) for k, v in wm.items()}
    m = mask.bool()
    metrics["advantages/mean"] = float(adv[m].mean()) if m.any() else 0.0
    if old is not None:
        metrics["rollout/logprob_diff"] = (
            float((old - response_tensors(samples, "rollout_logprobs"))[m].abs().mean())
            if m.any()
            else 0.0
        )
    return metrics


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, np.float64)
    if not len(a):
        return {}
    return {
        f"{prefix}/mean": float(a.mean()),
        f"{prefix}/std": float(a.std()),
        f"{prefix}/min": float(a.min()),
        f"{prefix}/max": float(a.max()),
    }


def batch_metrics(
    trajs: Sequence[Trajectory], staleness: Sequence[int], version: int
) -> dict[str, float]:
    """Reward, lengths, turns and terminations of a batch, overall and per data source (keys end
    in ``/{source}``: ``reward/mean/math``, ``batch/count/math``...), and its staleness."""
    out: dict[str, float] = _stats("reward", [t.reward for t in trajs])
    by_source: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_source[t.data_source or "unknown"].append(t)
    if len(by_source) > 1 or "unknown" not in by_source:
        for src, ts in sorted(by_source.items()):
            out[f"reward/mean/{src}"] = float(np.mean([t.reward for t in ts]))
            out[f"batch/count/{src}"] = float(len(ts))
            out[f"response/length_mean/{src}"] = float(np.mean([len(t.response_ids) for t in ts]))
            out[f"episode/turns_mean/{src}"] = float(np.mean([t.num_turns for t in ts]))
            for term in sorted({t.termination for t in ts}):
                out[f"episode/termination/{term}/{src}"] = sum(
                    t.termination == term for t in ts
                ) / len(ts)
    out |= {
        k.replace("response/", "response/length_"): v
        for k, v in _stats("response", [len(t.response_ids) for t in trajs]).items()
    }
    out["response/trained_tokens_mean"] = float(
        np.mean([int(np.sum(t.response_mask)) for t in trajs])
    )
    out["episode/turns_mean"] = float(np.mean([t.num_turns for t in trajs]))
    out["episode/turns_max"] = float(np.max([t.num_turns for t in trajs]))
    for term in sorted({t.termination for t in trajs}):
        out[f"episode/termination/{term}"] = sum(t.termination == term for t in trajs) / len(trajs)
    out["batch/trajectories"] = float(len(trajs))
    out["batch/snapshots"] = float(sum(t.is_snapshot for t in trajs))
    if staleness:
        st = np.asarray(staleness)
        out |= {
            "staleness/mean": float(st.mean()),
            "staleness/max": float(st.max()),
            "staleness/min": float(st.min()),
        }
        for k in sorted(set(st.tolist())):
            out[f"staleness/frac_{k}"] = float((st == k).mean())
    return out


def reduce_worker_metrics(per_rank: Sequence[UpdateResult], prefix: str) -> dict[str, float]:
    """Sums over ranks -> means: token-weighted (``*_tok``), sequence-weighted (``*_seq``), maxima
    (``*_max``), per optimizer step (losses, grad norm); ``row_tokens`` and ``shared_tokens``
    (`learner.model.layout_counts`) become ``shared_prefix_frac``. Keys are put under ``prefix/``, except
    those that name their own section (``off_policy/is_weight_mean_tok``)."""
    total: defaultdict[str, float] = defaultdict(float)
    for r in per_rank:
        for k, v in r.sums.items():
            total[k] = max(total.get(k, v), v) if k.endswith("_max") else total[k] + v
    tokens = max(total.pop("tokens", 0.0), 1.0)
    seqs = max(total.pop("seqs", 0.0), 1.0)
    rows, shared = total.pop("row_tokens", 0.0), total.pop("shared_tokens", 0.0)
    first = per_rank[0]  # every rank takes the same optimizer steps with the same schedule
    steps = float(max(first.optimizer_steps, 1))
    out: dict[str, float] = {}
    for k, v in total.items():
        name = k if "/" in k else f"{prefix}/{k}"
        if k.endswith("_tok"):
            out[name[:-4]] = v / tokens
        elif k.endswith("_seq"):
            out[name[:-4]] = v / seqs
        elif k.endswith("_max"):
            out[name[:-4]] = v
        else:  # losses: each rank's sum over micro-batches is its share of the mini-batch loss
            out[f"{prefix}/{k}"] = v / steps
    if rows > 0:  # the share of the sequences' tokens a shared prefix ran once for all of them
        out[f"{prefix}/shared_prefix_frac"] = shared / (rows + shared)
    out[f"{prefix}/grad_norm"] = sum(r.grad_norm_sum for r in per_rank) / len(per_rank) / steps
    out[f"{prefix}/lr"] = first.lr
    out[f"{prefix}/optimizer_steps"] = float(first.optimizer_steps)
    out[f"{prefix}/skipped_steps"] = float(first.skipped_steps)
    return out
