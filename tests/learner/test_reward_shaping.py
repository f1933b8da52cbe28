"""Over-long reward shaping: verl's keys, verl's formula (held to verl's DAPO reward manager), the
scored and the shaped reward kept apart, and the step's metrics."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.workers.reward_manager.dapo import DAPORewardManager

from common.config import ConfigError, load_config
from common.config.reward import RewardConfig
from learner.algorithms import make_kl_controller
from learner.prepare import rewards_and_advantages, to_samples, token_level_scores
from learner.reward_shaping import overlong_penalties, overlong_penalty
from protocol.trajectory import Trajectory

KEY = "reward.reward_kwargs.overlong_buffer_cfg"


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    path = tmp_path / "run.yaml"
    path.write_text(
        f"actor_rollout_ref:\n  model:\n    path: {model}\ndata:\n  train_files: t.jsonl\n"
        "  max_response_length: 16\n"
    )
    return path


def test_verl_keys_are_accepted(config_file: Path) -> None:
    config = load_config(
        config_file,
        [f"{KEY}.enable=True", f"{KEY}.len=4", f"{KEY}.penalty_factor=0.5", f"{KEY}.log=False"],
    )
    cfg = config.reward.reward_kwargs.overlong_buffer_cfg
    assert (cfg.enable, cfg.len, cfg.penalty_factor, cfg.log) == (True, 4, 0.5, False)
    assert config.reward.reward_kwargs.max_resp_len is None  # data.max_response_length


def test_unknown_sub_key_and_bad_buffer_are_refused(config_file: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(config_file, [f"{KEY}.lenght=4"])
    assert f"{KEY}.lenght: unknown key" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(config_file, [f"{KEY}.enable=true", f"{KEY}.len=32"])
    assert f"{KEY}.len: must be at most the max response length 16" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(config_file, [f"{KEY}.enable=true"])
    assert f"{KEY}.len: must be > 0" in str(info.value)


def _verl_penalties(
    lengths: list[int], max_resp_len: int, buffer_len: int, factor: float, score: float
) -> list[float]:
    """verl's DAPORewardManager run on responses of ``lengths`` tokens, minus the score."""
    width, prompt = max_resp_len, 3
    n = len(lengths)
    attention = torch.zeros(n, prompt + width, dtype=torch.long)
    attention[:, :prompt] = 1
    for i, length in enumerate(lengths):
        attention[i, prompt : prompt + length] = 1
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.ones(n, prompt, dtype=torch.long),
            "responses": torch.ones(n, width, dtype=torch.long),
            "attention_mask": attention,
        },
        non_tensors={
            "reward_model": np.array([{"ground_truth": "x"}] * n, dtype=object),
            "data_source": np.array(["s"] * n, dtype=object),
        },
    )
    tokenizer = SimpleNamespace(decode=lambda ids, **_: "answer", eos_token="</s>")
    manager = DAPORewardManager(
        tokenizer,
        num_examine=0,
        compute_score=lambda **_: score,
        max_resp_len=max_resp_len,
        overlong_buffer_cfg=SimpleNamespace(
            enable=True, len=buffer_len, penalty_factor=factor, log=True
        ),
    )
    out = manager(data, return_dict=True)
    rewards = out["reward_tensor"]
    got = [float(rewards[i, length - 1]) - score for i, length in enumerate(lengths)]
    assert got == pytest.approx([float(v) for v in out["reward_extra_info"]["overlong_reward"]])
    return got


@pytest.mark.parametrize(
    ("max_resp_len", "buffer_len", "factor"), [(16, 4, 1.0), (20, 7, 0.3), (9, 9, 2.5)]
)
def test_penalty_matches_verls_dapo_reward_manager(
    max_resp_len: int, buffer_len: int, factor: float
) -> None:
    lengths = list(range(1, max_resp_len + 1))
    verl = _verl_penalties(lengths, max_resp_len, buffer_len, factor, score=0.75)
    ours = [
        overlong_penalty(n, max_resp_len=max_resp_len, buffer_len=buffer_len, penalty_factor=factor)
        for n in lengths
    ]
    np.testing.assert_allclose(ours, verl, atol=1e-6, rtol=0)
    # 0 up to the buffer, -factor at the budget
    assert ours[: max_resp_len - buffer_len] == [0.0] * (max_resp_len - buffer_len)
    assert ours[-1] == pytest.approx(-factor)


def traj(tid: str, group: str, length: int, reward: float) -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        group_uid=group,
        prompt_ids=np.arange(2, dtype=np.int32),
        response_ids=np.arange(100, 100 + length, dtype=np.int32),
        response_mask=np.ones(length, np.uint8),
        rollout_logprobs=np.full(length, -0.5, np.float32),
        versions=np.zeros(length, np.int32),
        reward=reward,
    )  # type: ignore[arg-type]


def test_shaped_reward_goes_to_advantages_and_metrics_show_both(config_file: Path) -> None:
    config = load_config(
        config_file,
        [
            f"{KEY}.enable=true",
            f"{KEY}.len=4",
            "algorithm.norm_adv_by_std_in_grpo=false",
        ],
    )
    # the budget is 16 and the buffer starts after 12 tokens: 14 tokens lose 2/4 of the reward
    trajs = [traj("a", "g", 14, 1.0), traj("b", "g", 4, 1.0), traj("c", "g", 16, 0.0)]
    penalties = overlong_penalties([14, 4, 16], config.reward, 16)
    assert penalties is not None and penalties.tolist() == [-0.5, 0.0, -1.0]
    samples = to_samples(trajs)
    for s in samples:
        s.set("old_logprobs", np.full(s.response_len, -0.5, np.float32))
    metrics = rewards_and_advantages(
        config,
        trajs,
        samples,
        make_kl_controller("fixed", 0.0, 0.1, 1),
        in_update=False,
        critic=False,
    )
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.5)
    assert metrics["reward/overlong_frac"] == pytest.approx(2 / 3)
    assert metrics["reward/shaped_mean"] == pytest.approx((0.5 + 1.0 - 1.0) / 3)
    # GRPO without std: the shaped rewards 0.5, 1.0, -1.0 minus their mean
    shaped = np.array([0.5, 1.0, -1.0])
    adv = [float(s.get("advantages")[0]) for s in samples]
    np.testing.assert_allclose(adv, shaped - shaped.mean(), atol=1e-6)
    # the scored reward is untouched
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0]


def test_off_by_default() -> None:
    assert overlong_penalties([10**6], RewardConfig(), 16) is None
    mask = torch.ones(1, 3)
    assert token_level_scores([traj("a", "g", 3, 1.0)], mask).tolist() == [[0, 0, 1.0]]


def test_verls_dapo_reward_manager_name_is_accepted(config_file: Path) -> None:
    config = load_config(config_file, ["reward.reward_manager.name=dapo", f"{KEY}.enable=false"])
    assert [a.describe() for a in config.applied_aliases] == [
        "reward.reward_manager.name=dapo: accepted, no effect here: episodes are scored by the "
        "rollout servers (rollout_server.reward_fn); DAPO's over-long shaping is "
        "reward.reward_kwargs.overlong_buffer_cfg"
    ]
    with pytest.raises(ConfigError, match="prime"):
        load_config(config_file, ["reward.reward_manager.name=prime"])
