"""Losses, aggregation, importance weights, KL: small cases computed by hand (the arithmetic is in
the comments), global normalisation across simulated ranks and micro-batches, and parity with
verl where we wrote our own."""

from __future__ import annotations

import math

import pytest
import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.workers.config import ActorConfig

from common.registry import UnknownEntry
from learner.algorithms import (
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    LossNorm,
    agg_loss,
    apply_kl_in_reward,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    make_kl_controller,
    ppo_policy_loss,
    truncated_is_weights,
    value_loss,
)

CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}


def _close(actual: torch.Tensor | float, expected: float, atol: float = 1e-6) -> None:
    value = float(actual.detach()) if isinstance(actual, torch.Tensor) else float(actual)
    assert value == pytest.approx(expected, abs=atol)


# ----------------------------------------------------------------------------- PPO policy loss


def test_ppo_clip_both_sides_and_dual_clip() -> None:
    # old = 0, so ratio = exp(log_prob). clip range [0.8, 1.28]; c = 3.
    # row 0, A = +1, ratio [1.5, 0.5, 1.1]: L1 = -r = [-1.5, -0.5, -1.1], L2 = -clip(r) =
    #   [-1.28, -0.8, -1.1]; max -> [-1.28 (clipped above), -0.5 (no clip below for A>0), -1.1].
    # row 1, A = -1, ratio [0.5, 1.5, 5.0]: L1 = [0.5, 1.5, 5.0], L2 = [0.8, 1.28, 1.28];
    #   max -> [0.8 (clipped below), 1.5, 5.0]; dual clip min(., -A*c = 3) -> [0.8, 1.5, 3.0].
    # token-mean = (-1.28 - 0.5 - 1.1 + 0.8 + 1.5 + 3.0) / 6 = 2.42 / 6.
    # clipfrac (L2 > L1) = 2/6 (row0 tok0, row1 tok0); clipfrac_lower = 1/6 (row1 tok2).
    ratios = torch.tensor([[1.5, 0.5, 1.1], [0.5, 1.5, 5.0]])
    log_prob = ratios.log().requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, m = ppo_policy_loss(
        torch.zeros(2, 3), log_prob, adv, torch.ones(2, 3), **CLIP, loss_agg_mode="token-mean"
    )
    _close(loss, 2.42 / 6)
    _close(m["clipfrac"], 2 / 6)
    _close(m["clipfrac_lower"], 1 / 6)
    _close(m["ppo_kl"], -sum(math.log(r) for r in [1.5, 0.5, 1.1, 0.5, 1.5, 5.0]) / 6)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    loss.backward()
    assert log_prob.grad is not None
    # clipped tokens (row0 tok0, row1 tok0) and the dual-clipped one (row1 tok2) pass no gradient;
    # the others get d(-A * r)/d logp / 6 = -A * r / 6.
    expected = torch.tensor([[0.0, -0.5, -1.1], [0.0, 1.5, 0.0]]) / 6
    torch.testing.assert_close(log_prob.grad, expected)


