"""Advantage estimators: every registry entry against verl's own function (as verl's trainer calls
it) on batches with variable group sizes and tool-token holes, plus hand-computed small cases."""

from __future__ import annotations

import math
from typing import Any, get_args

import numpy as np
import pytest
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos

from common.config.training import AdvEstimator
from common.registry import UnknownEntry
from learner.algorithms import ADVANTAGE_ESTIMATORS, MissingAdvantageInput, compute_advantages

ALL = list(get_args(AdvEstimator))  # every name the config accepts
GROUPED = ["grpo", "reinforce_plus_plus_baseline", "rloo", "opo", "gpg"]
GAMMA, LAM = 0.97, 0.9


def _batch(seed: int = 0) -> dict[str, Any]:
    """16 trajectories in groups of 1, 5, 3, 2, 1 and 4, interleaved; responses of varied length
    with tool-output holes (mask 0) in the middle; outcome reward at the last token plus some
    per-token shaping so that the discounted estimators see more than one nonzero reward."""
    gen = torch.Generator().manual_seed(seed)
    sizes = {"u0": 1, "u1": 5, "u2": 3, "u3": 2, "u4": 1, "u5": 4}
    uids = [u for u, n in sizes.items() for _ in range(n)]
    perm = torch.randperm(len(uids), generator=gen).tolist()
    index = np.array([uids[i] for i in perm], dtype=object)
    b, t = len(index), 12
    mask = torch.zeros(b, t)
    rewards = torch.zeros(b, t)
    for i in range(b):
        length = int(torch.randint(4, t + 1, (1,), generator=gen))
        mask[i, :length] = 1.0
        start = int(torch.randint(1, length - 2, (1,), generator=gen))
        mask[i, start : start + 2] = 0.0  # a tool response inside the trajectory
        # ties within groups
        rewards[i, length - 1] = float(torch.randint(0, 3, (1,), generator=gen))
    rewards += 0.1 * torch.randn(b, t, generator=gen) * mask
    return {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "index": index,
        "values": torch.randn(b, t, generator=gen),
        "reward_baselines": torch.randn(b, generator=gen),
        "gamma": GAMMA,
        "lam": LAM,
        "norm_adv_by_std_in_grpo": True,
        "epsilon": 1e-6,
    }


