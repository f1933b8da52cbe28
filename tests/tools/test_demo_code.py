"""The code demo: its warm-up demonstrations are the code agent's own episodes, token for token
(the real CodeAgent fed the demonstration's model pieces, with the real sandbox), their answers
pass the math reward, custom tags are used when configured, and
``DEMO_AGENT=code bin/demo --help`` prints without making or deleting anything."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from common.config.agents import CodeAgentConfig
from rollout_service.agents import load_builtin_agents
from rollout_service.agents.base import AgentDeps, AgentLimits
from rollout_service.agents.code_agent import CodeAgent
from rollout_service.agents.episode import Episode
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.engine.base import Generation, SamplingSettings
from rollout_service.rewards.base import EpisodeView
from rollout_service.rewards.math_answer import math_reward
from rollout_service.tools.base import TOOLS
from tools.demos import Demonstration, build
from tools.demos.code_data import compute_rows
from tools.make_tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
CUSTOM = CodeAgentConfig(
    code_start_tag="[[py]]",
    code_end_tag="[[/py]]",
    result_start_tag="<<out>>",
    result_end_tag="<</out>>",
    answer_start_tag="<<ans>>",
    answer_end_tag="<</ans>>",
)


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> ChatRenderer:
    from transformers import AutoTokenizer

    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    return ChatRenderer(AutoTokenizer.from_pretrained(model))


class PieceEngine:
    """Hands back the demonstration's model pieces as generations: each piece ends either with the
    end token or, mid-turn, with the code end tag (a stop string, as vLLM reports it)."""

    def __init__(self, pieces: Sequence[list[int]], eos: int, stop: str) -> None:
        self.pieces, self.eos, self.stop = list(pieces), eos, stop
        self.prompts: list[list[int]] = []

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.pieces.pop(0)
        stop = None if ids[-1] == self.eos else self.stop
        assert stop is None or stop in sampling.stop
        return Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop", stop_string=stop)

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass


def pieces(demo: Demonstration) -> list[list[int]]:
    """The runs of model tokens (the loss positions shifted by one) of a demonstration."""
    out: list[list[int]] = []
    for i, trained in enumerate(demo.train):
        if trained:
            if i == 0 or not demo.train[i - 1]:
                out.append([])
            out[-1].append(demo.ids[i + 1])
    return out


def play(
    renderer: ChatRenderer, demo: Demonstration, row: dict[str, Any], options: CodeAgentConfig
) -> Episode:
    load_builtin_agents()
    engine = PieceEngine(pieces(demo), renderer.eos_id, options.code_end_tag)
    agent = CodeAgent(
        AgentDeps(
            engine=engine,  # pyright: ignore[reportArgumentType]  (the two methods an agent uses)
            renderer=renderer,
            sampling=SamplingSettings(max_tokens=64),
            limits=AgentLimits(response_length=256, max_model_len=768, max_assistant_turns=3),
            tools={"python": TOOLS.get("python")(timeout_s=5.0)},
            options=options,
        )
    )
    ep = Episode("e1", "g1", row, agent_type="code")
    anyio.run(agent.run, ep)
    return ep


@pytest.mark.parametrize("options", [CodeAgentConfig(), CUSTOM], ids=["default-tags", "custom"])
@pytest.mark.integration
def test_a_demonstration_is_the_agents_episode_and_earns_the_reward(
    renderer: ChatRenderer, options: CodeAgentConfig
) -> None:
    from tools.demos.code import build_demonstrations

    rows = compute_rows(2, seed=3)
    demos = build_demonstrations(rows, renderer, {"python": TOOLS.get("python")()}, options=options)
    for row, demo in zip(rows, demos, strict=True):
        ep = play(renderer, demo, row, options)
        assert ep.termination == "answered" and ep.tool_calls == 1 and ep.tool_errors == 0
        # token for token what the agent built, and the loss exactly on its sampled tokens
        assert ep.prompt_ids + ep.response_ids == demo.ids
        n = len(ep.prompt_ids)
        assert [bool(m) for m in ep.mask] == demo.train[n - 1 : len(demo.ids) - 1]
        assert ep.final_answer == row["answer"] == demo.answer
        text = renderer.decode(ep.response_ids)
        assert options.code_start_tag in text and options.result_start_tag in text
        view = EpisodeView(
            response_text=text,
            final_answer=ep.final_answer,
            messages=ep.messages,
            termination=ep.termination or "",
            num_turns=ep.turns,
            tool_calls=ep.tool_calls,
        )
        assert anyio.run(math_reward, view, row).score == 1.0


def test_guesses_answer_without_code_and_wrong(renderer: ChatRenderer) -> None:
    rows = compute_rows(6, seed=1)
    demos = build(
        "code", rows, renderer, {"python": TOOLS.get("python")()}, guess_fraction=1.0, seed=0
    )
    for row, demo in zip(rows, demos, strict=True):
        ep = play(renderer, demo, row, CodeAgentConfig())
        assert ep.termination == "answered" and ep.tool_calls == 0
        assert ep.final_answer == demo.answer != row["answer"]


@pytest.mark.integration
def test_the_warmup_reads_the_tags_of_the_configured_file(
    renderer: ChatRenderer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        (REPO / "configs" / "demo_code.yaml")
        .read_text()
        .replace('"<code>"', '"[[py]]"')
        .replace('"</code>"', '"[[/py]]"')
    )
    monkeypatch.setenv("WARMUP_CONFIG", str(config))
    (demo,) = build("code", compute_rows(1, seed=0), renderer, {"python": TOOLS.get("python")()})
    text = renderer.decode(demo.ids)
    assert "[[py]]\nprint(" in text and "<code>" not in text


@pytest.mark.integration
def test_demo_code_help_touches_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "DEMO_DIR": str(tmp_path), "DEMO_AGENT": "code"}
    for command in ([str(REPO / "bin" / "demo"), "--help"], ["bash", "tools/demos/code.sh", "-h"]):
        result = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert "DEMO_AGENT" in result.stdout and "usage: train" in result.stdout
        assert list(tmp_path.iterdir()) == []  # no model, data or run made
    assert "code agent" in result.stdout and "configs/demo_code.yaml" in result.stdout
