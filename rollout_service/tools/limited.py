"""A tool behind the global rate limiter: one token of the tool's key per call.

Design: a wrapper, so any tool (in-process or a ``RemoteTool`` on a tool server) is limited the
same way, and only tools that have a bucket under ``tools.rate_limits.limits`` are wrapped. A call
that cannot get a token within the limiter's timeout becomes an error response for the model
(like any failed call), never an exception that ends the episode. Agents call tools through
`call_tool`: the wait for a token is bounded by the limiter's ``acquire_timeout_s`` alone, and the
agent's per-call ``tool_timeout_s`` bounds only the call itself, so a binding limit paces calls
instead of failing them as slow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from common.ratelimit import GlobalRateLimiter, RateLimitTimeout
from rollout_service.tools.base import Tool, ToolContext, ToolResult


class LimitedTool:
    def __init__(self, tool: Tool, limiter: GlobalRateLimiter, key: str | None = None) -> None:
        self.tool, self.limiter = tool, limiter
        self.name = tool.name
        self.key = key or tool.name

    @property
    def schema(self) -> dict[str, Any]:
        return self.tool.schema

    @property
    def client(self) -> Any:  # close_tools finds a remote tool's client through the wrapper
        return getattr(self.tool, "client", None)

    async def take_token(self) -> ToolResult | None:
        """Wait for this tool's token; the error result for the model if none came in time."""
        try:
            await self.limiter.acquire(self.key)
        except RateLimitTimeout as e:
            return ToolResult(f"error: {e}", ok=False, metrics={"rate_limited": 1.0})
        return None

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await self.take_token() or await self.tool.call(args, ctx)


async def call_tool(
    tool: Tool, args: dict[str, Any], ctx: ToolContext, timeout_s: float
) -> ToolResult:
    """Call `tool` with its run bounded by `timeout_s` (TimeoutError past it); a rate-limited
    tool first waits for its token, which only the limiter's own timeout bounds."""
    if isinstance(tool, LimitedTool):
        if (refused := await tool.take_token()) is not None:
            return refused
        tool = tool.tool
    with anyio.fail_after(timeout_s):
        return await tool.call(args, ctx)


def rate_limited(tools: Mapping[str, Tool], limiter: GlobalRateLimiter | None) -> dict[str, Tool]:
    """``tools`` with every one that has a configured bucket wrapped in ``LimitedTool``."""
    if limiter is None:
        return dict(tools)
    return {
        name: LimitedTool(t, limiter) if limiter.limits_key(name) else t
        for name, t in tools.items()
    }
