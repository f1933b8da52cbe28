"""The agent state machine, the hermes parser and the tool / single-turn agents, on a scripted
engine and the tiny model's real tokenizer and chat template."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted import EchoTool, ScriptedEngine

from rollout_service.agents.base import AGENTS, AgentDeps, AgentLimits
from rollout_service.agents.episode import Episode, IllegalTransition, State
from rollout_service.agents.parsers import PARSERS, HermesParser
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.agents.tool_agent import truncate
from rollout_service.engine.base import Generation, SamplingSettings


def call(name: str, **args: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def make(
    renderer: ChatRenderer,
    engine: ScriptedEngine,
    tools: list[EchoTool],
    agent: str = "tool_agent",
    **limits: Any,
) -> Any:
    lim = {"response_length": 400, "max_model_len": 2048, **limits}
    deps = AgentDeps(
        engine=engine,
        renderer=renderer,
        sampling=SamplingSettings(max_tokens=1),
        limits=AgentLimits(**lim),
        tools={t.name: t for t in tools},
        parser=HermesParser(),
    )
    return AGENTS.get(agent)(deps)


def episode() -> Episode:
    return Episode(
        "ep1",
        "g1",
        {"question": "what is 6*7?", "answer": "42"},
        data_source="arith",
        agent_type="tool_agent",
    )


def check_aligned(ep: Episode) -> None:
    n = len(ep.response_ids)
    assert len(ep.mask) == len(ep.logprobs) == len(ep.versions) == n
    assert all(m in (0, 1) for m in ep.mask)
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.mask, strict=True) if m == 0)


# -- state machine ------------------------------------------------------------------------------------
def test_transitions_follow_the_diagram() -> None:
    ep = episode()
    with pytest.raises(IllegalTransition):
        ep.goto(State.PROCESSING_TOOLS)
    ep.goto(State.GENERATING)
    ep.goto(State.PROCESSING_TOOLS)
    ep.goto(State.GENERATING)
    ep.terminate("length")
    with pytest.raises(IllegalTransition):
        ep.goto(State.GENERATING)
    with pytest.raises(ValueError, match="unknown termination"):
        episode().terminate("bored")


def test_misaligned_engine_output_is_refused() -> None:
    with pytest.raises(ValueError, match="misaligned"):
        episode().add_model([1, 2], [-0.1], [0, 0])


# -- parser -------------------------------------------------------------------------------------------
def test_hermes_parser_finds_calls_and_reports_malformed_ones() -> None:
    p = PARSERS.get("hermes")()
    out = p.parse(
        'think <tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call> and '
        '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"2\\"}"}</tool_call>'
        '<tool_call>{not json}</tool_call><tool_call>{"arguments": {}}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in out.calls] == [
        ("calc", {"expr": "1+1"}),
        ("calc", {"expr": "2"}),
    ]
    assert len(out.errors) == 2 and "not valid JSON" in out.errors[0] and "'name'" in out.errors[1]
    assert out.content.startswith("think")
    assert p.parse("no calls here").attempted == 0
    assert "not closed" in p.parse('<tool_call>{"name": "x"').errors[0]


def test_truncation_sides() -> None:
    text = "a" * 50 + "b" * 50
    assert truncate(text, 200, "middle") == text
    assert truncate(text, 40, "right").startswith("a") and len(truncate(text, 40, "right")) == 40
    assert truncate(text, 40, "left").endswith("b") and len(truncate(text, 40, "left")) == 40
    mid = truncate(text, 40, "middle")
    assert mid.startswith("a") and mid.endswith("b") and len(mid) == 40


# -- agents -------------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_tool_episode_masks_tool_tokens_and_ends_on_finish(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    engine = ScriptedEngine(
        tokenizer, [call("echo", text="hello tool"), call("finish", answer="42")]
    )
    echo, finish = EchoTool(), EchoTool(name="finish", text="42", terminal=True)
    ep = episode()
    await make(renderer, engine, [echo, finish]).run(ep)
    assert ep.state is State.TERMINATED and ep.termination == "answered" and ep.final_answer == "42"
    assert (
        ep.turns == 2
        and ep.tool_calls == 2
        and ep.tool_errors == 0
        and echo.seen == [{"text": "hello tool"}]
    )
    check_aligned(ep)
    # Layout: [model turn 1 | tool delta | model turn 2]; tool span is exactly the rendered delta.
    turn1 = [
        *tokenizer.encode(call("echo", text="hello tool"), add_special_tokens=False),
        tokenizer.eos_token_id,
    ]
    delta = renderer.tool_delta_ids([{"role": "tool", "content": "hello tool"}])
    assert ep.response_ids[: len(turn1)] == turn1 and ep.mask[: len(turn1)] == [1] * len(turn1)
    assert ep.response_ids[len(turn1) : len(turn1) + len(delta)] == delta
    assert ep.mask[len(turn1) : len(turn1) + len(delta)] == [0] * len(delta)
    assert "hello tool" in renderer.decode(delta) and renderer.decode(delta).endswith(
        "<|im_start|>assistant\n"
    )
    # The second generation saw the whole context: prompt + turn 1 + tool delta.
    assert engine.calls[1][0] == ep.prompt_ids + turn1 + delta
    # Token-level context equals what the chat template renders for the transcript.
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant"]
    full = renderer.prompt_ids(ep.messages[:3], [echo.schema, finish.schema])
    assert full == ep.prompt_ids + turn1 + delta


@pytest.mark.anyio
async def test_no_tool_call_ends_episode(renderer: ChatRenderer, tokenizer: Any) -> None:
    ep = episode()
    await make(renderer, ScriptedEngine(tokenizer, ["The answer is 42."]), [EchoTool()]).run(ep)
    assert ep.termination == "no_tool_call" and ep.turns == 1 and set(ep.mask) == {1}


@pytest.mark.anyio
async def test_tool_errors_become_responses_then_end_the_episode(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    turns = [call("nope"), call("boom"), "<tool_call>{bad json}</tool_call>"]
    ep = episode()
    await make(
        renderer, ScriptedEngine(tokenizer, turns), [EchoTool(name="boom", raises=True)]
    ).run(ep)
    assert ep.termination == "tool_error" and ep.tool_errors == 3 and ep.turns == 3
    text = renderer.decode(ep.response_ids)
    assert "unknown tool 'nope'" in text and "RuntimeError: tool bug" in text
    check_aligned(ep)


@pytest.mark.anyio
async def test_parallel_call_limit_refuses_extra_calls(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    echo = EchoTool()
    turns = [call("echo", text="a") + call("echo", text="b") + call("echo", text="c"), "done"]
    ep = episode()
    await make(renderer, ScriptedEngine(tokenizer, turns), [echo], max_parallel_calls=2).run(ep)
    assert len(echo.seen) == 2 and ep.tool_calls == 3 and ep.tool_errors == 1
    assert "at most 2 tool calls per turn" in renderer.decode(ep.response_ids)


@pytest.mark.anyio
async def test_max_turns_and_budgets(renderer: ChatRenderer, tokenizer: Any) -> None:
    loop = [call("echo", text="x")] * 10
    ep = episode()
    await make(renderer, ScriptedEngine(tokenizer, loop), [EchoTool()], max_assistant_turns=2).run(
        ep
    )
    assert ep.termination == "max_turns" and ep.turns == 2

    ep = episode()
    await make(renderer, ScriptedEngine(tokenizer, loop), [EchoTool()], response_length=60).run(ep)
    assert ep.termination == "length" and len(ep.response_ids) <= 60

    ep = episode()
    engine = ScriptedEngine(tokenizer, ["a long answer " * 20])
    await make(renderer, engine, [], agent="single_turn", max_tokens_per_turn=5).run(ep)
    assert (
        ep.termination == "length"
        and len(ep.response_ids) == 5
        and engine.calls[0][1].max_tokens == 5
    )


@pytest.mark.anyio
async def test_long_tool_response_is_truncated(renderer: ChatRenderer, tokenizer: Any) -> None:
    ep = episode()
    engine = ScriptedEngine(tokenizer, [call("echo"), "ok"])
    await make(renderer, engine, [EchoTool(text="z" * 500)], max_tool_response_length=50).run(ep)
    assert ep.messages[2]["role"] == "tool"
    assert ep.messages[2]["content"].count("z") < 50 and "truncated" in ep.messages[2]["content"]


@pytest.mark.anyio
async def test_aborted_generation_terminates_as_aborted(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    ep = episode()
    await make(
        renderer,
        ScriptedEngine(tokenizer, [Generation([5, 6], [-1.0, -2.0], [3, 3], "abort")]),
        [EchoTool()],
    ).run(ep)
    assert ep.termination == "aborted" and ep.versions == [3, 3]


@pytest.mark.anyio
async def test_trajectories_carry_the_episode(renderer: ChatRenderer, tokenizer: Any) -> None:
    ep = episode()
    await make(
        renderer,
        ScriptedEngine(tokenizer, [call("echo", text="t"), "fin"], version=7),
        [EchoTool()],
    ).run(ep)
    (t,) = ep.to_trajectories(reward=1.0, reward_extras={"acc": 1.0}, source_server="s1")
    assert t.trajectory_id == "ep1" and t.group_uid == "g1" and t.termination == "no_tool_call"
    assert t.num_turns == 2 and t.reward == 1.0 and t.versions.tolist() == [7] * len(t.versions)
    assert t.response_mask.dtype == np.uint8 and t.prompt_ids.tolist() == ep.prompt_ids


# -- property: alignment whatever the tools return -----------------------------------------------------
texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=300)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    replies=st.lists(st.tuples(texts, st.booleans()), min_size=1, max_size=4),
    budget=st.integers(min_value=20, max_value=400),
    parallel=st.integers(1, 3),
)
def test_buffers_stay_aligned_whatever_tools_return(
    renderer: ChatRenderer,
    tokenizer: Any,
    replies: list[tuple[str, bool]],
    budget: int,
    parallel: int,
) -> None:
    import anyio

    tools = [EchoTool(name=f"t{i}", text=text, ok=ok) for i, (text, ok) in enumerate(replies)]
    turns = ["".join(call(t.name) for t in tools)] * 3 + ["end"]
    ep = episode()
    agent = make(
        renderer,
        ScriptedEngine(tokenizer, turns),
        tools,
        response_length=budget,
        max_parallel_calls=parallel,
        max_tool_response_length=120,
    )
    anyio.run(agent.run, ep)
    assert ep.state is State.TERMINATED
    check_aligned(ep)
    assert len(ep.response_ids) <= budget
    (t,) = ep.to_trajectories(reward=0.0, reward_extras={}, source_server="s")
    assert len(t.response_ids) == len(t.response_mask) == len(t.rollout_logprobs) == len(t.versions)


# -- ReMax baseline -------------------------------------------------------------------------------------
def test_remax_group_carries_the_greedy_episodes_reward(renderer: ChatRenderer) -> None:
    """With remax, one extra greedy episode (temperature 0) is run and scored; its reward is every
    trajectory's baseline, and it is not itself shipped."""
    import anyio

    from rollout_service.groups import REMAX_BASELINE, RewardChoice, run_group
    from rollout_service.rewards import load_builtin_rewards

    load_builtin_rewards()
    engine = ScriptedEngine(renderer.tok, [])
    # sampled episodes answer wrong, the greedy one right: the baseline is 1, the rewards 0
    engine.respond = lambda _ctx: "42" if engine.calls[-1][1].temperature == 0 else "41"
    deps = AgentDeps(
        engine=engine,
        renderer=renderer,
        sampling=SamplingSettings(max_tokens=8),
        limits=AgentLimits(response_length=64, max_model_len=512),
    )
    row = {"question": "what is 6*7?", "answer": "42"}
    res = anyio.run(
        lambda: run_group(
            group_uid="g",
            row=row,
            n=3,
            agent_type="single_turn",
            data_source="arith",
            deps=deps,
            rewards=RewardChoice("math"),
            server_id="s",
            remax=True,
        )
    )
    assert len(res.trajectories) == 3
    assert [t.reward for t in res.trajectories] == [0.0, 0.0, 0.0]
    assert all(t.reward_extras[REMAX_BASELINE] == 1.0 for t in res.trajectories)
    assert sorted(s.temperature for _, s in engine.calls) == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.anyio
