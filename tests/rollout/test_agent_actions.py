"""What agents did, counted per episode (``Trajectory.actions``): tool calls per tool (made-up names
folded into ``other``), sandbox runs and errors, StateLM snapshots and deletions, carried once per
episode on its final trajectory, and summed by the rollout server's statistics."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest
from scripted import EchoTool, ScriptedEngine
from test_agent_loop import call, episode, make
from test_code_agent import agent as code_agent
from test_code_agent import episode as code_episode
from test_statelm import SCRIPT, run_episode, scripted

from common.config.agents import StateLMConfig
from rollout_service.agents.episode import SANDBOX_METRIC
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.metrics import RolloutStats
from rollout_service.rewards.base import RewardResult
from rollout_service.tools.base import ToolContext, ToolResult


@dataclass
class FakeSandboxTool(EchoTool):
    """A tool whose results say they ran in the sandbox (as tools.python_exec's do)."""

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        res = await super().call(args, ctx)
        return ToolResult(res.text, ok=self.ok, metrics={SANDBOX_METRIC: 0.01})


@pytest.mark.anyio
async def test_tool_calls_are_counted_per_tool_and_unknown_names_fold_into_other(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    turns = [
        call("echo", text="a"),
        call("nope"),  # not a tool of this agent
        "<tool_call>{bad json}</tool_call>",  # no name at all
        call("python", code="1/0"),
        "done",
    ]
    ep = episode()
    tools = [EchoTool(), FakeSandboxTool(name="python", ok=False)]
    await make(renderer, ScriptedEngine(tokenizer, turns), tools).run(ep)
    (traj,) = ep.to_trajectories(reward=0.0, reward_extras={}, source_server="s")
    assert traj.actions == {
        "tool_calls": 4,
        "tool_errors": 3,
        "tool_calls/echo": 1,
        "tool_calls/other": 2,
        "tool_calls/python": 1,
        "sandbox_runs": 1,
        "sandbox_errors": 1,
    }


@pytest.mark.anyio
async def test_an_episode_without_calls_reports_zero_and_single_turn_reports_nothing(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    ep = episode()
    await make(renderer, ScriptedEngine(tokenizer, ["42"]), [EchoTool()]).run(ep)
    assert ep.action_counts() == {"tool_calls": 0, "tool_errors": 0}
    ep = episode()
    await make(renderer, ScriptedEngine(tokenizer, ["42"]), [], agent="single_turn").run(ep)
    (traj,) = ep.to_trajectories(reward=0.0, reward_extras={}, source_server="s")
    assert traj.actions == {}


@pytest.mark.anyio
@pytest.mark.integration
async def test_code_agent_counts_sandbox_runs_and_errors(renderer: ChatRenderer) -> None:
    turns = ["[[py]]print(6 * 7)[[/py]]", "[[py]]1/0[[/py]]", "[[/py]]", "<<ans>>42<</ans>>"]
    ep = code_episode()
    await code_agent(renderer, ScriptedEngine(renderer.tok, turns)).run(ep)
    (traj,) = ep.to_trajectories(reward=1.0, reward_extras={}, source_server="s")
    # the third piece has no code: a failed python call, but nothing reached the sandbox
    assert traj.actions == {
        "tool_calls": 3,
        "tool_errors": 2,
        "tool_calls/python": 3,
        "sandbox_runs": 2,
        "sandbox_errors": 1,
    }


@pytest.mark.anyio
async def test_statelm_counts_snapshots_and_deletions_once_per_episode(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    agent, ep = await run_episode(renderer, scripted(tokenizer))
    trajs = agent.trajectories(ep, RewardResult(1.0), "srv")
    assert [t.is_snapshot for t in trajs] == [True, True, False]
    assert [t.actions for t in trajs[:2]] == [{}, {}]  # snapshots carry nothing
    final = trajs[-1].actions
    assert (final["snapshots"], final["deletions"]) == (2, 2)
    assert final["tool_calls"] == len(SCRIPT) and final["tool_calls/deleteContext"] == 2
    # Keeping fewer segments changes nothing: the final one is always kept and carries the episode.
    opts = StateLMConfig(max_segments=1)
    agent, ep = await run_episode(renderer, scripted(tokenizer), options=opts)
    (only,) = agent.trajectories(ep, RewardResult(1.0), "srv")
    assert only.actions == final


@pytest.mark.anyio
async def test_a_deletion_refused_or_in_the_last_turn_is_counted_right(
    renderer: ChatRenderer, tokenizer: Any
) -> None:
    script = [
        call("deleteContext", msg_id=1),  # the task: refused, no deletion
        call("loadDocument", doc_id=0),
        call("deleteContext", msg_id=3),  # a snapshot
        call("finish", answer="7"),
    ]
    agent, ep = await run_episode(renderer, scripted(tokenizer, script))
    final = agent.trajectories(ep, RewardResult(0.0), "srv")[-1].actions
    assert (final["snapshots"], final["deletions"], final["tool_errors"]) == (1, 1, 1)


def test_rollout_stats_count_actions_per_tool_and_source() -> None:
    stats = RolloutStats(server_id="rs-1")
    stats.episode_started()
    stats.episode_started()
    actions = {"tool_calls": 3, "tool_errors": 1, "tool_calls/python": 2, "tool_calls/other": 1}
    stats.episode_finished(
        generated_tokens=5,
        turns=2,
        tool_calls=3,
        tool_errors=1,
        actions={**actions, "sandbox_runs": 2, "sandbox_errors": 1, "made_up": 9},
        data_source="code",
    )
    stats.episode_finished(
        generated_tokens=5,
        turns=2,
        actions={"snapshots": 2, "deletions": 3, "tool_calls": 0, "tool_errors": 0},
        data_source="longdoc",
    )
    c = stats.counters
    assert (c.sandbox_runs, c.sandbox_errors, c.snapshots, c.deletions) == (2, 1, 2, 3)
    assert stats.tool_calls_by_tool == {"python": 2, "other": 1}
    assert stats.tool_calls_by_source == {"code": 3}
    line = stats.stats_line()
    assert "sandbox 2 runs 1 errors" in line and "snapshots 2 deletions 3" in line
    port = stats.start_metrics_server(0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body = r.read().decode()
    finally:
        stats.stop_metrics_server()
    for sample in [
        'rollout_sandbox_runs_total{server_id="rs-1"} 2.0',
        'rollout_snapshots_total{server_id="rs-1"} 2.0',
        'rollout_deletions_total{server_id="rs-1"} 3.0',
        'rollout_tool_calls_by_tool_total{server_id="rs-1",tool="python"} 2.0',
        'rollout_tool_calls_by_source_total{data_source="code",server_id="rs-1"} 3.0',
    ]:
        assert sample in body, (sample, body)
