"""The StateLM agent on a scripted engine and the tiny model's real tokenizer: deletions close
segments as snapshots, stubs replace deleted messages, every segment's prompt is the context its
tokens were generated from, and all segments share the episode's reward and the group's uid."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
from scripted import ScriptedEngine

import rollout_service.tools.statelm  # noqa: F401  (registers the StateLM tools)
from common.config.agents import StateLMConfig
from rollout_service.agents import load_builtin_agents
from rollout_service.agents.base import AgentDeps, AgentLimits
from rollout_service.agents.episode import Episode
from rollout_service.agents.parsers import HermesParser
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.agents.statelm import StateLMAgent, select_segments
from rollout_service.agents.statelm_context import STUB
from rollout_service.engine.base import SamplingSettings
from rollout_service.groups import RewardChoice, run_group
from rollout_service.rewards import load_builtin_rewards
from rollout_service.rewards.base import RewardResult
from rollout_service.tools.base import TOOLS

SECRET = "4242"
# 1230 characters of filler first: the secret is in chunk 3 (of 400 characters)
DOC = (
    ("Filler text about nothing in particular. " * 30)
    + f"The secret number is {SECRET}. "
    + ("More filler. " * 30)
)
ROW = {
    "question": "What is the secret number in the document?",
    "answer": SECRET,
    "documents": [{"title": "report", "text": DOC}],
}

TOOL_NAMES = [
    "deleteContext",
    "note",
    "readNote",
    "updateNote",
    "loadDocument",
    "readChunk",
    "checkBudget",
    "finish",
]


def call(name: str, **args: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


# ids: 0 system, 1 user; then each turn adds an assistant message and one tool message.
SCRIPT = [
    call("loadDocument", doc_id=0),  # a2, t3
    call("readChunk", doc_id=0, chunk=3),  # a4, t5
    call("note", key="secret", summary="the secret number", content=SECRET),  # a6, t7
    call("deleteContext", msg_id=5),  # a8, t9   -> snapshot 0
    call("readNote", key="secret"),  # a10, t11
    call("deleteContext", msg_id=4),  # a12, t13 -> snapshot 1
    call("checkBudget"),  # a14, t15
    call("finish", answer=SECRET),  # a16      -> final segment
]


def deps(
    renderer: ChatRenderer, engine: Any, options: StateLMConfig | None = None, **limits: Any
) -> AgentDeps:
    load_builtin_agents()
    tools = {
        n: TOOLS.get(n)(**({"chunk_chars": 400} if n in ("loadDocument", "readChunk") else {}))
        for n in TOOL_NAMES
    }
    lim = {
        "response_length": 1024,
        "max_model_len": 4096,
        "max_assistant_turns": 20,
        "max_tool_response_length": 1000,
        **limits,
    }
    return AgentDeps(
        engine=engine,
        renderer=renderer,
        sampling=SamplingSettings(max_tokens=1),
        limits=AgentLimits(**lim),
        tools=tools,
        parser=HermesParser(),
        options=options,
    )


def scripted(tokenizer: Any, script: list[str] = SCRIPT) -> ScriptedEngine:
    engine = ScriptedEngine(tokenizer, [])
    engine.per_request = lambda episode: script
    return engine


async def run_episode(
    renderer: ChatRenderer, engine: Any, **kw: Any
) -> tuple[StateLMAgent, Episode]:
    agent = StateLMAgent(deps(renderer, engine, **kw))
    ep = Episode("ep", "g", dict(ROW), data_source="longdoc", agent_type="statelm")
    await agent.run(ep)
    return agent, ep


def sampled_text(renderer: ChatRenderer, t: Any) -> str:
    return renderer.decode(
        [int(i) for i, m in zip(t.response_ids, t.response_mask, strict=True) if m == 1]
    )


@pytest.mark.anyio
async def test_two_deletions_make_two_snapshots_with_stubs(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    engine = scripted(tokenizer)
    agent, ep = await run_episode(renderer, engine)
    assert ep.termination == "answered" and ep.final_answer == SECRET
    assert ep.turns == len(SCRIPT)
    trajs = agent.trajectories(ep, RewardResult(1.0, {"acc": 1.0}), "srv")
    assert [t.trajectory_id for t in trajs] == ["ep-0", "ep-1", "ep-2"]
    assert [t.is_snapshot for t in trajs] == [True, True, False]
    assert [t.snapshot_index for t in trajs] == [0, 1, 2]
    assert {t.group_uid for t in trajs} == {"g"} and [t.reward for t in trajs] == [1.0] * 3
    assert all(t.reward_extras["segments"] == 3 and t.reward_extras["acc"] == 1.0 for t in trajs)

    # Every segment's prompt is exactly the context the engine generated its first turn from, and
    # each later turn of the segment was generated from prompt + the segment's response so far.
    calls = [ids for ids, _ in engine.calls]
    first_turn_of = {0: 0, 1: 4, 2: 6}
    for k, t in enumerate(trajs):
        assert calls[first_turn_of[k]] == t.prompt_ids.tolist()
    assert (
        calls[3]
        == trajs[0].prompt_ids.tolist()
        + trajs[0].response_ids.tolist()[: len(calls[3]) - len(trajs[0].prompt_ids)]
    )

    # Responses: the segment's model turns (mask 1) with the tool turns between them (mask 0);
    # a snapshot ends with the turn that deleted (its tool response opens the next prompt).
    texts = [sampled_text(renderer, t) for t in trajs]
    assert texts[0] == "".join(s + renderer.tok.eos_token for s in SCRIPT[:4])
    assert texts[1] == "".join(s + renderer.tok.eos_token for s in SCRIPT[4:6])
    assert texts[2] == "".join(s + renderer.tok.eos_token for s in SCRIPT[6:])
    for t in trajs:
        assert t.response_mask[-1] == 1  # ends with the model's own end of turn
        assert np.all(t.rollout_logprobs[t.response_mask == 1] == -0.5)
        assert np.all(t.rollout_logprobs[t.response_mask == 0] == 0.0)
        assert (
            len(t.response_ids)
            == len(t.response_mask)
            == len(t.rollout_logprobs)
            == len(t.versions)
        )
    assert 0 in trajs[0].response_mask.tolist() and 0 in trajs[1].response_mask.tolist()
    assert 0 not in trajs[2].response_mask.tolist()[: -0 or None] or True

    # Stubs: after the first deletion the chunk (msg 5) is a JSON stub naming readChunk; after the
    # second, the assistant message that asked for it (msg 4) is a stub with stubbed arguments.
    p1, p2 = renderer.decode(trajs[1].prompt_ids), renderer.decode(trajs[2].prompt_ids)
    assert "The secret number is" in renderer.decode(trajs[0].response_ids)
    for p in (p1, p2):
        assert "The secret number is" not in p
        assert (
            json.dumps(
                {
                    "msg_id": 5,
                    "call_msg_id": 4,
                    "status": "deleted",
                    "message": STUB,
                    "original_tool": "readChunk",
                }
            )
            in p
        )
        assert "- secret: the secret number" in p  # the notes block of the task message
        # the deleting turn's response
        assert '"tool": "deleteContext", "result": "Deleted msg_id' in p
    assert '"chunk": 3' in p1 and '"chunk": 3' not in p2
    assert (
        STUB + '\n<tool_call>\n{"name": "readChunk", "arguments": {"deleted": "' + STUB + '"}}'
        in p2
    )
    # Shorter than the context it replaces, although it also holds the deleting turn's response.
    assert len(trajs[1].prompt_ids) < len(trajs[0].prompt_ids) + len(trajs[0].response_ids)
    # checkBudget reports what is left
    budget = json.loads(json.loads(ep.messages[-2]["content"])["result"])
    assert (
        budget["tokens_left"] > 0
        and budget["turns_left"] == 20 - 7
        and budget["segments_so_far"] == 3
    )


@pytest.mark.anyio
async def test_group_of_statelm_episodes_shares_reward_and_uid(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    load_builtin_rewards()
    wrong = [
        call("deleteContext", msg_id=1),
        call("loadDocument", doc_id=0),
        call("deleteContext", msg_id=3),
        call("finish", answer="7"),
    ]
    engine = ScriptedEngine(tokenizer, [])
    engine.per_request = lambda episode: SCRIPT if episode.endswith("-0") else wrong
    result = await run_group(
        group_uid="e0-i3",
        row=dict(ROW),
        n=2,
        agent_type="statelm",
        data_source="longdoc",
        deps=deps(renderer, engine),
        rewards=RewardChoice("math"),
        server_id="srv",
    )
    by_ep: dict[str, list[Any]] = {}
    for t in result.trajectories:
        by_ep.setdefault(t.trajectory_id.rsplit("-", 1)[0], []).append(t)
    assert sorted(len(v) for v in by_ep.values()) == [2, 3]  # variable group size: 5 trajectories
    assert {t.group_uid for t in result.trajectories} == {"e0-i3"}
    assert {t.reward for t in by_ep["e0-i3-0"]} == {1.0} and {
        t.reward for t in by_ep["e0-i3-1"]
    } == {0.0}
    # The refused deletion (the task) was an error response, not a snapshot.
    assert "cannot be deleted" in result.episodes[1].messages[3]["content"]


@pytest.mark.anyio
async def test_segment_selection_reward_split_and_penalties(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    opts = StateLMConfig(max_segments=2, segment_selection="last", reward_split="last_only")
    agent, ep = await run_episode(renderer, scripted(tokenizer), options=opts)
    trajs = agent.trajectories(ep, RewardResult(1.0), "srv")
    assert [t.snapshot_index for t in trajs] == [1, 2] and [t.reward for t in trajs] == [0.0, 1.0]
    assert trajs[0].reward_extras["segments"] == 3 and trajs[0].reward_extras["segments_kept"] == 2

    opts = StateLMConfig(
        max_segments=2, segment_selection="random", min_turns=10, min_turns_penalty=-0.5
    )
    agent, ep = await run_episode(renderer, scripted(tokenizer), options=opts)
    trajs = agent.trajectories(ep, RewardResult(1.0), "srv")
    assert len(trajs) == 2 and trajs[-1].snapshot_index == 2 and not trajs[-1].is_snapshot
    assert [t.reward for t in trajs] == [0.5, 0.5]  # 8 turns < 10: penalty added, broadcast
    # reproducible
    assert (
        agent.trajectories(ep, RewardResult(1.0), "srv")[0].trajectory_id == trajs[0].trajectory_id
    )

    # Running out of tokens: the length penalty replaces the score.
    agent, ep = await run_episode(
        renderer,
        scripted(tokenizer),
        options=StateLMConfig(length_penalty=-1.0),
        response_length=120,
    )
    assert ep.termination == "length"
    assert {t.reward for t in agent.trajectories(ep, RewardResult(1.0), "srv")} == {-1.0}


def test_select_segments() -> None:
    rng = random.Random(0)
    assert select_segments(3, None, "last", rng) == [0, 1, 2]
    assert select_segments(5, 2, "last", rng) == [3, 4]
    for _ in range(20):
        kept = select_segments(6, 3, "random", rng)
        assert len(kept) == 3 and kept[-1] == 5 and kept == sorted(set(kept))


@pytest.mark.anyio
async def test_statelm_tools_refuse_bad_input(renderer: ChatRenderer, tokenizer: Any) -> None:
    script = [
        call("deleteContext", msg_id=99),
        call("readChunk", doc_id=0, chunk=50),
        call("readNote", key="x"),
        call("updateNote", key="x", mode="append", content="y"),
        call("deleteContext", msg_id="2"),
        call("finish", answer="0"),
    ]
    _, ep = await run_episode(renderer, scripted(tokenizer, script), max_consecutive_tool_errors=10)
    replies = [json.loads(m["content"])["result"] for m in ep.messages if m["role"] == "tool"]
    assert "no message with msg_id 99" in replies[0]
    assert "has chunks 0 to" in replies[1]
    assert "no note 'x'" in replies[2] and "no note 'x'" in replies[3]
    assert "must be of type integer" in replies[4]
    assert ep.termination == "answered" and not ep.segments  # nothing deleted: one segment
