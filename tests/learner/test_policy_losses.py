"""verl's policy losses by ``actor.policy_loss.loss_mode``: every mode of verl's registry gives
verl's own numbers (loss, gradient, metrics) when called directly with the same inputs and
ActorConfig; with the mini-batch's global counts, micro-batch losses sum to the whole mini-batch's;
vanilla is our former PPO loss bit for bit; unknown modes are refused naming the valid ones; and
every mode trains a step in the real worker path (Ray + FSDP2 over gloo, the tiny model)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from pydantic import ValidationError
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

from common.config import actor_rollout_ref
from learner.algorithms import (
    POLICY_LOSS_MODES,
    LossNorm,
    PolicyLossSettings,
    policy_loss,
    ppo_policy_loss,
    verl_actor_config,
)
from learner.samples import Batching, Sample, split_for_ranks
from learner.worker_api import UpdateRequest

OWN_RAY_CLUSTER = True  # tests/conftest.py: runs in the serial pass

ROOT = Path(__file__).resolve().parents[2]
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean")
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
SETTINGS = PolicyLossSettings(
    clip_cov_ratio=0.2,  # large enough to cut some of our few tokens
    clip_cov_lb=-5.0,
    clip_cov_ub=5.0,
    kl_cov_ratio=0.2,
    ppo_kl_coef=0.3,
    dro_beta=0.5,
    tau_pos=1.2,
    tau_neg=1.5,
    rollout_is="token",
    rollout_is_threshold=1.5,
)
# micro-batch dependent by design (top-k / random choice among the micro-batch's tokens)
LOCAL_SELECTION = {"clip_cov", "kl_cov"}


def test_modes_are_verls_registry() -> None:
    assert POLICY_LOSS_MODES == tuple(core_algos.POLICY_LOSS_REGISTRY)
    assert actor_rollout_ref.POLICY_LOSS_MODES == POLICY_LOSS_MODES


def _inputs(seed: int = 0, b: int = 5, t: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 2 - 0.05
    logp = old + torch.randn(b, t, generator=g) * 0.4
    adv = torch.randn(b, t, generator=g)
    adv[0] = 0.7  # one sequence-level advantage (GRPO-style)
    mask = (torch.rand(b, t, generator=g) > 0.25).float()
    mask[:, 0] = 1.0
    mask[3] = 0.0  # a fully masked row (all tool tokens)
    w = (torch.rand(b, t, generator=g) + 0.5) * mask
    return {"old": old, "logp": logp, "adv": adv, "mask": mask, "w": w}


def _verl_config(mode: str, agg: str) -> ActorConfig:
    """The ActorConfig a verl user with the same keys gets, built here independently."""
    s = SETTINGS
    return ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio_low=CLIP["clip_ratio_low"],
        clip_ratio_high=CLIP["clip_ratio_high"],
        clip_ratio_c=CLIP["clip_ratio_c"],
        loss_agg_mode=agg,
        tau_pos=s.tau_pos,
        tau_neg=s.tau_neg,
        policy_loss=PolicyLossConfig(
            loss_mode=mode,
            clip_cov_ratio=s.clip_cov_ratio,
            clip_cov_lb=s.clip_cov_lb,
            clip_cov_ub=s.clip_cov_ub,
            kl_cov_ratio=s.kl_cov_ratio,
            ppo_kl_coef=s.ppo_kl_coef,
            dro_beta=s.dro_beta,
            rollout_correction=RolloutCorrectionConfig(
                rollout_is=s.rollout_is, rollout_is_threshold=s.rollout_is_threshold
            ),
        ),
    )


def _ours(mode: str, agg: str, x: dict[str, torch.Tensor], norm: LossNorm | None, weights: bool):
    config = verl_actor_config(replace(SETTINGS, loss_mode=mode), loss_agg_mode=agg, **CLIP)
    logp = x["logp"].clone().requires_grad_()
    torch.manual_seed(123)  # clip_cov draws its random choice from torch's global generator
    loss, metrics = policy_loss(
        x["old"], logp, x["adv"], x["mask"], config=config, norm=norm,
        is_weights=x["w"] if weights else None,
    )  # fmt: skip
    loss.backward()
    assert logp.grad is not None
    return loss.detach(), logp.grad, metrics


def _verls(mode: str, agg: str, x: dict[str, torch.Tensor], norm: LossNorm | None, weights: bool):
    config = _verl_config(mode, agg)
    if norm is not None:
        config.global_batch_info.update(
            dp_size=norm.dp_size,
            batch_num_tokens=norm.batch_num_tokens,
            global_batch_size=norm.global_batch_size,
            loss_scale_factor=norm.loss_scale_factor,
        )
    logp = x["logp"].clone().requires_grad_()
    torch.manual_seed(123)
    loss, metrics = core_algos.get_policy_loss_fn(mode)(
        x["old"], logp, x["adv"], x["mask"], agg, config, x["w"] if weights else None
    )
    loss.backward()
    assert logp.grad is not None
    return loss.detach(), logp.grad, metrics


@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("global_counts", [False, True])
def test_each_mode_equals_verls_function(mode: str, agg: str, global_counts: bool) -> None:
    """Same inputs, same config: the loss, its gradient and the metrics are verl's, exactly; with
    global counts too (geo_mean, which verl leaves a plain mean over the micro-batch's rows, is
    rescaled by rows / global sequences * dp_size, the same for its gradient)."""
    x = _inputs(seed=len(mode) + len(agg))
    norm = LossNorm(dp_size=2, batch_num_tokens=61, global_batch_size=11) if global_counts else None
    for weights in (False, True):
        loss, grad, metrics = _ours(mode, agg, x, norm, weights)
        ref_loss, ref_grad, ref_metrics = _verls(mode, agg, x, norm, weights)
        scale = 1.0
        if mode == "geo_mean" and norm is not None:
            scale = x["mask"].shape[0] / 11 * 2
        torch.testing.assert_close(loss, ref_loss * scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, ref_grad * scale, rtol=1e-6, atol=0)
        assert torch.isfinite(loss) and grad.abs().sum() > 0
        for k, v in ref_metrics.items():
            names = {
                "actor/pg_clipfrac": "clipfrac",
                "actor/pg_clipfrac_lower": "clipfrac_lower",
                "actor/ppo_kl": "ppo_kl",
            }
            name = names[k] if k in names else k
            assert metrics[name] == pytest.approx(float(v)), k


@pytest.mark.parametrize("agg", (*AGG_MODES, "seq-mean-token-sum-norm"))
def test_vanilla_is_our_former_ppo_loss_bit_for_bit(agg: str) -> None:
    x = _inputs(seed=3)
    norm = LossNorm(dp_size=2, batch_num_tokens=61, global_batch_size=11, loss_scale_factor=13)
    loss, grad, metrics = _ours("vanilla", agg, x, norm, weights=True)
    logp = x["logp"].clone().requires_grad_()
    ref, ref_m = ppo_policy_loss(
        x["old"], logp, x["adv"], x["mask"], **CLIP, loss_agg_mode=agg, norm=norm, is_weights=x["w"]
    )
    ref.backward()
    assert torch.equal(loss, ref.detach())
    assert logp.grad is not None and torch.equal(grad, logp.grad)
    for k in ("clipfrac", "clipfrac_lower", "ppo_kl"):
        assert metrics[k] == float(ref_m[k])


@pytest.mark.parametrize("mode", sorted(set(POLICY_LOSS_MODES) - LOCAL_SELECTION))
@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_with_global_counts_sum_to_the_mini_batch(mode: str, agg: str) -> None:
    """Cut a mini-batch of 6 sequences into micro-batches (rows kept whole, as every layout of the
    learner does) and into 2 ranks: the summed micro-batch losses / dp_size equal the loss of the
    whole mini-batch with its own counts (the update the learner makes equals one full-batch step).
    clip_cov and kl_cov pick tokens among the micro-batch's own, in verl too. geo_mean's mean is
    over the sequences with a trained token (verl's plain row mean, with no counts, has all rows)."""
    x = _inputs(seed=11, b=6)
    whole, whole_grad, _ = _ours(mode, agg, x, LossNorm.from_mask(x["mask"]), weights=True)
    norm = LossNorm.from_mask(x["mask"], dp_size=2)
    total = torch.zeros(())
    grad = torch.zeros_like(x["logp"])
    for rows in ([0, 1], [2], [3, 4, 5]):  # rank 0: [0, 1] and [2]; rank 1: [3, 4, 5]
        part = {k: v[rows] for k, v in x.items()}
        loss, g, _ = _ours(mode, agg, part, norm, weights=True)
        total += loss
        grad[rows] += g
    torch.testing.assert_close(total / 2, whole, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad / 2, whole_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
def test_a_micro_batch_with_no_trained_token_adds_nothing(mode: str) -> None:
    """A rank's dummy micro-batch (kept in step with the other ranks) or a micro-batch of tool-only
    responses: loss 0, gradient 0, finite metrics (verl's bypass_mode refuses such a mask: skipped)."""
    norm = LossNorm(dp_size=2, batch_num_tokens=30, global_batch_size=7, loss_scale_factor=9)
    z = torch.zeros(2, 5)
    x = {"old": z, "logp": z, "adv": z, "mask": z, "w": z}
    for agg in AGG_MODES:
        loss, grad, metrics = _ours(mode, agg, x, norm, weights=True)
        assert float(loss) == 0.0 and torch.equal(grad, torch.zeros_like(grad))
        assert all(np.isfinite(v) for v in metrics.values()), metrics


# ----------------------------------------------------------------------------------- config


def _actor(**kw: Any) -> actor_rollout_ref.ActorConfig:
    return actor_rollout_ref.ActorConfig.model_validate(kw)


def test_config_keys_are_verls_with_verls_defaults() -> None:
    ours = actor_rollout_ref.PolicyLossConfig()
    verls = PolicyLossConfig()
    for key in actor_rollout_ref.PolicyLossConfig.model_fields:
        assert getattr(ours, key) == getattr(verls, key), key
    actor = _actor()
    verl_actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    assert (actor.tau_pos, actor.tau_neg) == (verl_actor.tau_pos, verl_actor.tau_neg)
    for mode in POLICY_LOSS_MODES:
        kw: dict[str, Any] = {"policy_loss": {"loss_mode": mode, "dro_beta": 0.1}}
        if mode == "bypass_mode":
            kw["off_policy"] = {"old_logprobs": "rollout"}
        assert _actor(**kw).policy_loss.loss_mode == mode


def test_unknown_mode_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValidationError) as err:
        _actor(policy_loss={"loss_mode": "ppo2"})
    text = str(err.value)
    assert "unknown policy loss mode 'ppo2'" in text
    assert all(mode in text for mode in POLICY_LOSS_MODES)
    with pytest.raises(ValueError, match="valid: vanilla, dppo_tv"):
        verl_actor_config(PolicyLossSettings(loss_mode="ppo2"))


def test_modes_missing_their_inputs_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"needs policy_loss\.dro_beta"):
        _actor(policy_loss={"loss_mode": "dro"})
    with pytest.raises(ValidationError, match=r"off_policy\.old_logprobs=rollout"):
        _actor(policy_loss={"loss_mode": "bypass_mode"})


