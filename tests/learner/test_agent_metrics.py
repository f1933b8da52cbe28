"""learner.agent_metrics: per-episode means of the trajectories' action counts, each episode counted
once however many snapshots it shipped, keys bounded by the config; the console's step line and the
plot's agent panel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from common.config.loader import load_config
from common.console_format import agent_parts, step_line
from learner.agent_metrics import KnownNames, agent_metrics
from protocol.trajectory import Trajectory
from tools.plot import PANELS, panel_series, plot_run

KNOWN = KnownNames.of(tools={"deleteContext", "note", "python", "calculator"}, sources={"longdoc"})


def traj(tid: str, *, source: str = "longdoc", snapshot: bool = False, **actions: float) -> Any:
    return Trajectory(
        trajectory_id=tid,
        group_uid="g",
        prompt_ids=np.zeros(2, np.int32),
        response_ids=np.zeros(1, np.int32),
        response_mask=np.ones(1, np.uint8),
        rollout_logprobs=np.zeros(1, np.float32),
        versions=np.zeros(1, np.int32),
        is_snapshot=snapshot,
        data_source=source,
        actions={k.replace("__", "/"): v for k, v in actions.items()},
    )


def test_statelm_episodes_are_counted_once_whatever_their_snapshots() -> None:
    trajs = [
        # episode a: two snapshots shipped, its final segment carries the counts
        traj("a-0", snapshot=True),
        traj("a-1", snapshot=True),
        traj("a-2", snapshots=2, deletions=3, tool_calls=6, tool_errors=1, tool_calls__note=6),
        # episode b: no deletion, one trajectory
        traj("b", snapshots=0, deletions=0, tool_calls=2, tool_errors=0, tool_calls__note=2),
    ]
    m = agent_metrics(trajs, KNOWN)
    assert m == {
        "agent/episodes": 2.0,
        "agent/tool_calls_per_episode": 4.0,
        "agent/tool_errors_per_episode": 0.5,
        "agent/snapshots_per_episode": 1.0,
        "agent/deletions_per_episode": 1.5,
        "agent/tool_calls/note": 4.0,
        "agent/tool_calls_by_source/longdoc": 4.0,
    }
    assert all(type(v) is float for v in m.values())


def test_names_outside_the_config_fold_into_other_and_unknown_counts_are_ignored() -> None:
    trajs = [
        traj("a", source="mars", tool_calls=50, made_up=7),
        traj("b", source="longdoc", tool_calls=1, tool_calls__python=1, sandbox_runs=1),
        traj("c", source="venus"),  # no actions (an older peer): counts 0
    ]
    trajs[0].actions |= {f"tool_calls/t{i}": 1.0 for i in range(50)}  # made-up tool names
    m = agent_metrics(trajs, KNOWN)
    assert m["agent/tool_calls/other"] == 50 / 3 and m["agent/tool_calls/python"] == 1 / 3
    assert m["agent/sandbox_runs_per_episode"] == 1 / 3
    assert m["agent/tool_calls_by_source/other"] == 25.0  # mars and venus: 50 calls, 2 episodes
    assert m["agent/tool_calls_by_source/longdoc"] == 1.0
    assert not any("made_up" in k or "mars" in k or "/t1" in k for k in m)
    assert len(m) == 7


def test_no_actions_no_keys_and_no_source_no_per_source_keys() -> None:
    assert agent_metrics([traj("a"), traj("b", snapshot=True)], KNOWN) == {}
    m = agent_metrics([traj("a", source="", tool_calls=1)], KNOWN)
    assert not any("by_source" in k for k in m) and m["agent/tool_calls_per_episode"] == 1.0


def test_known_names_come_from_the_config() -> None:
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.path=unused",
            "actor_rollout_ref.rollout.multi_turn.tools=[calculator,finish]",
            "data.datasets=[{name: math, path: a.jsonl, ratio: 0.5},"
            " {name: code, path: b.jsonl, ratio: 0.5, agent_type: code}]",
        ],
        check_paths=False,
    )
    known = KnownNames.from_config(cfg)
    assert {"calculator", "finish", "python", "deleteContext", "readChunk"} <= known.tools
    assert known.sources == {"math", "code"}
    assert (known.tool("rm -rf"), known.source("math"), known.source("")) == (
        "other",
        "math",
        "unknown",
    )


def test_step_line_shows_agent_actions_compactly() -> None:
    statelm = {
        "reward/mean": 0.5,
        "agent/episodes": 8.0,
        "agent/snapshots_per_episode": 1.25,
        "agent/deletions_per_episode": 2.0,
        "agent/tool_calls_per_episode": 6.0,
        "agent/tool_calls/readChunk": 3.0,
        "agent/tool_calls/deleteContext": 2.0,
        "agent/tool_calls/note": 0.5,
        "agent/tool_calls/finish": 0.5,
        "agent/tool_calls_by_source/longdoc": 6.0,
    }
    line = step_line(1, 2, statelm).plain
    assert "snap 1.25/ep (del 2)" in line
    assert "tools 6/ep (readChunk 3 deleteContext 2 note 0.5)" in line
    code = {"agent/episodes": 8.0, "agent/sandbox_runs_per_episode": 0.5}
    code |= {"agent/sandbox_errors_per_episode": 0.125, "agent/tool_calls_per_episode": 0.0}
    assert agent_parts(code) == [("sbx", "4 (1 err)")]  # no tool calls: no tools part
    assert agent_parts({"reward/mean": 1.0}) == []


def test_plot_draws_an_agent_panel_only_when_there_are_agent_metrics(tmp_path: Path) -> None:
    panel = next(p for p in PANELS if p.title.startswith("agent actions"))
    records = [
        {"step": s, "time": 1.0, "reward/mean": 0.1, "agent/snapshots_per_episode": 0.5 * s}
        | {"agent/tool_calls/note": 1.0, "agent/tool_calls_by_source/longdoc": 2.0}
        for s in (1, 2)
    ]
    assert list(panel_series(records, panel)) == [
        "agent/snapshots_per_episode",
        "agent/tool_calls/note",
        "agent/tool_calls_by_source/longdoc",
    ]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_run(run).read_bytes()[:4] == b"\x89PNG"
    assert panel_series([{"step": 1, "reward/mean": 0.0}], panel) == {}
