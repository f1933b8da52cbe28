"""Agent loops: the episode state machine (``episode``), chat rendering to tokens (``rendering``),
tool-call parsers (``parsers``) and the registered agents (``single_turn``, ``tool_agent``,
``statelm``, ``code``).

Importing the package registers the built-in agents in ``AGENTS`` (each module registers its class
when imported); ``load_builtin_agents()`` says so explicitly at a call site and returns the registry.
"""

from __future__ import annotations

from typing import Any

from rollout_service.agents import code_agent, statelm, tool_agent
from rollout_service.agents.base import AGENTS

_BUILTIN_MODULES = (code_agent, statelm, tool_agent)


def load_builtin_agents() -> Any:
    """The agent registry with the built-in agents registered (they are, once this package is
    imported)."""
    return AGENTS
