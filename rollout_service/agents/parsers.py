"""Tool-call parsers: model text -> tool calls, by format name.

Design: a parser sees only the decoded text of one assistant turn (decoding is for parsing; the
token ids themselves are carried forward verbatim) and returns the calls it found plus the errors
it met, so a malformed call becomes an error response the model reads instead of a crash or a
silently ignored call. Formats are registered by name (``multi_turn.format`` in the config).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.registry import Registry


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per malformed call, for the model to read
    content: str = ""  # the text outside tool calls

    @property
    def attempted(self) -> int:
        return len(self.calls) + len(self.errors)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


PARSERS: Registry[type] = Registry("tool-call format")


def hermes_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call as HermesParser reads it, and as the chat templates render an assistant tool call."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@PARSERS.register("hermes")
class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn."""

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        out = ParsedTurn(content=self._CALL.sub("", text).strip())
        for body in self._CALL.findall(text):
            call, error = _call_from_json(body.strip())
            if call is not None:
                out.calls.append(call)
            else:
                out.errors.append(error)
        # An opened but never closed call is an attempt too: the model should learn to close it.
        if text.count("<tool_call>") > text.count("</tool_call>"):
            out.errors.append("tool call not closed: expected </tool_call>")
        return out


def _call_from_json(body: str) -> tuple[ToolCall | None, str]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"tool call is not valid JSON ({e.msg} at position {e.pos})"
    if not isinstance(obj, dict):
        return None, "tool call must be a JSON object with 'name' and 'arguments'"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, "tool call needs a string 'name'"
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, f"tool call {name!r}: 'arguments' is a string that is not JSON"
    if not isinstance(args, dict):
        return None, f"tool call {name!r}: 'arguments' must be a JSON object"
    return ToolCall(name, args), ""
