"""Unit-test fakes for the agent loop: simple tools, and the scripted engine (now in
``rollout_service.engine.scripted``, so that a config can choose it) re-exported for the tests;
``fork_until_refused``, the sandbox tests' process bomb."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_service.engine.scripted import ScriptedEngine
from rollout_service.tools.base import ToolContext, ToolResult

__all__ = ["EchoTool", "ScriptedEngine", "fork_until_refused"]


@dataclass
class EchoTool:
    name: str = "echo"
    text: str | None = None  # fixed reply; None: echo the "text" argument
    ok: bool = True
    terminal: bool = False
    raises: bool = False
    seen: list[dict[str, Any]] = field(default_factory=list)

    @property
    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "echo",
                "parameters": {"type": "object", "properties": {}},
            },
        }

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        self.seen.append(args)
        if self.raises:
            raise RuntimeError("tool bug")
        text = self.text if self.text is not None else str(args.get("text", ""))
        return ToolResult(
            text, ok=self.ok, terminal=self.terminal, answer=text if self.terminal else None
        )


def fork_until_refused(child: str, refused: str, after: str = "") -> str:
    """Python source of a process bomb: fork until the OS refuses (``n`` counts the children),
    each child leaving the process group (``setsid``, so that killing the group alone misses it)
    and running ``child``; on the refusal (``e`` bound) ``refused``, then ``after``."""

    def block(src: str, depth: int) -> str:
        return "".join(" " * depth + line + "\n" for line in src.splitlines())

    return (
        "import os, time\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as e:\n" + block(refused, 8) + "        break\n"
        "    if pid == 0:\n"
        "        os.setsid()\n" + block(child, 8) + "    n += 1\n" + block(after, 0)
    )
