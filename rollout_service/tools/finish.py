"""The terminal tools ``finish`` and ``answer``: the model hands in its final answer.

Design: one class under two registry names (prompts and data sets use either word). The call ends
the episode (``terminal=True``) and carries the answer, which reward functions read as
``EpisodeView.final_answer``. Numbers are accepted as well as strings because models often write
``{"answer": 42}``; they are turned into text as written.
"""

from __future__ import annotations

import json
from typing import Any

from rollout_service.tools.base import TOOLS, ToolContext, ToolResult, function_schema, invalid_args


class AnswerTool:
    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.name,
            "Give your final answer and end the episode. Call this exactly once, last.",
            {"answer": {"type": ["string", "number"], "description": "the final answer"}},
            ["answer"],
        )

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        if bad := invalid_args(self, args):
            return bad
        value = args["answer"]
        answer = value if isinstance(value, str) else json.dumps(value)
        return ToolResult(text=f"Final answer recorded: {answer}", terminal=True, answer=answer)


@TOOLS.register("finish")
def make_finish(**options: Any) -> AnswerTool:
    if options:
        raise TypeError(f"finish takes no options, got {sorted(options)}")
    return AnswerTool("finish")


@TOOLS.register("answer")
def make_answer(**options: Any) -> AnswerTool:
    if options:
        raise TypeError(f"answer takes no options, got {sorted(options)}")
    return AnswerTool("answer")