def test_dual_clip_caps_a_negative_advantage() -> None:
    # A = -2: ratio 4 -> L1 = 8, L2 = 2 * 1.28 = 2.56, max 8, dual bound 2 * 3 = 6 -> 6.
    #         ratio 2 -> L1 = 4 < 6 -> 4.  token-mean (1x2) = 5; clipfrac_lower = 1/2.
    log_prob = torch.tensor([[math.log(4.0), math.log(2.0)]])
    loss, m = ppo_policy_loss(
        torch.zeros(1, 2),
        log_prob,
        torch.full((1, 2), -2.0),
        torch.ones(1, 2),
        **CLIP,
        loss_agg_mode="token-mean",
    )
    _close(loss, 5.0, atol=1e-5)
    _close(m["clipfrac_lower"], 0.5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(
            torch.zeros(1, 2),
            log_prob,
            torch.ones(1, 2),
            torch.ones(1, 2),
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            clip_ratio_c=1.0,
            loss_agg_mode="token-mean",
        )


def _random_policy_batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    mask = (torch.rand(b, t, generator=gen) > 0.25).float()
    mask[2] = 0.0  # a fully masked sequence: excluded from the seq-mean denominators
    old = -torch.rand(b, t, generator=gen) * 3
    return {
        "old_log_prob": old,
        "log_prob": old + 0.4 * torch.randn(b, t, generator=gen),
        "advantages": torch.randn(b, t, generator=gen),
        "response_mask": mask,
        "is_weights": torch.rand(b, t, generator=gen) * 2,
    }


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("with_norm", [False, True])
def test_ppo_policy_loss_matches_verl_vanilla(mode: str, with_norm: bool) -> None:
    batch = _random_policy_batch(LOSS_AGG_MODES.index(mode))
    norm = (
        LossNorm(dp_size=2, batch_num_tokens=61, global_batch_size=11, loss_scale_factor=16)
        if with_norm
        else None
    )
    config = ActorConfig(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, clip_ratio=0.2, **CLIP
    )
    if norm is not None:
        config.global_batch_info.update(
            dp_size=2, batch_num_tokens=61, global_batch_size=11, loss_scale_factor=16
        )
    ours, m = ppo_policy_loss(
        batch["old_log_prob"],
        batch["log_prob"],
        batch["advantages"],
        batch["response_mask"],
        **CLIP,
        loss_agg_mode=mode,
        norm=norm,
        is_weights=batch["is_weights"],
    )
    ref, ref_m = core_algos.compute_policy_loss_vanilla(
        batch["old_log_prob"],
        batch["log_prob"],
        batch["advantages"],
        batch["response_mask"],
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=batch["is_weights"],
    )
    _close(ours, float(ref))
    _close(m["clipfrac"], ref_m["actor/pg_clipfrac"])
    _close(m["clipfrac_lower"], ref_m["actor/pg_clipfrac_lower"])
    _close(m["ppo_kl"], ref_m["actor/ppo_kl"])


# ----------------------------------------------------------------------------- aggregation

LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 valid tokens
        ("token-sum", 7.0),  # 1 + 2 + 4
        ("seq-mean-token-sum", 3.5),  # sequence sums [3, 4] -> mean 3.5
        ("seq-mean-token-mean", 2.75),  # sequence means [1.5, 4] -> mean 2.75
        ("seq-mean-token-sum-norm", 3.5 / 3),  # seq-mean-token-sum / padded length 3
    ],
)
def test_agg_modes_by_hand(mode: str, expected: float) -> None:
    _close(agg_loss(LOSS_MAT, MASK, mode), expected)


def test_agg_edge_cases_by_hand() -> None:
    # a constant divisor instead of the padded length: 3.5 / 7 = 0.5
    _close(agg_loss(LOSS_MAT, MASK, "seq-mean-token-sum-norm", LossNorm(loss_scale_factor=7)), 0.5)
    # a fully masked sequence does not count: only [1, 2] -> sum 3 over 1 sequence
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    _close(agg_loss(LOSS_MAT, mask, "seq-mean-token-sum"), 3.0)
    _close(agg_loss(LOSS_MAT, mask.bool(), "seq-mean-token-mean"), 1.5)
    # global counts: token-mean over 14 tokens on 2 ranks -> 7 / 14 * 2 = 1
    _close(agg_loss(LOSS_MAT, MASK, "token-mean", LossNorm(dp_size=2, batch_num_tokens=14)), 1.0)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token_mean'"):
        agg_loss(LOSS_MAT, MASK, "token_mean")


