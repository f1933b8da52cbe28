"""The code-execution agent with custom tags, on a scripted engine and the real sandbox: code runs
mid-turn, its output is context (mask 0) inside the result tags, the answer tags end the episode,
and state masking takes configured spans out of the loss."""

from __future__ import annotations

from typing import Any

import pytest
from scripted import ScriptedEngine

from common.config.agents import CodeAgentConfig, MaskSpan
from rollout_service.agents import load_builtin_agents
from rollout_service.agents.base import AgentDeps, AgentLimits
from rollout_service.agents.code_agent import CodeAgent, char_spans
from rollout_service.agents.episode import Episode
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.engine.base import SamplingSettings
from rollout_service.tools.base import TOOLS

TAGS = CodeAgentConfig(
    code_start_tag="[[py]]",
    code_end_tag="[[/py]]",
    result_start_tag="<<out>>",
    result_end_tag="<</out>>",
    answer_start_tag="<<ans>>",
    answer_end_tag="<</ans>>",
)


def agent(
    renderer: ChatRenderer, engine: Any, options: CodeAgentConfig = TAGS, **limits: Any
) -> CodeAgent:
    load_builtin_agents()
    lim = {"response_length": 600, "max_model_len": 2048, "max_assistant_turns": 6, **limits}
    return CodeAgent(
        AgentDeps(
            engine=engine,
            renderer=renderer,
            sampling=SamplingSettings(max_tokens=1),
            limits=AgentLimits(**lim),
            tools={"python": TOOLS.get("python")(timeout_s=5.0)},
            options=options,
        )
    )


def episode() -> Episode:
    return Episode("c1", "g", {"question": "What is 6*7?", "answer": "42"}, agent_type="code")


def spans(ep: Episode, renderer: ChatRenderer) -> list[tuple[int, str]]:
    """The response as runs of (mask, text)."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(ep.response_ids, ep.mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return [(m, renderer.decode(ids)) for m, ids in out]


@pytest.mark.anyio
@pytest.mark.integration
async def test_code_runs_mid_turn_and_the_answer_ends_the_episode(renderer: ChatRenderer) -> None:
    turns = ["Let me compute. [[py]]print(6 * 7)[[/py]]", "So it is 42. <<ans>>42<</ans>>"]
    engine = ScriptedEngine(renderer.tok, turns)
    ep = episode()
    await agent(renderer, engine).run(ep)
    assert ep.termination == "answered" and ep.final_answer == "42"
    assert ep.tool_calls == 1 and ep.tool_errors == 0
    assert spans(ep, renderer) == [
        (1, turns[0]),
        (0, "\n<<out>>\n42\n<</out>>\n"),
        (1, turns[1] + renderer.tok.eos_token),
    ]
    # The continuation is generated from the same turn: prompt + code + output, no template tokens.
    (p0, s0), (p1, _) = engine.calls
    assert "[[/py]]" in s0.stop
    assert p1 == p0 + ep.response_ids[: len(p1) - len(p0)] and len(p1) - len(p0) < len(
        ep.response_ids
    )
    assert ep.messages[-1]["content"] == turns[0] + "\n<<out>>\n42\n<</out>>\n" + turns[1]


@pytest.mark.anyio
@pytest.mark.integration
async def test_errors_are_shown_and_repeated_failures_end_the_episode(
    renderer: ChatRenderer,
) -> None:
    turns = ["[[py]]1/0[[/py]]", "[[py]]print(undefined)[[/py]]", "[[/py]]"]
    ep = episode()
    await agent(renderer, ScriptedEngine(renderer.tok, turns)).run(ep)
    assert ep.termination == "tool_error" and ep.tool_errors == 3
    outputs = [text for m, text in spans(ep, renderer) if m == 0]
    assert "ZeroDivisionError" in outputs[0] and "NameError" in outputs[1]
    assert len(outputs) == 2  # the third failure ends the episode before its output is appended
    assert "no code between [[py]] and [[/py]]" in ep.messages[-1]["content"]


@pytest.mark.anyio
async def test_a_turn_without_code_or_answer_ends_as_no_tool_call(renderer: ChatRenderer) -> None:
    ep = episode()
    await agent(renderer, ScriptedEngine(renderer.tok, ["I think it is 42."])).run(ep)
    assert ep.termination == "no_tool_call" and ep.final_answer is None and ep.tool_calls == 0


@pytest.mark.anyio
@pytest.mark.integration
async def test_state_masking_takes_marked_spans_out_of_the_loss(renderer: ChatRenderer) -> None:
    options = TAGS.model_copy(update={"mask_spans": [MaskSpan(start="<state>", end="</state>")]})
    turns = [
        "Plan <state>x=6, y=7</state> then [[py]]print(6 * 7)[[/py]]",
        "Done <<ans>>42<</ans>>",
    ]
    ep = episode()
    await agent(renderer, ScriptedEngine(renderer.tok, turns), options).run(ep)
    runs = spans(ep, renderer)
    masked = "".join(text for m, text in runs if m == 0)
    trained = "".join(text for m, text in runs if m == 1)
    assert "x=6, y=7" in masked and "x=6" not in trained
    assert trained.startswith("Plan") and "then [[py]]print(6 * 7)[[/py]]" in trained
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.mask, strict=True) if m == 0)


def test_char_spans() -> None:
    assert char_spans("a<s>b</s>c<s>d", [("<s>", "</s>")]) == [(1, 9), (10, 14)]
    assert char_spans("nothing", [("<s>", "</s>")]) == []


def test_the_code_agent_needs_the_python_tool(renderer: ChatRenderer) -> None:
    with pytest.raises(ValueError, match="python tool"):
        CodeAgent(
            AgentDeps(
                engine=None,
                renderer=renderer,
                sampling=SamplingSettings(max_tokens=1),
                limits=AgentLimits(response_length=10, max_model_len=100),
            )
        )
