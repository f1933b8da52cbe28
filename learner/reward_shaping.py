"""Shaping of the scored rewards before advantages: DAPO's over-long penalty (verl's formula).

Design: the rollout server scores an episode (``Trajectory.reward``, what the task says of the
answer); the learner shapes it here, just before the advantages, and keeps both. The learner is
the place because
- it holds the length in verl's unit: verl's DAPO reward manager measures the response's valid
  tokens (its attention mask over the response, tool tokens of a multi-turn episode included),
  which is ``len(Trajectory.response_ids)`` here, and its ``max_resp_len`` is the same budget as
  ``data.max_response_length`` (all turns, tool tokens included);
- the scored reward stays what the servers sent: ``reward/mean`` and the per-source rewards, the
  validation rewards, dynamic sampling's view of a group and the replay files all show the task's
  score, while the shaped reward goes only into the advantages and its own metrics
  (``reward/shaped_mean``, ``reward/overlong_penalty_mean``, ``reward/overlong_frac``);
- a change of the buffer needs no server restart: the servers do not know of it.
ReMax's greedy baseline (``reward_extras``) is a scored reward and is not shaped: its length does
not reach the learner.

The formula is verl's (``verl.workers.reward_manager.dapo.DAPORewardManager``): with
``expected = max_resp_len - len``, a response of L tokens gets
``min(-(L - expected) / len * penalty_factor, 0)``; tests hold it to verl's class.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.config.reward import RewardConfig

__all__ = ["overlong_penalties", "overlong_penalty", "shaping_metrics"]


def overlong_penalty(
    response_len: int, *, max_resp_len: int, buffer_len: int, penalty_factor: float
) -> float:
    """verl's DAPO over-long penalty (<= 0) of a response of ``response_len`` tokens."""
    expected_len = max_resp_len - buffer_len
    exceed_len = response_len - expected_len
    return min(-exceed_len / buffer_len * penalty_factor, 0.0)


def overlong_penalties(
    response_lens: Sequence[int], reward: RewardConfig, max_response_length: int
) -> np.ndarray | None:
    """The penalty of each response, or None when over-long shaping is off."""
    cfg = reward.reward_kwargs.overlong_buffer_cfg
    if not cfg.enable:
        return None
    max_resp_len = reward.reward_kwargs.max_resp_len or max_response_length
    return np.array(
        [
            overlong_penalty(
                n,
                max_resp_len=max_resp_len,
                buffer_len=cfg.len,
                penalty_factor=cfg.penalty_factor,
            )
            for n in response_lens
        ],
        dtype=np.float64,
    )


def shaping_metrics(scored: Sequence[float], penalties: np.ndarray | None) -> dict[str, float]:
    """``reward/overlong_penalty_mean`` (over every response, 0 for the unpenalised),
    ``reward/overlong_frac`` (share of responses penalised) and ``reward/shaped_mean``."""
    if penalties is None or not len(penalties):
        return {}
    return {
        "reward/overlong_penalty_mean": float(penalties.mean()),
        "reward/overlong_frac": float((penalties < 0).mean()),
        "reward/shaped_mean": float(np.mean(np.asarray(scored, np.float64) + penalties)),
    }
