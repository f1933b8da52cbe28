"""Reward functions by name (``base.REWARDS``): math answers, QA F1/EM, code tests.

Importing the package registers the built-in rewards (math, qa_f1, qa_em, code);
``load_builtin_rewards()`` says so explicitly at a call site and returns the registry.
"""

from __future__ import annotations

from common.registry import Registry
from rollout_service.rewards import code, math_answer, qa
from rollout_service.rewards.base import REWARDS, EpisodeView, RewardFn, RewardResult

__all__ = ["REWARDS", "EpisodeView", "RewardFn", "RewardResult", "load_builtin_rewards"]

_BUILTIN_MODULES = (code, math_answer, qa)


def load_builtin_rewards() -> Registry[RewardFn]:
    """The reward registry with the built-in rewards registered (they are, once this package is imported)."""
    return REWARDS