def _micro_batches(mask: torch.Tensor, rows: range) -> tuple[slice, int]:
    # each micro-batch is padded to its own longest response, as a packing collator would do
    width = int(mask[rows.start : rows.stop].nonzero()[:, 1].max()) + 1
    return slice(rows.start, rows.stop), width


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_global_normalisation_over_ranks_and_micro_batches(mode: str) -> None:
    # 8 sequences = 2 ranks x 2 micro-batches x 2 sequences. Each part is normalised with the
    # mini-batch's global counts and dp_size = 2; backward sums micro-batches on a rank and FSDP
    # averages over ranks, so (sum of part gradients) / dp_size must equal the full-batch gradient.
    gen = torch.Generator().manual_seed(7)
    b, t, dp = 8, 10, 2
    lengths = [3, 10, 6, 2, 9, 4, 7, 5]
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in lengths])
    mask[1, 4:6] = 0.0  # tool tokens
    feat = torch.randn(b, t, generator=gen)
    theta = torch.randn(t, generator=gen, requires_grad=True)

    full = agg_loss(theta * feat, mask, mode, LossNorm(loss_scale_factor=t))
    (full_grad,) = torch.autograd.grad(full, theta)

    norm = LossNorm.from_mask(mask, dp_size=dp, loss_scale_factor=t)
    assert (norm.batch_num_tokens, norm.global_batch_size) == (int(mask.sum()), 8)
    rank_grads, total = [], torch.zeros(())
    for rank in range(dp):
        grad = torch.zeros(t)
        for micro in range(2):
            rows, width = _micro_batches(
                mask, range(4 * rank + 2 * micro, 4 * rank + 2 * micro + 2)
            )
            part = agg_loss(theta[:width] * feat[rows, :width], mask[rows, :width], mode, norm)
            total = total + part.detach()
            grad[:width] += torch.autograd.grad(part, theta)[0][:width]  # gradient accumulation
        rank_grads.append(grad)
    fsdp_grad = torch.stack(rank_grads).mean(0)  # FSDP's all-reduce averages over ranks
    torch.testing.assert_close(fsdp_grad, full_grad, atol=1e-6, rtol=1e-6)
    _close(total / dp, float(full.detach()), atol=1e-5)


# ----------------------------------------------------------------------------- importance weights


def _is_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # ratio = exp(old - rollout) = [[2, 0.5, 4], [1.5, 1, (masked)]]
    old = torch.zeros(2, 3, requires_grad=True)
    rollout = torch.tensor([[-math.log(2), math.log(2), -math.log(4)], [-math.log(1.5), 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return old, rollout, mask


def test_token_level_truncated_is_weights_by_hand() -> None:
    # cap 2.5: [[2, 0.5, 2.5], [1.5, 1, 0]]; mean over 5 tokens = 7.5 / 5 = 1.5;
    # truncated: 1 of 5 tokens; largest raw weight 4.
    old, rollout, mask = _is_case()
    w, m = truncated_is_weights(old, rollout, mask, cap=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.5], [1.5, 1.0, 0.0]]))
    assert not w.requires_grad
    _close(m["is_weight_mean"], 1.5)
    _close(m["is_truncated_frac"], 0.2)
    _close(m["is_weight_max"], 4.0, atol=1e-5)


def test_sequence_level_truncated_is_weights_by_hand() -> None:
    # row 0: exp(ln2 - ln2 + ln4) = 4 -> cap 2.5; row 1: exp(ln1.5 + 0) = 1.5 (masked token ignored).
    # mean over tokens = (3 * 2.5 + 2 * 1.5) / 5 = 2.1; truncated: 1 of 2 sequences; raw max 4.
    old, rollout, mask = _is_case()
    w, m = truncated_is_weights(old, rollout, mask, cap=2.5, level="sequence")
    torch.testing.assert_close(w, torch.tensor([[2.5, 2.5, 2.5], [1.5, 1.5, 0.0]]))
    _close(m["is_weight_mean"], 2.1)
    _close(m["is_truncated_frac"], 0.5)
    _close(m["is_weight_max"], 4.0, atol=1e-5)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, rollout, mask, cap=0.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_match_verl(level: str) -> None:
    gen = torch.Generator().manual_seed(11)
    old = -torch.rand(6, 9, generator=gen) * 3
    rollout = old + 0.3 * torch.randn(6, 9, generator=gen)
    mask = (torch.rand(6, 9, generator=gen) > 0.3).float()
    ours, _ = truncated_is_weights(old, rollout, mask, cap=1.5, level=level)  # type: ignore[arg-type]
    ref, _ = compute_rollout_correction_weights(
        old - rollout, mask, rollout_is=level, rollout_is_threshold=1.5
    )
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- KL, value, entropy