def test_loaded_keys_reach_the_workers(tmp_path: Path) -> None:
    """verl-style overrides -> the typed config -> the workers' settings -> verl's ActorConfig."""
    from common.config import load_config
    from learner.run_settings import worker_settings

    (tmp_path / "model").mkdir()
    path = tmp_path / "run.yaml"
    model = tmp_path / "model"
    path.write_text(
        f"actor_rollout_ref:\n  model:\n    path: {model}\ndata:\n  train_files: train.jsonl\n"
    )
    prefix = "actor_rollout_ref.actor."
    config = load_config(
        path,
        [
            f"{prefix}policy_loss.loss_mode=kl_cov",
            f"{prefix}policy_loss.kl_cov_ratio=0.01",
            f"{prefix}policy_loss.ppo_kl_coef=0.5",
            f"{prefix}tau_neg=2.0",
            f"{prefix}loss_agg_mode=token-sum",
            f"{prefix}clip_ratio_high=0.28",
            f"{prefix}off_policy.is_level=sequence",
        ],
        check_paths=False,
    )
    s = worker_settings(config, total_steps=1)
    assert s.policy_loss == PolicyLossSettings(
        loss_mode="kl_cov",
        kl_cov_ratio=0.01,
        ppo_kl_coef=0.5,
        tau_neg=2.0,
        rollout_is="sequence",
    )
    verl = verl_actor_config(
        s.policy_loss,
        clip_ratio_low=s.clip_ratio_low,
        clip_ratio_high=s.clip_ratio_high,
        clip_ratio_c=s.clip_ratio_c,
        loss_agg_mode=s.loss_agg_mode,
    )
    assert verl.policy_loss.loss_mode == "kl_cov" and verl.policy_loss.ppo_kl_coef == 0.5
    assert (verl.loss_agg_mode, verl.clip_ratio_high, verl.tau_neg) == ("token-sum", 0.28, 2.0)


