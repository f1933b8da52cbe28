"""Agent-facing tools (calculator, sandboxed python, BM25 search, answer/finish,
the StateLM context tools) behind ``base.Tool``.

Importing the package registers the built-in tools in ``TOOLS`` (each module registers its factory
when imported); ``load_builtin_tools()`` says so explicitly at a call site and returns the registry.
"""

from __future__ import annotations

from typing import Any

from common.registry import Registry
from rollout_service.tools import calculator, finish, python_exec, search, statelm
from rollout_service.tools.base import TOOLS, Tool, ToolContext, ToolResult, check_args

__all__ = ["TOOLS", "Tool", "ToolContext", "ToolResult", "check_args", "load_builtin_tools"]

_BUILTIN_MODULES = (calculator, finish, python_exec, search, statelm)


def load_builtin_tools() -> Registry[Any]:
    """The tool registry with the built-in tools registered (they are, once this package is imported)."""
    return TOOLS