def test_kl_penalty_kinds_by_hand() -> None:
    # logp - ref = [[1, -1, 0], [25, -25, 0]]
    logp = torch.tensor([[-1.0, -2.0, -0.5], [0.0, -25.0, -3.0]])
    ref = torch.tensor([[-2.0, -1.0, -0.5], [-25.0, 0.0, -3.0]])
    torch.testing.assert_close(
        kl_penalty(logp, ref, "kl"), torch.tensor([[1.0, -1.0, 0.0], [25.0, -25.0, 0.0]])
    )
    torch.testing.assert_close(
        kl_penalty(logp, ref, "abs"), torch.tensor([[1.0, 1.0, 0.0], [25.0, 25.0, 0.0]])
    )
    torch.testing.assert_close(
        kl_penalty(logp, ref, "mse"), torch.tensor([[0.5, 0.5, 0.0], [312.5, 312.5, 0.0]])
    )
    # k3 with d = ref - logp = [-1, 1, 0]: exp(d) - d - 1 = [e^-1, e - 2, 0]; row 1: d = -25 is
    # clamped to -20: e^-20 + 19 = 19 -> clamped to 10; d = 25 -> 20: e^20 - 21 -> clamped to 10.
    expected = torch.tensor([[math.exp(-1), math.e - 2, 0.0], [10.0, 10.0, 0.0]])
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), expected)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), expected)
    with pytest.raises(ValueError, match="full-vocabulary"):
        kl_penalty(logp, ref, "full")
    with pytest.raises(ValueError, match="unknown kl_penalty 'k4'"):
        kl_penalty(logp, ref, "k4")


def test_value_loss_clipping_by_hand() -> None:
    # cliprange 0.2. row 0: v = [1, 2, 0.1], v_old = [0.5, 1.9, 0], R = [2, 0, 0]:
    #   clip(v) = [0.7, 2.0, 0.1]; (v-R)^2 = [1, 4, 0.01]; (clip-R)^2 = [1.69, 4, 0.01] -> max
    #   [1.69, 4, 0.01]. row 1: v = 0, v_old = [1, 0, 0], R = [0, 0, 5]: clip = [0.8, 0, 0];
    #   (v-R)^2 = [0, 0, 25], (clip-R)^2 = [0.64, 0, 25] -> [0.64, 0, (masked)].
    # loss = 0.5 * (1.69 + 4 + 0.01 + 0.64 + 0) / 5 = 0.634; clipped (clip > plain) 2 of 5.
    vpreds = torch.tensor([[1.0, 2.0, 0.1], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 1.9, 0.0], [1.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, m = value_loss(
        vpreds, returns, values, mask, cliprange_value=0.2, loss_agg_mode="token-mean"
    )
    _close(loss, 0.634)
    _close(m["vf_clipfrac"], 0.4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_and_logprobs_against_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 3, 50, generator=gen) * 4).to(dtype)
    reference = torch.distributions.Categorical(logits=logits.float())
    ent = entropy_from_logits(logits)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(ent, reference.entropy(), atol=1e-5, rtol=1e-5)
    labels = torch.randint(0, 50, (2, 3), generator=gen)
    lp = logprobs_from_logits(logits, labels)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, reference.log_prob(labels), atol=1e-5, rtol=1e-5)
    huge = torch.tensor([[1e4, 0.0, -1e4]])  # naive softmax * log would overflow / give nan
    assert torch.isfinite(entropy_from_logits(huge)).all()
    _close(logprobs_from_logits(huge, torch.tensor([0])), 0.0)