@pytest.mark.integration
def test_check_refuses_an_unknown_mode_with_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bin" / "train"),
            "--config",
            str(ROOT / "configs" / "default.yaml"),
            f"actor_rollout_ref.model.path={tmp_path}",
            "actor_rollout_ref.actor.policy_loss.loss_mode=ppo2",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "actor_rollout_ref.actor.policy_loss.loss_mode: unknown policy loss mode 'ppo2'" in out
    assert "valid: " + ", ".join(POLICY_LOSS_MODES) in out


# --------------------------------------------------------------- the real worker path (slow)


def _samples(n: int, seed: int = 0, vocab: int = 500) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, r = int(rng.integers(3, 10)), int(rng.integers(2, 14))
        ids = rng.integers(0, vocab, p + r).astype(np.int64)
        mask = (rng.random(r) > 0.2).astype(np.float32)
        mask[0] = 1.0
        if len(out) == 5:
            mask[:] = 0.0  # a response of tool tokens only: nothing of it is trained
        s = Sample(ids, p, mask)
        s.advantages = np.full(r, rng.normal(), dtype=np.float32) * mask  # one per sequence
        out.append(s)
    return out


def _stale(samples: list[Sample], rng: np.random.Generator, bypass: bool) -> None:
    """Rollout logprobs a little off the old ones, and the truncated IS weights between them, as
    the trainer makes them (bypass: the rollout's logprobs are the old ones)."""
    for s in samples:
        old, mask = s.get("old_logprobs"), s.response_mask
        s.rollout_logprobs = (old + rng.normal(size=old.shape) * 0.1).astype(np.float32)
        s.is_weights = np.minimum(np.exp(old - s.rollout_logprobs), 2.0).astype(np.float32) * mask
        if bypass:
            s.old_logprobs, s.is_weights = s.rollout_logprobs, None


