"""The `reward` section: shaping applied to the episodes' scored rewards (verl's ``reward.*`` keys).

Design: verl's key names (``reward.reward_kwargs.overlong_buffer_cfg.*``, ``max_resp_len``, its
DAPO reward manager's), so a DAPO recipe's overrides translate key for key. The scoring itself is
the rollout server's (``rollout_server.reward_fn``); what this section configures is applied by
the learner before advantages (`learner.reward_shaping` says why there).
"""

from __future__ import annotations

from pydantic import Field

from common.config.base import Section


class OverlongBufferConfig(Section):
    """DAPO's soft over-long punishment: a response whose length enters the last `len` tokens before
    max_resp_len loses up to `penalty_factor` of reward, linearly in how far it entered."""

    enable: bool = False
    """Subtract the over-long penalty from the scored reward."""
    len: int = Field(default=0, ge=0)
    """Length of the buffer in tokens (> 0 when enabled): the penalty starts at max_resp_len - len."""
    penalty_factor: float = Field(default=1.0, ge=0)
    """Penalty of a response that reaches max_resp_len (0 at the buffer's start, linear between)."""
    log: bool = False
    """Accepted for verl's recipes; the penalty's metrics are always logged here
    (reward/overlong_penalty_mean, reward/overlong_frac)."""


class RewardKwargsConfig(Section):
    """verl's ``reward.reward_kwargs``: the DAPO reward manager's arguments."""

    overlong_buffer_cfg: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    """Over-long reward shaping."""
    max_resp_len: int | None = Field(default=None, gt=0)
    """Response length the buffer ends at, in tokens; null: data.max_response_length."""


class RewardConfig(Section):
    """Reward shaping on the learner (verl's ``reward`` section, the keys this system reads)."""

    reward_kwargs: RewardKwargsConfig = Field(default_factory=RewardKwargsConfig)
    """The DAPO reward manager's keyword arguments."""
