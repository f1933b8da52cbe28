"""The multi-turn tool agent and the single-turn agent.

Design (verl's tool agent loop): generate a turn; parse tool calls from its text; none -> the
episode ends (``no_tool_call``); otherwise run up to ``max_parallel_calls`` of them concurrently
(more are refused with an error response), render the responses with the chat template and append
them as tokens with mask 0, then generate again. A terminal tool (finish/answer) ends the episode
as ``answered``. Every failure of a call (unknown tool, bad arguments, a tool that raises or
exceeds its time limit) becomes a response text the model reads; a run of
``max_consecutive_tool_errors`` turns whose calls all failed ends the episode as ``tool_error``.
"""

from __future__ import annotations

from typing import Any

import anyio

from common.logging import get_logger
from rollout_service.agents.base import AGENTS, AgentDeps, generate_turn, start
from rollout_service.agents.episode import Episode, State
from rollout_service.agents.parsers import ParsedTurn, ToolCall
from rollout_service.tools.base import ToolContext, ToolResult
from rollout_service.tools.limited import call_tool

log = get_logger("agent")


def append_tool_turn(ep: Episode, deps: AgentDeps, tool_messages: list[dict[str, Any]]) -> bool:
    """Append tool messages as context (mask 0) after a model turn; False (terminated: length)
    when they would leave no room for a reply."""
    limits = deps.limits
    delta = deps.renderer.tool_delta_ids(tool_messages)
    if (
        len(ep.response_ids) + len(delta) >= limits.response_length
        or ep.context_len + len(delta) >= limits.max_model_len
    ):
        ep.terminate("length")  # no room for the responses and a reply to them
        return False
    ep.messages.extend(tool_messages)
    ep.add_tool(delta)
    return True


def truncate(text: str, limit: int, side: str) -> str:
    """Keep at most ``limit`` characters; ``side`` is the part that is cut."""
    if len(text) <= limit:
        return text
    marker = "...(truncated)..."
    keep = max(0, limit - len(marker))
    if side == "left":
        return marker + text[len(text) - keep :]
    if side == "right":
        return text[:keep] + marker
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


@AGENTS.register("single_turn")
class SingleTurnAgent:
    """One model turn; the answer is whatever it wrote."""

    def __init__(self, deps: AgentDeps) -> None:
        self.deps = deps

    async def run(self, ep: Episode) -> None:
        if not start(ep, self.deps):
            return
        gen = await generate_turn(ep, self.deps)
        if gen is None:
            return
        ep.messages.append(
            {"role": "assistant", "content": self.deps.renderer.turn_text(gen.token_ids)}
        )
        ep.terminate("answered")


@AGENTS.register("tool_agent")
class ToolAgent:
    def __init__(self, deps: AgentDeps) -> None:
        if deps.parser is None:
            raise ValueError("the tool agent needs a tool-call parser (multi_turn.format)")
        self.deps = deps
        self.schemas = [t.schema for t in deps.tools.values()]

    async def run(self, ep: Episode) -> None:
        ep.expect_actions("tool_calls", "tool_errors")
        if not self.begin(ep):
            return
        limits, failed_turns = self.deps.limits, 0
        while ep.state is State.GENERATING:
            gen = await generate_turn(ep, self.deps)
            if gen is None:
                return
            text = self.deps.renderer.turn_text(gen.token_ids)
            parsed = self.deps.parser.parse(text)  # type: ignore[union-attr]
            self.on_assistant(ep, text, parsed)
            if not parsed.attempted:
                ep.terminate("no_tool_call")
                return
            ep.goto(State.PROCESSING_TOOLS)
            answered = await self._run_calls(ep, parsed.calls, parsed.errors)
            results = [r for _, r in answered]
            if any(r.terminal and r.ok for r in results):
                ep.final_answer = next(r.answer for r in results if r.terminal and r.ok)
                ep.terminate("answered")
                return
            failed_turns = failed_turns + 1 if all(not r.ok for r in results) else 0
            if failed_turns >= limits.max_consecutive_tool_errors:
                ep.terminate("tool_error")
                return
            if limits.max_assistant_turns is not None and ep.turns >= limits.max_assistant_turns:
                ep.terminate("max_turns")
                return
            if limits.max_user_turns is not None and ep.turns >= limits.max_user_turns:
                ep.terminate("max_turns")
                return
            if not self.continue_after_tools(ep, answered):
                return
            ep.goto(State.GENERATING)

    # -- hooks (the StateLM agent overrides them) ----------------------------------------------------
    def begin(self, ep: Episode) -> bool:
        """PENDING -> GENERATING with the rendered prompt; False if the episode terminated instead."""
        return start(ep, self.deps, self.schemas)

    def on_assistant(self, ep: Episode, text: str, parsed: ParsedTurn) -> None:
        """Record a model turn in the transcript."""
        ep.messages.append({"role": "assistant", "content": text})

    def continue_after_tools(self, ep: Episode, answered: list[tuple[str, ToolResult]]) -> bool:
        """Append the tool responses (mask 0) and the next turn's header; False (terminated) when
        there is no room for them and a reply."""
        tool_messages = [{"role": "tool", "content": self.response_text(r)} for _, r in answered]
        return append_tool_turn(ep, self.deps, tool_messages)

    def response_text(self, result: ToolResult) -> str:
        limits = self.deps.limits
        return truncate(
            result.text, limits.max_tool_response_length, limits.tool_response_truncate_side
        )

    def tool_context(self, ep: Episode) -> ToolContext:
        return ToolContext(episode_id=ep.episode_id, row=ep.row, state=ep.tool_state)

    async def _run_calls(
        self, ep: Episode, calls: list[ToolCall], parse_errors: list[str]
    ) -> list[tuple[str, ToolResult]]:
        """Every call's (tool name, result): accepted calls in order, then parse errors (name ""),
        then calls refused by the parallel-call limit."""
        limit = self.deps.limits.max_parallel_calls
        accepted, refused = calls[:limit], calls[limit:]
        results: list[ToolResult | None] = [None] * len(accepted)
        ctx = self.tool_context(ep)

        async def one(i: int, call: ToolCall) -> None:
            results[i] = await self._call(call, ctx)

        async with anyio.create_task_group() as tg:
            for i, call in enumerate(accepted):
                tg.start_soon(one, i, call)
        out = [(c.name, r) for c, r in zip(accepted, results, strict=True) if r is not None]
        out += [("", ToolResult(f"error: {e}", ok=False)) for e in parse_errors]
        out += [
            (
                c.name,
                ToolResult(
                    f"error: call to {c.name!r} refused: at most {limit} tool calls per turn",
                    ok=False,
                ),
            )
            for c in refused
        ]
        for name, r in out:  # a name the model made up (or none: unparsable) is counted as other
            ep.record_call(name if name in self.deps.tools else "other", r)
        return out

    async def _call(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        tool = self.deps.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.deps.tools))
            return ToolResult(f"error: unknown tool {call.name!r}; available: {known}", ok=False)
        timeout = self.deps.limits.tool_timeout_s
        try:
            return await call_tool(tool, call.arguments, ctx, timeout)
        except TimeoutError:
            return ToolResult(f"error: tool {call.name!r} took longer than {timeout:g} s", ok=False)
        except Exception as e:  # a bug in a tool must not end the episode, let alone the server
            log.exception("tool raised", tool=call.name, episode=ctx.episode_id)
            return ToolResult(
                f"error: tool {call.name!r} failed: {type(e).__name__}: {e}", ok=False
            )
