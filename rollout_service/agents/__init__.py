"""Agent loops: the episode state machine (``episode``), chat rendering to tokens (``rendering``),
tool-call parsers (``parsers``) and the registered agents (``single_turn``, ``tool_agent``,
``statelm``, ``code``); ``load_builtin_agents()`` imports the modules that register them."""

from __future__ import annotations

from typing import Any


def load_builtin_agents() -> Any:
    """The agent registry with the built-in agents registered."""
    from rollout_service.agents import code_agent, statelm, tool_agent  # noqa: F401  (registration)
    from rollout_service.agents.base import AGENTS

    return AGENTS
