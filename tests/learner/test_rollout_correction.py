"""verl's ``algorithm.rollout_correction``: its keys, every importance-weight and rejection mode
held to verl's own functions to 1e-6 (decoupled through our batch preparation, bypass through our
policy loss), the mismatch metrics, and an unknown mode refused with the valid ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.config.algorithm import RolloutCorrectionConfig as VerlCorrection
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import (
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    compute_rollout_correction_and_add_to_batch,
)
from verl.workers.config import ActorConfig, PolicyLossConfig

from common.config import ConfigError, load_config
from common.config.root import Config
from common.config.training import ROLLOUT_RS_OPTIONS
from learner.algorithms import make_kl_controller, policy_loss, verl_actor_config
from learner.loss_settings import policy_loss_settings
from learner.prepare import old_logprobs_from_update, rewards_and_advantages, to_samples
from protocol.trajectory import Trajectory

KEY = "algorithm.rollout_correction"


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    path = tmp_path / "run.yaml"
    path.write_text(f"actor_rollout_ref:\n  model:\n    path: {model}\ndata:\n  train_files: t\n")
    return path


def test_our_list_of_rejection_modes_is_verls() -> None:
    assert sorted(ROLLOUT_RS_OPTIONS) == sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)


def test_verl_keys_are_read(config_file: Path) -> None:
    config = load_config(
        config_file,
        [
            f"{KEY}.rollout_is=sequence",
            f"{KEY}.rollout_is_threshold=0.5_5.0",
            f"{KEY}.rollout_is_batch_normalize=True",
            f"{KEY}.rollout_rs=seq_mean_k1",
            f"{KEY}.rollout_rs_threshold=0.999_1.001",
        ],
    )
    c = config.algorithm.rollout_correction
    assert (c.rollout_is, c.rollout_is_threshold, c.rollout_is_batch_normalize) == (
        "sequence",
        "0.5_5.0",
        True,
    )
    assert (c.rollout_rs, c.rollout_rs_threshold, c.active) == ("seq_mean_k1", "0.999_1.001", True)
    # verl's pipeline works on the whole batch: the old-logprob forward stays separate
    assert old_logprobs_from_update(config, 0) is None
    # bypass_mode=True is verl's: rollout logprobs as pi_old, the bypass loss
    config = load_config(
        config_file,
        [f"{KEY}.bypass_mode=True", f"{KEY}.loss_type=reinforce", f"{KEY}.rollout_is=token"],
    )
    actor = config.actor_rollout_ref.actor
    assert (actor.policy_loss.loss_mode, actor.off_policy.old_logprobs) == (
        "bypass_mode",
        "rollout",
    )
    s = policy_loss_settings(actor, config.algorithm.rollout_correction)
    assert (s.loss_type, s.rollout_is) == ("reinforce", "token")


def test_unknown_modes_and_keys_are_refused(config_file: Path) -> None:
    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            load_config(config_file, list(overrides))
        return str(info.value)

    message = error(f"{KEY}.rollout_rs=token_k9", f"{KEY}.rollout_rs_threshold=2.0")
    assert f"{KEY}.rollout_rs" in message and "unknown rollout_rs mode 'token_k9'" in message
    assert ", ".join(sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)) in message
    assert "rollout_is" in error(f"{KEY}.rollout_is=geometric")
    assert "needs rollout_rs_threshold" in error(f"{KEY}.rollout_rs=token_k3")
    assert "one upper bound" in error(
        f"{KEY}.rollout_rs=token_k3", f"{KEY}.rollout_rs_threshold=1.0_2.0"
    )
    assert f"{KEY}.rollout_iss: unknown key" in error(f"{KEY}.rollout_iss=token")
    assert "off_policy.is_level" in error(
        f"{KEY}.rollout_is=token", "actor_rollout_ref.actor.off_policy.is_level=sequence"
    )


def _batch(seed: int) -> tuple[list[Trajectory], list[np.ndarray]]:
    """Trajectories with rollout logprobs, and the learner's old logprobs of each."""
    rng = np.random.default_rng(seed)
    trajs, olds = [], []
    for i in range(8):
        n = int(rng.integers(3, 12))
        mask = (rng.random(n) > 0.2).astype(np.uint8)
        mask[0] = 1
        rollout = (-rng.random(n) * 2).astype(np.float32)
        trajs.append(
            Trajectory(
                trajectory_id=f"t{i}",
                group_uid=f"g{i // 4}",
                prompt_ids=np.arange(2, dtype=np.int32),
                response_ids=np.arange(100, 100 + n, dtype=np.int32),
                response_mask=mask,
                rollout_logprobs=rollout,
                versions=np.zeros(n, np.int32),
                reward=float(rng.random()),
            )  # type: ignore[arg-type]
        )
        olds.append((rollout + rng.normal(0, 0.15, n)).astype(np.float32))
    return trajs, olds


