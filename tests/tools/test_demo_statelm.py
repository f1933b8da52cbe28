"""The StateLM demo: its warm-up demonstrations are the StateLM agent's own segments, token for
token (the real agent, fed only the demonstrations' model tokens, rebuilds every segment's prompt
and response), a deletion closes a segment whose successor's prompt shows the stub and the note
instead of the chunk, the budget ends an episode that keeps both chunks, the data and the builder
agree with configs/demo_statelm.yaml, and ``DEMO_AGENT=statelm bin/demo --help`` touches nothing."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from rollout_service.agents import load_builtin_agents
from rollout_service.agents.base import AgentDeps
from rollout_service.agents.episode import Episode
from rollout_service.agents.parsers import PARSERS
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.agents.statelm import StateLMAgent
from rollout_service.agents.statelm_context import STUB
from rollout_service.engine.base import Generation, SamplingSettings
from rollout_service.server import agent_limits, sampling_settings
from rollout_service.tools import load_builtin_tools
from rollout_service.tools.factory import build_local_tools
from tools.demos import Demonstration, build
from tools.demos.statelm import NOTE_KEY, load_demo_config, play_episode
from tools.demos.statelm_data import CHUNK_CHARS, fact_text, statelm_rows
from tools.make_tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> ChatRenderer:
    from transformers import AutoTokenizer

    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    return ChatRenderer(AutoTokenizer.from_pretrained(model))


@pytest.fixture(scope="module")
def config() -> Any:
    return load_demo_config()


class PieceEngine:
    """Hands back the demonstrations' model pieces, one per turn, and records each prompt."""

    def __init__(self, pieces: Sequence[list[int]]) -> None:
        self.pieces = list(pieces)
        self.prompts: list[list[int]] = []

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.pieces.pop(0)
        assert len(ids) <= sampling.max_tokens
        return Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop")

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


def tool_objects(config: Any) -> dict[str, Any]:
    registry = load_builtin_tools()
    return {name: registry.get(name)() for name in config.agents.statelm.tools}


def replay(demos: list[Demonstration], renderer: ChatRenderer, config: Any, row: dict) -> Episode:
    load_builtin_agents()
    engine = PieceEngine([p for d in demos for p in pieces(d)])
    deps = AgentDeps(
        engine=engine,
        renderer=renderer,
        sampling=sampling_settings(config),
        limits=agent_limits(config),
        tools=build_local_tools(config, config.agents.statelm.tools),
        parser=PARSERS.get("hermes")(),
        options=config.agents.statelm,
    )
    ep = Episode("replay", "g", row, agent_type="statelm")
    anyio.run(StateLMAgent(deps).run, ep)
    assert not engine.pieces  # every demonstrated turn was asked for
    return ep


def test_demonstrations_are_the_agents_segments(renderer: ChatRenderer, config: Any) -> None:
    row = statelm_rows(1, seed=3)[0]
    demos = build("statelm", [row], renderer, tool_objects(config))
    assert len(demos) == 2  # the deletion closed a segment: a snapshot and the final segment
    ep = replay(demos, renderer, config, row)
    assert (ep.termination, ep.final_answer) == ("answered", row["answer"])
    segments = ep.all_segments()
    assert [s.is_snapshot for s in segments] == [True, False]
    for demo, seg in zip(demos, segments, strict=True):
        assert demo.ids == seg.prompt_ids + seg.response_ids
        trained = [i + 1 for i, t in enumerate(demo.train) if t]
        assert trained == [len(seg.prompt_ids) + i for i, m in enumerate(seg.mask) if m]
    first, second = (renderer.decode(s.prompt_ids) for s in segments)
    fact = fact_text(row["project"], row["answer"])
    assert fact not in first and "External memory (notes): empty" in first
    assert fact in renderer.decode(segments[0].response_ids)  # read in the first segment
    # the second segment's prompt: the chunk is a stub, the number survives only as a note
    assert fact not in second and STUB in second
    assert f"- {NOTE_KEY}: {row['answer']}" in second
    assert '"name": "deleteContext", "arguments": {"msg_id": 3}' in second
    # the code comes back from external memory right before the answer
    last = renderer.decode(segments[1].response_ids)
    assert f'"tool": "readNote", "result": "{row["answer"]}"' in last


def test_guesses_note_a_wrong_code_and_answer_it(renderer: ChatRenderer, config: Any) -> None:
    rows = statelm_rows(8, seed=5)
    demos = build("statelm", rows, renderer, tool_objects(config), guess_fraction=1.0, seed=1)
    assert len(demos) == 2 * len(rows)
    text = "".join(renderer.decode(d.ids) for d in demos[1::2])  # the last segments: all of it
    noted = re.findall(r'"name": "note", "arguments": \{"key": "code", "summary": "([^"]*)"', text)
    answers = re.findall(r'"name": "finish", "arguments": \{"answer": "([^"]*)"\}', text)
    assert len(noted) == len(answers) == len(rows)
    assert noted == answers
    assert all(a != r["answer"] for a, r in zip(answers, rows, strict=True))


def test_the_budget_forces_deletion(renderer: ChatRenderer, config: Any) -> None:
    """Reading both chunks without deleting runs out of the segment's budget (with or without a
    note), while the demonstrated episode fits it: the task cannot be solved without deleting."""
    for i, row in enumerate(statelm_rows(24, seed=7)):
        for guess in (None, "X"):
            ep = play_episode(row, renderer, config, guess=guess, delete=False, episode_id=f"k{i}")
            assert ep.termination == "length", (i, guess)
            assert ep.final_answer is None


def test_data_and_config_agree(config: Any) -> None:
    assert config.agents.statelm.chunk_chars == CHUNK_CHARS
    assert config.data.agent_type == "statelm"
    sh = (REPO / "tools" / "demos" / "statelm.sh").read_text()
    assert f"tools={','.join(config.agents.statelm.tools)} " in sh
    for row in statelm_rows(16, seed=0):
        text = row["documents"][0]["text"]
        assert len(text) == 2 * CHUNK_CHARS
        chunk = text[row["fact_chunk"] * CHUNK_CHARS :][:CHUNK_CHARS]
        assert fact_text(row["project"], row["answer"]) in chunk  # never cut by chunking
        assert text.endswith(f"project {row['project']}?")


@pytest.mark.integration
def test_demo_help_touches_nothing(tmp_path: Path) -> None:
    """bin/demo answers --help before choosing the agent; the script's own --help says what the
    StateLM demo does. Neither makes nor deletes anything."""
    env = {**os.environ, "DEMO_DIR": str(tmp_path / "d"), "DEMO_AGENT": "statelm"}
    for cmd in (
        [str(REPO / "bin" / "demo"), "trainer.total_training_steps=2"],
        ["bash", str(REPO / "tools" / "demos" / "statelm.sh"), "trainer.total_training_steps=2"],
    ):
        for flag in ("--help", "-h"):
            result = subprocess.run(
                [*cmd, flag], env=env, capture_output=True, text=True, timeout=60
            )
            assert result.returncode == 0, result.stderr
            assert "statelm" in result.stdout and "usage: train" in result.stdout
            assert not (tmp_path / "d").exists()
    assert "DEMO_AGENT=statelm bin/demo" in result.stdout