async def _every_mode(model: Path) -> dict[str, Any]:
    import ray

    from learner.worker_settings import WorkerSettings
    from learner.workers import WorkerGroup

    world = 2
    group = WorkerGroup(
        WorkerSettings(model_path=str(model), lr=1e-3, loss_agg_mode="seq-mean-token-mean"), world
    )
    results: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    # packed, token-capped micro-batches: the layout that most needs sequences kept whole
    batching = Batching(max_tokens=40, packed=True)
    try:
        await group.start()
        samples = _samples(8)
        for mode in POLICY_LOSS_MODES:
            pl = replace(SETTINGS, loss_mode=mode, clip_cov_lb=-100.0, clip_cov_ub=100.0)
            # the test's own switch of each worker's settings (builtins: nothing of tests/ to import)
            for a in group.actors:
                s: WorkerSettings = ray.get(a.__ray_call__.remote(getattr, "s"))
                ray.get(a.__ray_call__.remote(setattr, "s", replace(s, policy_loss=pl)))
            # a step as the trainer makes it: old logprobs from a forward of the current weights
            await group.forward("actor", samples, "old_logprobs", batching)
            _stale(samples, rng, bypass=mode == "bypass_mode")
            plans = split_for_ranks(samples, mini_batches=1, ranks=world, batching=batching)
            assert max(len(p[0].micro_batches) for p in plans) > 1
            results[mode] = await group.update([UpdateRequest("actor", p) for p in plans])
    finally:
        group.shutdown()
    return results


@pytest.mark.e2e
def test_every_mode_trains_a_step_on_two_fsdp_ranks(tiny_model: Path, ray_cluster: Any) -> None:
    results = anyio.run(lambda: _every_mode(tiny_model))
    assert set(results) == set(POLICY_LOSS_MODES)
    for mode, per_rank in results.items():
        r = per_rank[0]
        assert r.optimizer_steps == 1 and r.skipped_steps == 0, mode
        assert np.isfinite(r.grad_norm_sum) and r.grad_norm_sum > 0, mode
        pg = sum(x.sums["pg_loss"] for x in per_rank)
        assert np.isfinite(pg), mode
        assert sum(x.sums["tokens"] for x in per_rank) > 0, mode
    losses = {round(sum(x.sums["pg_loss"] for x in r), 6) for r in results.values()}
    assert len(losses) > len(POLICY_LOSS_MODES) // 2, losses  # each step ran its own loss
