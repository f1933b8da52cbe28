"""What a tool is to an agent loop, and the registry tools are found in by name.

Design: a tool is an object with a name, an OpenAI-style function schema (rendered into the chat
template so the model sees it) and one async ``call``. A tool never raises for bad input or a
failed run: it returns ``ToolResult(ok=False, text=<what went wrong, for the model to read>)``.
Only a bug in the tool itself escapes, and the agent loop turns even that into an error response.
Tools that end the episode (``finish``/``answer``) say so with ``terminal=True`` and carry the
answer. Per-episode state a tool needs (the data row, a scratch directory) comes in ``ToolContext``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common.registry import Registry


@dataclass
class ToolContext:
    episode_id: str
    row: dict[str, Any] = field(default_factory=dict)  # the data row of the episode
    workdir: Path | None = None  # scratch space of the episode, if the server provides one
    state: dict[str, Any] = field(default_factory=dict)  # per-episode tool state (notes, documents, ...)


@dataclass
class ToolResult:
    text: str
    ok: bool = True
    terminal: bool = False  # the episode ends after this call (finish / answer)
    answer: str | None = None  # the final answer, for terminal tools
    metrics: dict[str, float] = field(default_factory=dict)


class Tool(Protocol):
    name: str

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI function schema: {"type": "function", "function": {"name", "description", "parameters"}}."""
        ...

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult: ...


# name -> factory(**options) -> Tool. Options come from config (e.g. the sandbox limits).
TOOLS: Registry[Any] = Registry("tool")