# ----------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_follows_the_formula() -> None:
    # beta = 0.1, target 0.05, horizon 100, n_steps 10:
    # kl 0.06: e = clip(0.06/0.05 - 1, +-0.2) = 0.2 -> beta *= 1 + 0.2*10/100 = 1.02 -> 0.102
    # kl 0.5:  e = clip(9) = 0.2 -> 0.102 * 1.02 = 0.10404
    # kl 0 with n_steps 50: e = -0.2 -> * (1 - 0.1) = 0.093636
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    for kl, n, expected in [(0.06, 10, 0.102), (0.5, 10, 0.10404), (0.0, 50, 0.093636)]:
        ctrl.update(kl, n)
        _close(ctrl.value, expected, atol=1e-9)
        assert type(ctrl.value) is float
    verl_ctrl = core_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    for kl, n in [(0.06, 10), (0.5, 10), (0.0, 50)]:
        verl_ctrl.update(kl, n)
    _close(ctrl.value, float(verl_ctrl.value), atol=1e-12)
    resumed = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=100)
    resumed.load_state_dict(ctrl.state_dict())
    assert resumed.value == ctrl.value and ctrl.state_dict() == {"value": ctrl.value}
    with pytest.raises(ValueError, match="horizon > 0"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=0)


def test_fixed_kl_controller_and_unknown_type() -> None:
    ctrl = make_kl_controller("fixed", kl_coef=0.2, target_kl=0.05, horizon=100)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(5.0, 1000)
    assert ctrl.value == 0.2 and ctrl.state_dict() == {"value": 0.2}
    ctrl.load_state_dict({"value": 0.7})  # a fixed beta is configuration: the config wins on resume
    assert ctrl.value == 0.2
    with pytest.raises(UnknownEntry, match="known: adaptive, fixed"):
        make_kl_controller("pid", kl_coef=0.1, target_kl=0.1, horizon=1)


def test_apply_kl_in_reward_by_hand() -> None:
    # kl = old - ref = [[0.1, 0.2, 0.3], [0.4, 0, 9 (masked)]], beta 0.5:
    # rewards = scores - 0.5 * kl * mask = [[-0.05, -0.1, 0.85], [-0.2, 0, 0.5]];
    # per-sequence mean KL = [0.2, 0.2] -> kl metric 0.2.
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.5]])
    old = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ctrl = make_kl_controller("fixed", kl_coef=0.5, target_kl=0.1, horizon=1)
    rewards, m = apply_kl_in_reward(
        scores, old, torch.zeros(2, 3), mask, controller=ctrl, kl_penalty_kind="kl"
    )
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 0.0, 0.5]]))
    _close(m["kl"], 0.2)
    _close(m["kl_coef"], 0.5)


def test_apply_kl_in_reward_matches_verl_apply_kl_penalty() -> None:
    # verl's ray_trainer.apply_kl_penalty, transcribed (importing ray_trainer needs torchdata):
    # kld = kl_penalty(old, ref) * mask; rewards = scores - beta * kld;
    # current_kl = mean_b(masked_mean(kld, mask, axis=-1)); kl_ctrl.update(current_kl, batch_size).
    gen = torch.Generator().manual_seed(5)
    b, t = 5, 7
    scores = torch.randn(b, t, generator=gen)
    old, ref = -torch.rand(b, t, generator=gen), -torch.rand(b, t, generator=gen)
    mask = (torch.rand(b, t, generator=gen) > 0.3).float()
    ours = make_kl_controller("adaptive", kl_coef=0.05, target_kl=0.02, horizon=50)
    theirs = core_algos.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.02, horizon=50)
    for _ in range(3):
        rewards, m = apply_kl_in_reward(
            scores, old, ref, mask, controller=ours, kl_penalty_kind="low_var_kl"
        )
        kld = core_algos.kl_penalty(old, ref, kl_penalty="low_var_kl") * mask
        ref_rewards = scores - theirs.value * kld
        current_kl = torch.mean(verl_F.masked_mean(kld, mask=mask, axis=-1), dim=0).item()
        torch.testing.assert_close(rewards, ref_rewards)
        _close(m["kl"], current_kl)
        _close(m["kl_coef"], theirs.value, atol=1e-12)
        ours.update(m["kl"], b)
        theirs.update(current_kl=current_kl, n_steps=b)
