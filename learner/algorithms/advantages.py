"""Advantage estimators, chosen by ``algorithm.adv_estimator`` through a registry.

Design: every entry is a thin keyword-only wrapper around verl's ``core_algos`` function of the same
name (the numbers are verl's, bit for bit), with one uniform calling convention: the caller passes
the same keyword set (verl's argument names) to any estimator and each one takes what it needs and
ignores the rest. The wrappers add what verl leaves to its trainer: input checks whose errors name
the config key, masks cast to the reward dtype, and ``gamma`` for REINFORCE++ without an AlgoConfig.
Groups (``index``, one uid per trajectory) may have any size, including 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos

from common.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageFn", "MissingAdvantageInput", "compute_advantages"]

Index = np.ndarray | Sequence[str]


class AdvantageFn(Protocol):
    """``fn(token_level_rewards=..., response_mask=..., **common) -> (advantages, returns)``, [B, T] each."""

    def __call__(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


class MissingAdvantageInput(ValueError):
    """An estimator was called without an input it needs (values for gae, baselines for remax)."""


ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def compute_advantages(name: str, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Look ``name`` up (an ``algorithm.adv_estimator`` value) and run it on ``kwargs``."""
    return ADVANTAGE_ESTIMATORS.get(name)(**kwargs)


def _require(value: Any, key: str, estimator: str, what: str) -> Any:
    if value is None:
        raise MissingAdvantageInput(
            f"algorithm.adv_estimator={estimator} needs `{key}` ({what}), but none was given"
        )
    return value


def _mask(response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # verl computes `1 - mask`, which torch refuses for bool masks; float keeps every path valid.
    return response_mask.to(like.dtype)


def _index(index: Index | None, estimator: str, batch: int) -> np.ndarray:
    index = _require(index, "index", estimator, "group uid of each trajectory, length B")
    arr = np.asarray(index, dtype=object)
    if arr.shape != (batch,):
        raise ValueError(
            f"`index` has shape {arr.shape}, expected ({batch},): one uid per trajectory"
        )
    return arr


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE; masked (tool) tokens carry V_next and A through; returns = A + V before whitening."""
    values = _require(values, "values", "gae", "critic values [B, T]; enable the critic")
    return core_algos.compute_gae_advantage_return(
        token_level_rewards=token_level_rewards,
        values=values,
        response_mask=_mask(response_mask, token_level_rewards),
        gamma=gamma,
        lam=lam,
    )


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r - mean_g) / (std_g + eps), or r - mean_g (Dr.GRPO); a singleton group has mean 0, std 1."""
    return core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=_mask(response_mask, token_level_rewards),
        index=_index(index, "grpo", token_level_rewards.shape[0]),
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted return-to-go (masked tokens carry it through), whitened over the batch."""
    return core_algos.compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=_mask(response_mask, token_level_rewards),
        config=AlgoConfig(gamma=gamma),  # verl reads gamma from the algorithm config only
    )


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r - mean_g broadcast over tokens, then whitened over the whole batch."""
    return core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=_mask(response_mask, token_level_rewards),
        index=_index(index, "reinforce_plus_plus_baseline", token_level_rewards.shape[0]),
        epsilon=epsilon,
    )


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r minus the leave-one-out group mean; a singleton group keeps A = r (verl's loop version)."""
    return core_algos.compute_rloo_outcome_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=_mask(response_mask, token_level_rewards),
        index=_index(index, "rloo", token_level_rewards.shape[0]),
        epsilon=epsilon,
    )


@ADVANTAGE_ESTIMATORS.register("remax")
def remax(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """returns = reverse cumsum of r; A = returns - reward of the greedy rollout; no whitening."""
    reward_baselines = _require(
        reward_baselines,
        "reward_baselines",
        "remax",
        "reward of a greedy rollout per trajectory, [B]",
    )
    return core_algos.compute_remax_outcome_advantage(
        token_level_rewards=token_level_rewards,
        reward_baselines=reward_baselines,
        response_mask=_mask(response_mask, token_level_rewards),
    )


@ADVANTAGE_ESTIMATORS.register("opo")
def opo(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r minus the length-weighted group mean (length = number of unmasked tokens)."""
    return core_algos.compute_opo_outcome_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=_mask(response_mask, token_level_rewards),
        index=_index(index, "opo", token_level_rewards.shape[0]),
        epsilon=epsilon,
    )


@ADVANTAGE_ESTIMATORS.register("gpg")
def gpg(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha * (r - mean_g), alpha = B / max(#nonzero rewards, 1) (verl's f_norm = 1)."""
    return core_algos.compute_gpg_outcome_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=_mask(response_mask, token_level_rewards),
        index=_index(index, "gpg", token_level_rewards.shape[0]),
        epsilon=epsilon,
    )
