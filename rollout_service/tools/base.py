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
    # per-episode tool state (notes, documents, ...)
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolResult:
    text: str
    ok: bool = True
    terminal: bool = False  # the episode ends after this call (finish / answer)
    answer: str | None = None  # the final answer, for terminal tools
    metrics: dict[str, float] = field(default_factory=dict)


class Tool(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI function schema: {"type": "function", "function": {"name", "description", "parameters"}}."""
        ...

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult: ...


# name -> factory(**options) -> Tool. Options come from config (e.g. the sandbox limits).
TOOLS: Registry[Any] = Registry("tool")


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def check_args(parameters: dict[str, Any], args: Any) -> str | None:
    """Check call arguments against a function schema's ``parameters`` (required names and JSON
    types of the top-level properties); return what is wrong, phrased for the model, or None."""
    if not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    props: dict[str, Any] = parameters.get("properties", {})
    for name in parameters.get("required", []):
        if name not in args:
            return f"missing required argument {name!r}"
    for name, value in args.items():
        if name not in props:
            if parameters.get("additionalProperties", True) is False:
                return f"unexpected argument {name!r}; expected: {', '.join(props)}"
            continue
        expected = props[name].get("type")
        if expected is None:
            continue
        names = [expected] if isinstance(expected, str) else list(expected)
        if not any(_is_json_type(value, t) for t in names):
            return f"argument {name!r} must be of type {' or '.join(names)}, got {type(value).__name__}"
    return None


def _is_json_type(value: Any, json_type: str) -> bool:
    # bool is an int in Python but not a number in JSON.
    if isinstance(value, bool) and json_type in ("number", "integer"):
        return False
    return isinstance(value, _JSON_TYPES.get(json_type, (object,)))


def function_schema(
    name: str, description: str, properties: dict[str, Any], required: list[str]
) -> dict[str, Any]:
    """An OpenAI-style function schema with a closed argument object (unknown arguments refused)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


def invalid_args(tool: Tool, args: Any) -> ToolResult | None:
    """An error response naming the bad argument, or None when ``args`` fit the tool's schema."""
    problem = check_args(tool.schema["function"]["parameters"], args)
    return ToolResult(text=f"Error: {problem}", ok=False) if problem else None
