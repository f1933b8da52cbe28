"""The mixed demo: its warm-up demonstrations are the agents' own episodes, token for token (a
search episode driven through the real tool agent with the demonstration's turns, search served
by the real BM25 tool), right ones earn their source's reward, the data holds the batch's 4/3/3
mix, and ``DEMO_AGENT=mixed bin/demo --help`` prints without making or deleting anything."""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import anyio
import pytest

from common.config import Config
from common.config.loader import load_config
from rollout_service.agents import load_builtin_agents
from rollout_service.agents.base import AgentDeps, AgentLimits, deps_for
from rollout_service.agents.episode import Episode
from rollout_service.agents.parsers import HermesParser
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.agents.tool_agent import ToolAgent
from rollout_service.engine.base import Generation, SamplingSettings
from rollout_service.rewards.base import EpisodeView
from rollout_service.rewards.qa import qa_f1_reward
from rollout_service.server import build_agent_deps
from tools.demos import Demonstration
from tools.demos.mixed import build_demonstrations
from tools.demos.mixed_data import make_mixed_data
from tools.make_tiny_model import make_tiny_model
from tools.warmup import load_rows

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> ChatRenderer:
    from transformers import AutoTokenizer

    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    return ChatRenderer(AutoTokenizer.from_pretrained(model))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mixed_data(tmp_path_factory.mktemp("mixed"), train=20, val=2)


@pytest.fixture(scope="module")
def config(data: Path) -> Config:
    return load_config(
        REPO / "configs" / "demo_mixed.yaml",
        [f"tools.search.corpus={data / 'qa' / 'corpus.jsonl'}"],
        check_paths=False,
    )


class TurnEngine:
    """Hands back the demonstration's model turns, each ending with the end token."""

    def __init__(self, turns: Sequence[list[int]]) -> None:
        self.turns = list(turns)

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:
        ids = self.turns.pop(0)
        return Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop")

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass


def turns(demo: Demonstration) -> list[list[int]]:
    out: list[list[int]] = []
    for i, trained in enumerate(demo.train):
        if trained:
            if i == 0 or not demo.train[i - 1]:
                out.append([])
            out[-1].append(demo.ids[i + 1])
    return out


def test_the_data_holds_the_batch_mix(data: Path) -> None:
    rows = load_rows(data / "warmup.jsonl", 1000)
    for start in range(0, len(rows) - 9, 10):
        assert Counter(r["data_source"] for r in rows[start : start + 10]) == {
            "arithmetic": 4,
            "qa": 3,
            "code": 3,
        }
    assert {r["agent"] for r in rows if r["data_source"] == "code"} == {"code"}
    val = load_rows(data / "val.jsonl", 100)
    assert Counter(r["data_source"] for r in val) == {"arithmetic": 2, "qa": 2, "code": 2}


@pytest.mark.integration
def test_a_tool_agent_demonstration_is_the_agents_episode(
    renderer: ChatRenderer, data: Path, config: Config
) -> None:
    """Arithmetic and search rows, each replayed through the tool agent with the deps the rollout
    server gives its source (``data.datasets[].tools``: only calculator and finish, or search and
    finish, in the prompt)."""
    rows = [r for r in load_rows(data / "warmup.jsonl", 40)][:10]
    demos = build_demonstrations(rows, renderer, {}, config=config)
    assert len(demos) == len(rows)
    mt = config.actor_rollout_ref.rollout.multi_turn
    base = AgentDeps(
        engine=TurnEngine([]),  # pyright: ignore[reportArgumentType]
        renderer=renderer,
        sampling=SamplingSettings(max_tokens=64),
        limits=AgentLimits(
            response_length=256,
            max_model_len=1024,
            max_assistant_turns=3,
            max_tool_response_length=mt.max_tool_response_length,
        ),
        parser=HermesParser(),
    )
    in_process = load_config(  # the same tools, built here instead of on a tool server
        REPO / "configs" / "demo_mixed.yaml",
        [f"tools.search.corpus={data / 'qa' / 'corpus.jsonl'}", "tools.remote.url=null"],
        check_paths=False,
    )
    by_source = build_agent_deps(in_process, base, {"tool_agent"}, None)
    load_builtin_agents()
    seen: Counter[str] = Counter()
    for row, demo in zip(rows, demos, strict=True):
        source = row["data_source"]
        if source == "code":
            continue
        deps = deps_for(by_source, "tool_agent", source)
        assert (
            list(deps.tools)
            == {"arithmetic": ["calculator", "finish"], "qa": ["search", "finish"]}[source]
        )
        agent = ToolAgent(replace(deps, engine=TurnEngine(turns(demo))))
        ep = Episode("e1", "g1", row, agent_type="tool_agent")
        anyio.run(agent.run, ep)
        # arithmetic: the calculator, then the boxed number; qa: search, then finish
        assert ep.tool_calls == {"arithmetic": 1, "qa": 2}[source] and ep.tool_errors == 0
        assert ep.prompt_ids + ep.response_ids == demo.ids
        n = len(ep.prompt_ids)
        assert [bool(m) for m in ep.mask] == demo.train[n - 1 : len(demo.ids) - 1]
        seen[source] += 1
        if source != "qa":
            continue
        assert ep.termination == "answered"
        view = EpisodeView(
            response_text=renderer.decode(ep.response_ids),
            final_answer=ep.final_answer,
            messages=ep.messages,
            termination=ep.termination or "",
            num_turns=ep.turns,
            tool_calls=ep.tool_calls,
        )
        assert anyio.run(qa_f1_reward, view, row).score == 1.0
    assert seen["arithmetic"] and seen["qa"]


@pytest.mark.integration
def test_every_source_is_demonstrated_by_its_agent(
    renderer: ChatRenderer, data: Path, config: Config
) -> None:
    rows = load_rows(data / "warmup.jsonl", 10)
    demos = build_demonstrations(rows, renderer, {}, config=config)
    for row, demo in zip(rows, demos, strict=True):
        text = renderer.decode(demo.ids)
        marker = {"arithmetic": '"calculator"', "qa": '"search"', "code": "<code>\nprint("}
        assert marker[row["data_source"]] in text and demo.answer == str(row["answer"])
    guesses = build_demonstrations(rows, renderer, {}, guess_fraction=1.0, config=config)
    for row, demo in zip(rows, guesses, strict=True):
        text = renderer.decode(demo.ids[demo.train.index(True) + 1 :])  # what the model wrote
        assert "<tool_response>" not in text and "<execution_results>" not in text
        assert demo.answer != str(row["answer"])


@pytest.mark.integration
def test_demo_mixed_help_touches_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "DEMO_DIR": str(tmp_path), "DEMO_AGENT": "mixed"}
    for command in ([str(REPO / "bin" / "demo"), "--help"], ["bash", "tools/demos/mixed.sh", "-h"]):
        result = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert "DEMO_AGENT" in result.stdout and "usage: train" in result.stdout
        assert list(tmp_path.iterdir()) == []  # no model, data or run made
    assert "tool server" in result.stdout and "configs/demo_mixed.yaml" in result.stdout
