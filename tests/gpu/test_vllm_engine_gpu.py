"""VllmEngine on CUDA in bfloat16 (official vLLM), tiny model with a bf16 checkpoint, no fakes.

One test per execution mode (eager; decode-only CUDA graphs without torch.compile, as the GPU
configs and ``bench/rollout.py --graphs`` run them), each with its own engine (~30-60 s to start on an H100): sampling with
logprobs and versions, a "keep" weight update of perturbed weights, an update landing in the middle
of generation (prefetched onto the device before the pause; on a vLLM without weight-version spans,
e.g. 0.24, the requests in flight are resubmitted under their first salt and find their KV cached),
an episode's next turn finding its KV from before a "keep" update, the original weights back giving
the original greedy output (under CUDA graphs this shows the reload wrote into the captured
tensors), and a shutdown that leaves no child process. Skipped without a GPU (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollout_service.engine.base import SamplingSettings
from rollout_service.engine.vllm_compat import vllm_info
from tools.make_tiny_model import (
    TinyModelSpec,
    bfloat16_bits_to_float32,
    make_tiny_model,
    to_bfloat16_bits,
)

pytestmark = [pytest.mark.gpu, pytest.mark.nightly]

PROMPT = [151, 33, 7, 42, 99, 5]
LONG = 1500  # tokens per request of the mid-generation update: seconds on an H100
GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # vLLM's AsyncLLM is asyncio-only


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-bf16") / "model", TinyModelSpec(dtype="bfloat16")
    )


def checkpoint_float32(model_dir: Path) -> dict[str, np.ndarray]:
    """The bf16 checkpoint's values as float32 (exact)."""
    from common.safetensors_buffers import load_dir

    out = {}
    for b in load_dir(model_dir):
        assert b.dtype == "bfloat16", (b.name, b.dtype)
        bits = np.frombuffer(b.data, dtype=np.uint16).reshape(b.shape)
        out[b.name] = bfloat16_bits_to_float32(bits)
    return out


def engine_stages_bfloat16() -> bool:
    """Whether ml_dtypes is installed (the GPU image has it) and the engine can stage its
    bfloat16 arrays (see test_engine_stages_bfloat16_arrays)."""
    try:
        import ml_dtypes

        from rollout_service.engine.vllm_weights import stage_safetensors

        with tempfile.TemporaryDirectory() as d:
            stage_safetensors([("probe", np.zeros(4, ml_dtypes.bfloat16))], d)
    except Exception:
        return False
    return True


