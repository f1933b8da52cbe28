"""The reward interface: a function of the whole episode and its data row.

Design: a reward function is an async callable registered by name; it gets a read-only view of the
episode (what the model wrote, the final answer if a finish/answer tool gave one, how it ended)
and the data row (``answer`` and any extra fields), and returns a score plus scalar extras that
travel with the trajectory as ``reward_extras`` (accuracy, format, f1, ...). Async because some
rewards run code in the sandbox. A reward function that raises is a bug; the server scores the
episode 0 with ``reward_error`` set in the extras instead of crashing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from common.registry import Registry

Scalar = float | int | str | bool


@dataclass(frozen=True)
class EpisodeView:
    response_text: str  # all assistant turns, decoded (tool outputs excluded)
    final_answer: str | None  # from a terminal tool (finish/answer), if the episode used one
    messages: list[dict[str, Any]]  # the chat transcript: system/user/assistant/tool messages
    termination: str  # one of protocol.trajectory.TERMINATIONS
    num_turns: int
    tool_calls: int = 0
    tool_errors: int = 0


@dataclass
class RewardResult:
    score: float
    extras: dict[str, Scalar] = field(default_factory=dict)


RewardFn = Callable[[EpisodeView, dict[str, Any]], Awaitable[RewardResult]]

# name -> RewardFn
REWARDS: Registry[RewardFn] = Registry("reward function")