async def test_a_turn_ending_on_another_end_token_at_the_budget_stays_within_it(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    """The model stops on <|endoftext|> with the last token of the response budget: the turn is
    not closed with <|im_end|> then (nothing can follow, and one token more is a response the
    learner refuses as TOO_LARGE, with the whole batch). With room left, it is closed (mask 0)."""
    other_end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert other_end != renderer.eos_id
    for budget, closed in ((5, False), (6, True)):
        ids = [*list(renderer.text_ids("the answer is 8"))[:4], other_end]
        assert len(ids) == 5
        gen = Generation(ids, [0.0] * 5, [0] * 5, "stop")
        ep = episode()
        await make(
            renderer,
            ScriptedEngine(tokenizer, [gen]),
            [],
            agent="single_turn",
            response_length=budget,
        ).run(ep)
        assert len(ep.response_ids) == 5 + closed <= budget, (budget, ep.response_ids)
        assert (ep.response_ids[-1] == renderer.eos_id) == closed and ep.mask[:5] == [1] * 5


@pytest.mark.anyio
async def test_a_binding_rate_limit_paces_calls_instead_of_timing_them_out(
    renderer: ChatRenderer, tokenizer: Any, tmp_path: Any
) -> None:
    # The wait for a token once counted against tool_timeout_s, so under a binding limit calls
    # failed as "took longer than 30 s" long before acquire_timeout_s.
    from common.ratelimit import Bucket, GlobalRateLimiter
    from rollout_service.tools.limited import rate_limited

    limiter = GlobalRateLimiter(tmp_path / "rl", {"echo": Bucket(per_minute=240, burst=1)})
    tools = rate_limited({"echo": EchoTool()}, limiter)  # a token every 0.25 s
    turns = [call("echo", text="a") + call("echo", text="b"), call("echo", text="c"), "done"]
    agent = make(
        renderer, ScriptedEngine(tokenizer, turns), [], tool_timeout_s=0.1, max_parallel_calls=2
    )
    agent.deps.tools.update(tools)
    ep = episode()
    await agent.run(ep)
    assert ep.tool_calls == 3 and ep.tool_errors == 0, renderer.decode(ep.response_ids)
    # the call itself is still bounded by tool_timeout_s
    slow = make(renderer, ScriptedEngine(tokenizer, [call("echo"), "done"]), [], tool_timeout_s=0.1)
    slow.deps.tools["echo"] = SlowTool()
    ep = episode()
    await slow.run(ep)
    assert ep.tool_errors == 1 and "took longer than 0.1 s" in renderer.decode(ep.response_ids)


class SlowTool(EchoTool):
    async def call(self, args: dict[str, Any], ctx: Any) -> Any:
        import anyio

        await anyio.sleep(5)
        return await super().call(args, ctx)