def as_update(weights: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """bf16 arrays (ml_dtypes) where the engine can stage them, else float32 arrays of
    bf16-representable values: vLLM casts those to the model's bf16 exactly."""
    if not engine_stages_bfloat16():
        return [(k, bfloat16_bits_to_float32(to_bfloat16_bits(v))) for k, v in weights.items()]
    import ml_dtypes

    return [(k, to_bfloat16_bits(v).view(ml_dtypes.bfloat16)) for k, v in weights.items()]


def test_engine_stages_bfloat16_arrays(tmp_path: Path) -> None:
    """bf16 weights reach the engine as ml_dtypes.bfloat16 arrays (the rollout server decodes
    learner weights with np.frombuffer(..., dtype="bfloat16")): staging must write them as BF16
    with their bytes unchanged. No engine needed; gpu-marked because ml_dtypes is on the GPU
    image and not in the CPU environment."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from rollout_service.engine.vllm_weights import stage_safetensors

    values = np.array([[1.0, -2.5], [3.140625, 0.0078125]], np.float32)
    bits = to_bfloat16_bits(values)
    staged = stage_safetensors([("w", bits.view(ml_dtypes.bfloat16))], str(tmp_path))
    raw = (staged / "model.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    assert header["w"]["dtype"] == "BF16" and header["w"]["shape"] == [2, 2]
    start, end = header["w"]["data_offsets"]
    data = np.frombuffer(raw[8 + size + start : 8 + size + end], np.uint16).reshape(2, 2)
    np.testing.assert_array_equal(data, bits)


def perturbed(weights: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in weights.items()}


async def greedy(engine: Any, prompt: list[int], n: int, rid: str) -> tuple[list[int], list[int]]:
    gen = await engine.generate(
        rid, prompt, SamplingSettings(max_tokens=n, temperature=0.0, ignore_eos=True)
    )
    assert len(gen.token_ids) == n and gen.finish_reason == "length"
    return gen.token_ids, gen.versions


@pytest.mark.anyio
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
async def test_bf16_engine_generates_updates_and_shuts_down(bf16_model: Path, graphs: bool) -> None:
    import psutil

    from rollout_service.engine.vllm_engine import VllmEngine, VllmEngineSettings

    vocab = 512  # the tiny model's embedding rows
    base = checkpoint_float32(bf16_model)
    settings = VllmEngineSettings(
        model=str(bf16_model),
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=16,
        gpu_memory_utilization=0.3,
        enforce_eager=not graphs,
        compilation_config=GRAPHS if graphs else None,
    )
    engine = await VllmEngine.start(settings)
    pids = engine.child_pids
    try:
        assert pids, "vLLM should have started an engine-core process"

        # Sampling: one logprob and one version per token.
        gen = await engine.generate(
            "sample",
            PROMPT,
            SamplingSettings(max_tokens=32, temperature=1.0, ignore_eos=True, seed=0),
        )
        assert gen.finish_reason == "length"
        assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) == 32
        assert all(0 <= t < vocab for t in gen.token_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in gen.logprobs), gen.logprobs
        assert gen.versions == [0] * 32

        before, versions = await greedy(engine, PROMPT, 16, "before")
        assert versions == [0] * 16
        assert (await greedy(engine, PROMPT, 16, "before-again"))[0] == before, "not deterministic"

        # A "keep" update (vLLM 0.24: the abort fallback) of perturbed weights changes the output.
        seconds = await engine.load_weights(1, as_update(perturbed(base, seed=1)), mode="keep")
        assert engine.policy_version == 1 and seconds > 0
        after, versions = await greedy(engine, PROMPT, 16, "after")
        assert versions == [1] * 16
        assert after != before, "the update did not change the greedy output"

        # An update in the middle of generation: every request finishes with all its tokens,
        # versions never decrease, and the requests in flight saw both versions.
        prompts = [[*PROMPT, i + 1] for i in range(8)]
        tasks = [
            asyncio.create_task(
                engine.generate(
                    f"long-{i}",
                    p,
                    SamplingSettings(max_tokens=LONG, temperature=1.0, ignore_eos=True),
                )
            )
            for i, p in enumerate(prompts)
        ]
        await asyncio.sleep(0.3)
        assert not all(t.done() for t in tasks), "generation ended before the update: raise LONG"
        continued = replace(engine.continuations)
        await engine.load_weights(2, as_update(base), mode="keep")
        # the new weights were on the device before the engine paused
        assert engine.last_update_timings["prefetched"] == 1.0, engine.last_update_timings
        gens = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        if not vllm_info().weight_version_spans:
            # resubmitted with the salt of their first submission: their KV is still there, but
            # for each request's last partial block (vLLM caches whole blocks of 16 here)
            resent = engine.continuations.tokens - continued.tokens
            cached = engine.continuations.cached_tokens - continued.cached_tokens
            n = engine.continuations.submissions - continued.submissions
            assert n > 0 and resent - 16 * n <= cached < resent, engine.continuations
        straddled = 0
        for g in gens:
            assert g.finish_reason == "length" and len(g.token_ids) == LONG
            assert len(g.logprobs) == len(g.versions) == LONG
            assert g.versions == sorted(g.versions) and set(g.versions) <= {1, 2}
            straddled += set(g.versions) == {1, 2}
        assert straddled > 0, "no request was in flight during the update"

        # Version 2 holds the checkpoint's own weights: the original greedy output is back.
        back, versions = await greedy(engine, PROMPT, 16, "back")
        assert versions == [2] * 16
        assert back == before

        # An episode's next turn after a "keep" update takes its first turn's salt: it finds its
        # context cached but for the last partial block.
        turn = SamplingSettings(max_tokens=200, temperature=0.0, ignore_eos=True, kv_scope="ep")
        first = await engine.generate("ep-t0", PROMPT, turn)
        later = replace(engine.later_turns)
        await engine.load_weights(3, as_update(perturbed(base, seed=2)), mode="keep")
        context = [*PROMPT, *first.token_ids, 7, 8, 9]
        second = await engine.generate("ep-t1", context, replace(turn, max_tokens=4))
        assert second.versions == [3] * 4
        assert engine.later_turns.submissions == later.submissions + 1
        assert second.reuse_sent == len(context)
        assert len(context) - 32 <= second.reuse_cached < len(context), second
    finally:
        await engine.shutdown()

    alive = [
        pid
        for pid in pids
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert alive == []
    with pytest.raises(RuntimeError, match="shut down"):
        await engine.generate("late", PROMPT, SamplingSettings(max_tokens=4))
