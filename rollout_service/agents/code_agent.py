"""The code-execution agent (seed 000): code between tags runs in the sandbox, mid-turn.

Design: one assistant turn that the sandbox interrupts. Generation stops on the closing code tag
(a stop string, so the engine hands back exactly the ids it sampled, tag included); the code
after the last opening tag runs through the ``python`` tool (in-process or on a tool server,
whichever the config chose), and its output is appended as context (mask 0) wrapped in the result
tags; then generation continues in the same turn. Text between the answer tags ends the episode
(``answered``, the text is the final answer); a turn that ends with neither code nor an answer
ends it as ``no_tool_call``. Optional *state masking* gives mask 0 to model tokens inside
configured marker pairs (text the model writes as working state, kept as context, not trained).
Token and character positions are matched by decoding prefixes of the turn's own ids, never by
re-encoding text.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from common.config.agents import CodeAgentConfig
from common.logging import get_logger
from rollout_service.agents.base import AGENTS, AgentDeps, generate_turn, start
from rollout_service.agents.episode import Episode, State
from rollout_service.tools.base import ToolContext, ToolResult
from rollout_service.tools.limited import call_tool

log = get_logger("agent.code")

SYSTEM_PROMPT = (
    "Solve the task. To run Python, write it between {cs} and {ce}; its output comes back between "
    "{rs} and {re}. Give the final answer between {as_} and {ae}."
)


def between(text: str, start: str, end: str) -> str | None:
    """The text between the last ``start`` and the ``end`` after it; None if there is no such pair."""
    i = text.rfind(start)
    if i < 0:
        return None
    j = text.find(end, i + len(start))
    return None if j < 0 else text[i + len(start) : j]


def char_spans(text: str, markers: list[tuple[str, str]]) -> list[tuple[int, int]]:
    """[start, end) character spans from each start marker through its end marker (or the text's
    end when it is not closed)."""
    spans = []
    for opening, closing in markers:
        i = text.find(opening)
        while i >= 0:
            j = text.find(closing, i + len(opening))
            stop = len(text) if j < 0 else j + len(closing)
            spans.append((i, stop))
            i = text.find(opening, stop)
    return spans


def token_ends(decode: Any, ids: list[int]) -> list[int]:
    """Character offset just after each token in the decoded text of ``ids``."""
    return [len(decode(ids[: k + 1])) for k in range(len(ids))]


@AGENTS.register("code")
class CodeAgent:
    def __init__(self, deps: AgentDeps) -> None:
        self.o: CodeAgentConfig = deps.options if deps.options is not None else CodeAgentConfig()
        if "python" not in deps.tools:
            raise ValueError(
                "the code agent runs code with the python tool: it is missing from its tools"
            )
        self.python = deps.tools["python"]
        o = self.o
        system = deps.system_prompt or SYSTEM_PROMPT.format(
            cs=o.code_start_tag,
            ce=o.code_end_tag,
            rs=o.result_start_tag,
            re=o.result_end_tag,
            as_=o.answer_start_tag,
            ae=o.answer_end_tag,
        )
        self.deps = replace(
            deps,
            system_prompt=system,
            sampling=replace(deps.sampling, stop=(*deps.sampling.stop, o.code_end_tag)),
        )
        self.markers = [(m.start, m.end) for m in o.mask_spans]

    async def run(self, ep: Episode) -> None:
        ep.expect_actions("tool_calls", "tool_errors", "sandbox_runs", "sandbox_errors")
        if not start(ep, self.deps):
            return
        limits, o, failed = self.deps.limits, self.o, 0
        turn_text = ""  # the assistant turn so far (across sandbox interruptions)
        while ep.state is State.GENERATING:
            first = len(ep.response_ids)
            gen = await generate_turn(ep, self.deps)
            text = self.deps.renderer.turn_text(gen.token_ids) if gen is not None else ""
            turn_text += text
            if self.markers and gen is not None:
                self._mask_state(ep, first, gen.token_ids)
            if gen is None:
                self._close_transcript(ep, turn_text)
                return
            answer = between(text, o.answer_start_tag, o.answer_end_tag)
            ran_code = gen.stop_string == o.code_end_tag or text.rstrip().endswith(o.code_end_tag)
            if answer is not None or not ran_code:
                self._close_transcript(ep, turn_text)
                ep.final_answer = answer.strip() if answer is not None else None
                ep.terminate("answered" if answer is not None else "no_tool_call")
                return
            ep.goto(State.PROCESSING_TOOLS)
            result = await self._execute(ep, between(text, o.code_start_tag, o.code_end_tag))
            failed = 0 if result.ok else failed + 1
            shown = f"\n{o.result_start_tag}\n{result.text}\n{o.result_end_tag}\n"
            turn_text += shown
            if failed >= limits.max_consecutive_tool_errors:
                self._close_transcript(ep, turn_text)
                ep.terminate("tool_error")
                return
            if limits.max_assistant_turns is not None and ep.turns >= limits.max_assistant_turns:
                self._close_transcript(ep, turn_text)
                ep.terminate("max_turns")
                return
            ids = self.deps.renderer.text_ids(shown)
            if (
                len(ep.response_ids) + len(ids) >= limits.response_length
                or ep.context_len + len(ids) >= limits.max_model_len
            ):
                self._close_transcript(ep, turn_text)
                ep.terminate("length")
                return
            ep.add_tool(ids)
            ep.goto(State.GENERATING)

    async def _execute(self, ep: Episode, code: str | None) -> ToolResult:
        if code is None or not code.strip():
            result = ToolResult(
                f"error: no code between {self.o.code_start_tag} and {self.o.code_end_tag}",
                ok=False,
            )
        else:
            result = await self._call_python(ep, code)
        ep.record_call("python", result)  # a sandbox run too when the code reached the sandbox
        text = result.text
        limit = self.o.max_output_chars
        if len(text) > limit:
            text = text[: limit // 2] + "\n...(truncated)...\n" + text[len(text) - limit // 2 :]
        return replace(result, text=text)

    async def _call_python(self, ep: Episode, code: str) -> ToolResult:
        ctx = ToolContext(episode_id=ep.episode_id, row=ep.row, state=ep.tool_state)
        timeout = self.deps.limits.tool_timeout_s
        try:
            return await call_tool(self.python, {"code": code}, ctx, timeout)
        except TimeoutError:
            return ToolResult(f"error: the code took longer than {timeout:g} s", ok=False)
        except Exception as e:  # a bug in the tool must not end the server
            log.exception("python tool raised", episode=ep.episode_id)
            return ToolResult(f"error: {type(e).__name__}: {e}", ok=False)

    def _mask_state(self, ep: Episode, first: int, ids: list[int]) -> None:
        text = self.deps.renderer.decode(ids)
        spans = char_spans(text, self.markers)
        if not spans:
            return
        ends = token_ends(self.deps.renderer.decode, ids)
        for k, end in enumerate(ends):
            begin = ends[k - 1] if k else 0
            if any(begin < s_end and end > s_start for s_start, s_end in spans):
                ep.mask_out(first + k)

    @staticmethod
    def _close_transcript(ep: Episode, turn_text: str) -> None:
        ep.messages.append({"role": "assistant", "content": turn_text})