def _verl(
    name: str, batch: dict[str, Any], norm_by_std: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's estimator, called the way verl's ray_trainer.compute_advantage calls it."""
    rewards, mask = batch["token_level_rewards"].clone(), batch["response_mask"].clone()
    if name == "gae":
        return core_algos.compute_gae_advantage_return(
            token_level_rewards=rewards,
            values=batch["values"],
            response_mask=mask,
            gamma=GAMMA,
            lam=LAM,
        )
    if name == "grpo":
        return core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=rewards,
            response_mask=mask,
            index=batch["index"],
            norm_adv_by_std_in_grpo=norm_by_std,
        )
    return core_algos.get_adv_estimator_fn(name)(
        token_level_rewards=rewards,
        response_mask=mask,
        config=AlgoConfig(gamma=GAMMA, lam=LAM),
        index=batch["index"],
        reward_baselines=batch["reward_baselines"],
    )


def test_registry_holds_the_configured_estimators() -> None:
    assert ADVANTAGE_ESTIMATORS.names() == sorted(ALL)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_verl(name: str, seed: int) -> None:
    batch = _batch(seed)
    adv, ret = compute_advantages(name, **batch)
    ref_adv, ref_ret = _verl(name, batch)
    assert adv.shape == ret.shape == batch["response_mask"].shape
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    torch.testing.assert_close(adv, ref_adv, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ALL)
def test_accepts_list_index_and_bool_mask(name: str) -> None:
    batch = _batch(3)
    ref_adv, _ = compute_advantages(name, **batch)
    batch["index"] = list(batch["index"])
    batch["response_mask"] = batch["response_mask"].bool()  # verl's gae alone refuses bool masks
    adv, _ = compute_advantages(name, **batch, some_future_key="ignored")
    torch.testing.assert_close(adv, ref_adv, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", [*GROUPED, "reinforce_plus_plus"])
def test_outcome_advantages_vanish_on_masked_tokens(name: str) -> None:
    batch = _batch(4)
    adv, _ = compute_advantages(name, **batch)
    assert (adv[batch["response_mask"] == 0] == 0).all()


def test_gae_hand_case_and_returns_are_advantage_plus_value() -> None:
    # mask [1, 0, 1] (middle = tool token), r = [0, 0, 1], V = [0.5, 9, 0.2], gamma = lam = 1:
    # t=2: delta = 1 - 0.2 = 0.8, A2 = 0.8; t=1 masked: A and V_next (0.2) carry through, A1 = 0.8;
    # t=0: delta = 0 + 0.2 - 0.5 = -0.3, A0 = -0.3 + 0.8 = 0.5. returns = A + V = [1.0, 9.8, 1.0].
    # Whitening over the 2 valid tokens: mean 0.65, unbiased var 0.045 -> (A - 0.65) / 0.2121.
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.2]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = compute_advantages(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values, gamma=1.0, lam=1.0
    )
    torch.testing.assert_close(ret, torch.tensor([[1.0, 9.8, 1.0]]))
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[-s, s, s]]), atol=1e-4, rtol=0)

    batch = _batch(5)
    adv, ret = compute_advantages("gae", **batch)
    raw = ret - batch["values"]  # the advantages before whitening
    mask = batch["response_mask"]
    mean = (raw * mask).sum() / mask.sum()
    var = ((raw - mean) ** 2 * mask).sum() / (mask.sum() - 1)
    torch.testing.assert_close(adv, (raw - mean) / torch.sqrt(var + 1e-8), atol=1e-5, rtol=0)


def _outcome(scores: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.zeros(len(scores), 3)
    rewards[:, -1] = torch.tensor(scores)
    return rewards, torch.ones(len(scores), 3)


def test_grpo_with_and_without_std_and_a_singleton() -> None:
    # group a: scores 1, 0, 2 -> mean 1, unbiased std 1; group b: one trajectory -> mean 0, std 1.
    rewards, mask = _outcome([1.0, 0.0, 2.0, 5.0])
    index = ["a", "a", "a", "b"]
    drgrpo, _ = compute_advantages(
        "grpo",
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        norm_adv_by_std_in_grpo=False,
    )
    torch.testing.assert_close(drgrpo[:, 0], torch.tensor([0.0, -1.0, 1.0, 5.0]))
    grpo, _ = compute_advantages(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=index
    )
    torch.testing.assert_close(grpo[:, 0], torch.tensor([0.0, -1.0, 1.0, 5.0]) / (1 + 1e-6))
    batch = _batch(6)
    batch["norm_adv_by_std_in_grpo"] = False
    adv, _ = compute_advantages("grpo", **batch)
    torch.testing.assert_close(adv, _verl("grpo", batch, norm_by_std=False)[0], atol=1e-6, rtol=0)


def test_grpo_groups_of_statelm_segments_have_variable_size() -> None:
    # StateLM: one prompt's episodes yield 3 + 2 segments (rewards broadcast per episode), another's
    # 1 + 3; each group's statistics run over all of its segments, whatever their number.
    scores = [1.0, 1.0, 1.0, 0.0, 0.0, -1.0, 1.0, 1.0, 1.0]
    index = ["p", "p", "p", "p", "p", "q", "q", "q", "q"]
    rewards, mask = _outcome(scores)
    adv, _ = compute_advantages(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=index
    )
    expected = []
    for uid in ("p", "q"):
        group = torch.tensor([s for s, i in zip(scores, index, strict=True) if i == uid])
        expected += ((group - group.mean()) / (group.std() + 1e-6)).tolist()
    torch.testing.assert_close(adv[:, -1], torch.tensor(expected))


def test_rloo_leave_one_out_and_singleton() -> None:
    # group a (n=3): 1 - (0+2)/2 = 0, 0 - (1+2)/2 = -1.5, 2 - (1+0)/2 = 1.5; singleton b: A = r.
    rewards, mask = _outcome([1.0, 0.0, 2.0, 5.0])
    adv, ret = compute_advantages(
        "rloo", token_level_rewards=rewards, response_mask=mask, index=["a", "a", "a", "b"]
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, -1.5, 1.5, 5.0]))
    assert torch.equal(adv, ret)


def test_opo_length_weighted_baseline() -> None:
    # lengths 1 and 3, scores 4 and 0: b = (1*4 + 3*0) / 4 = 1 -> A = 3, -1.
    rewards = torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv, _ = compute_advantages(
        "opo", token_level_rewards=rewards, response_mask=mask, index=["a", "a"]
    )
    torch.testing.assert_close(adv, torch.tensor([[3.0, 0.0, 0.0], [-1.0, -1.0, -1.0]]))


def test_remax_subtracts_the_greedy_baseline() -> None:
    # r = [1, 2, 3] fully valid: returns = reverse cumsum = [6, 5, 3]; baseline 2 -> A = [4, 3, 1].
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    adv, ret = compute_advantages(
        "remax",
        token_level_rewards=rewards,
        response_mask=torch.ones(1, 3),
        reward_baselines=torch.tensor([2.0]),
    )
    torch.testing.assert_close(ret, torch.tensor([[6.0, 5.0, 3.0]]))
    torch.testing.assert_close(adv, torch.tensor([[4.0, 3.0, 1.0]]))
    batch = _batch(7)
    adv1, _ = compute_advantages("remax", **batch)
    batch["reward_baselines"] = batch["reward_baselines"] + 1.0
    adv2, _ = compute_advantages("remax", **batch)
    torch.testing.assert_close(adv1 - adv2, batch["response_mask"])


@pytest.mark.parametrize(
    ("name", "key"), [("gae", "values"), ("remax", "reward_baselines"), ("grpo", "index")]
)
def test_missing_input_error_names_the_key(name: str, key: str) -> None:
    batch = _batch()
    del batch[key]
    with pytest.raises(
        MissingAdvantageInput, match=rf"algorithm\.adv_estimator={name} needs `{key}`"
    ):
        compute_advantages(name, **batch)


def test_index_of_the_wrong_length_is_refused() -> None:
    batch = _batch()
    batch["index"] = batch["index"][:-1]
    with pytest.raises(ValueError, match="one uid per trajectory"):
        compute_advantages("grpo", **batch)


def test_unknown_estimator_lists_the_known_ones() -> None:
    with pytest.raises(UnknownEntry, match="known: gae, gpg, grpo"):
        compute_advantages("grpo_typo", **_batch())