# every importance-weight mode (token, sequence; truncation, IcePop band; batch normalisation)
# and every rejection option of verl 0.9.1 (with ratio bands for k1, upper bounds otherwise)
IS_MODES = [
    {"rollout_is": "token", "rollout_is_threshold": 1.1},
    {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    {"rollout_is": "token", "rollout_is_threshold": "0.9_1.1"},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.5_1.5"},
    {"rollout_is": "token", "rollout_is_threshold": 1.2, "rollout_is_batch_normalize": True},
    {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_is_batch_normalize": True},
]
RS_MODES = [
    {"rollout_rs": o, "rollout_rs_threshold": "0.9_1.1" if o.endswith("k1") else 0.02}
    for o in sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)
] + [
    {"rollout_rs": "token_k1", "rollout_rs_threshold": 1.2},
    {"rollout_rs": "token_k1,seq_max_k3", "rollout_rs_threshold": "0.8_1.25,0.05"},
    {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": "0.95_1.05",
    },
]


@pytest.mark.parametrize("mode", IS_MODES + RS_MODES, ids=lambda m: "-".join(map(str, m.values())))
def test_decoupled_mode_is_verls_to_1e6(mode: dict[str, object]) -> None:
    trajs, olds = _batch(seed=len(str(mode)))
    config = Config.model_validate(
        {
            "actor_rollout_ref": {"model": {"path": "m"}},
            "data": {"train_files": ["t"], "train_batch_size": 2},
            "algorithm": {"rollout_correction": mode},
        }
    )
    samples = to_samples(trajs)
    for s, old in zip(samples, olds, strict=True):
        s.set("old_logprobs", old)
    ours = rewards_and_advantages(
        config,
        trajs,
        samples,
        make_kl_controller("fixed", 0.0, 0.1, 1),
        in_update=False,
        critic=False,
    )
    # verl's trainer step on the same padded batch
    width = max(len(t.response_ids) for t in trajs)

    def padded(rows: list[np.ndarray]) -> torch.Tensor:
        out = torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.from_numpy(np.asarray(r, np.float32))
        return out

    batch = DataProto.from_dict(
        tensors={
            "old_log_probs": padded(olds),
            "rollout_log_probs": padded([t.rollout_logprobs for t in trajs]),
            "response_mask": padded([t.response_mask for t in trajs]),
        }
    )
    batch, verl_metrics = compute_rollout_correction_and_add_to_batch(
        batch,
        VerlCorrection(**{"rollout_is": None, **mode}),  # verl's YAML default: null
    )
    theirs_mask = batch.batch["response_mask"]
    for i, s in enumerate(samples):
        np.testing.assert_array_equal(s.response_mask, theirs_mask[i, : s.response_len].numpy())
        if "rollout_is" in mode:
            np.testing.assert_allclose(
                s.get("is_weights"),
                batch.batch["rollout_is_weights"][i, : s.response_len].numpy(),
                atol=1e-6,
                rtol=0,
            )
        else:
            assert s.is_weights is None
    assert {k for k in ours if k.startswith("rollout_corr/")} == set(verl_metrics)
    for k, v in verl_metrics.items():
        assert ours[k] == pytest.approx(float(v), abs=1e-6), k
    # the mismatch statistics verl reports, KL and ratios between rollout and learner
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "ppl_ratio", "log_ppl_abs_diff"):
        assert f"rollout_corr/{k}" in ours
    if "rollout_rs" in mode:
        assert "rollout_corr/rollout_rs_masked_fraction" in ours


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("mode", [IS_MODES[0], IS_MODES[3], RS_MODES[0], RS_MODES[-1]])
def test_bypass_mode_is_verls_to_1e6(loss_type: str, mode: dict[str, object]) -> None:
    config = Config.model_validate(
        {
            "actor_rollout_ref": {"model": {"path": "m"}},
            "data": {"train_files": ["t"]},
            "algorithm": {
                "rollout_correction": {**mode, "bypass_mode": True, "loss_type": loss_type}
            },
        }
    )
    settings = policy_loss_settings(
        config.actor_rollout_ref.actor, config.algorithm.rollout_correction
    )
    actor_config = verl_actor_config(settings)
    g = torch.Generator().manual_seed(3)
    rollout = -torch.rand(4, 9, generator=g) * 2
    logp = (rollout + torch.randn(4, 9, generator=g) * 0.1).requires_grad_()
    adv = torch.randn(4, 9, generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.2).float()
    ours, metrics = policy_loss(rollout, logp, adv, mask, config=actor_config)
    # verl's bypass loss, with verl's own config object made from verl's keys
    verl_config = ActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        use_dynamic_bsz=True,
        policy_loss=PolicyLossConfig(
            loss_mode="bypass_mode",
            rollout_correction=VerlCorrection(
                **{"rollout_is": None, **mode}, bypass_mode=True, loss_type=loss_type
            ),
        ),
    )
    theirs, verl_metrics = core_algos.compute_policy_loss_bypass_mode(
        rollout, logp, adv, mask, "token-mean", verl_config, None
    )
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
    # our names of verl's actor/pg_* metrics; the rollout_corr/* ones keep verl's
    renamed = {
        "actor/pg_clipfrac": "clipfrac",
        "actor/pg_clipfrac_lower": "clipfrac_lower",
        "actor/ppo_kl": "ppo_kl",
    }
    for k, v in verl_metrics.items():
        got = metrics[renamed.get(k, k)]
        assert got == pytest.approx(float(torch.as_tensor(v).float().mean()), abs=1e-6), k
    if "rollout_rs" in mode:
        assert "rollout_corr/rollout_rs_masked_fraction" in metrics
