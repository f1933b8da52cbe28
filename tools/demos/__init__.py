"""Demonstration builders for ``bin/warmup --agent NAME``: one per seed agent.

Design: ``tools/warmup.py`` owns the supervised loop (with ``tools/warmup_batches.py``: packing,
loss on model tokens only, the probe, the copy drill; writing the model); what an episode of an
agent *looks like* lives here, one module per agent, looked up by name. A builder takes the data rows, the ``ChatRenderer`` of the model's
tokenizer and the tool objects the prompt shows, and returns ``Demonstration``s (token ids and the
loss mask), tokenised exactly as that agent's context grows during a rollout. An agent whose episode
rewrites its context (StateLM deletions) returns one demonstration per segment. Modules are imported
only when named, so ``bin/warmup --help`` stays instant.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_service.agents.rendering import ChatRenderer


@dataclass
class Demonstration:
    ids: list[int]
    train: list[bool]  # train[i]: the token at i + 1 is a model token (the loss position)
    expression: str
    answer: str


Builder = Callable[..., list[Demonstration]]
"""``builder(rows, renderer, tools, *, guess_fraction, seed) -> list[Demonstration]``."""

# agent name -> "module:function"; the module is imported on first use
BUILDERS: dict[str, str] = {
    "calculator": "tools.demos.calculator:build_demonstrations",
    "statelm": "tools.demos.statelm:build_demonstrations",
    "code": "tools.demos.code:build_demonstrations",
    "mixed": "tools.demos.mixed:build_demonstrations",
}


def builder(agent: str) -> Builder:
    """The demonstration builder of ``agent``; an unknown name lists the known ones."""
    try:
        target = BUILDERS[agent]
    except KeyError:
        raise ValueError(
            f"no warm-up demonstrations for agent {agent!r}; known: {', '.join(sorted(BUILDERS))}"
        ) from None
    module, _, name = target.partition(":")
    fn: Builder = getattr(importlib.import_module(module), name)
    return fn


def build(
    agent: str,
    rows: list[dict[str, Any]],
    renderer: ChatRenderer,
    tools: dict[str, Any],
    *,
    guess_fraction: float = 0.0,
    seed: int = 0,
) -> list[Demonstration]:
    return builder(agent)(rows, renderer, tools, guess_fraction=guess_fraction, seed=seed)
