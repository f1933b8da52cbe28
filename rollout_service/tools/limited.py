"""A tool behind the global rate limiter: one token of the tool's key per call.

Design: a wrapper, so any tool (in-process or a ``RemoteTool`` on a tool server) is limited the
same way, and only tools that have a bucket under ``tools.rate_limits.limits`` are wrapped. A call
that cannot get a token within the limiter's timeout becomes an error response for the model
(like any failed call), never an exception that ends the episode. The wait for a token counts
against the agent's per-call ``tool_timeout_s``; a limit so tight that calls wait longer than that
shows up as tool timeouts, which is the signal to raise the rate or lower the concurrency.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        try:
            await self.limiter.acquire(self.key)
        except RateLimitTimeout as e:
            return ToolResult(f"error: {e}", ok=False, metrics={"rate_limited": 1.0})
        return await self.tool.call(args, ctx)


def rate_limited(tools: Mapping[str, Tool], limiter: GlobalRateLimiter | None) -> dict[str, Tool]:
    """``tools`` with every one that has a configured bucket wrapped in ``LimitedTool``."""
    if limiter is None:
        return dict(tools)
    return {
        name: LimitedTool(t, limiter) if limiter.limits_key(name) else t
        for name, t in tools.items()
    }
