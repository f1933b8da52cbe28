"""A one-rank learner WorkerGroup on CUDA (Ray actor, FSDP2, NCCL, bf16 compute), no fakes.

The tiny model with a bf16 checkpoint: the worker must join an NCCL process group, run one
actor update step, and ``full_weights`` must return the checkpoint's tensor names and shapes,
as float32 master weights and, cast to the checkpoint's dtypes, as bf16 (raw 16-bit patterns, what
the rollout servers receive) equal to the float32 ones rounded. Local Ray cluster with one GPU,
shut down at the end. Skipped without a GPU (tests/conftest.py) or without the learner's packages
(the GPU image has no Ray, verl, ...: their wheels must be carried there).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tools.make_tiny_model import (
    TinyModelSpec,
    bfloat16_bits_to_float32,
    make_tiny_model,
    to_bfloat16_bits,
)

pytestmark = [pytest.mark.gpu, pytest.mark.nightly]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-bf16") / "model", TinyModelSpec(dtype="bfloat16")
    )


def make_samples(n: int, seed: int = 0, vocab: int = 500) -> list[Any]:
    from learner.samples import Sample

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, r = int(rng.integers(3, 12)), int(rng.integers(2, 20))
        ids = rng.integers(0, vocab, p + r).astype(np.int64)
        mask = (rng.random(r) > 0.2).astype(np.float32)
        s = Sample(ids, p, mask)
        s.old_logprobs = (-rng.random(r) * 3).astype(np.float32) * mask
        s.advantages = rng.normal(size=r).astype(np.float32) * mask
        out.append(s)
    return out


@pytest.mark.anyio
async def test_one_rank_worker_group_on_cuda(bf16_model: Path, ray_one_gpu: Any) -> None:
    from common.safetensors_buffers import load_dir
    from learner.samples import split_for_ranks
    from learner.worker_api import UpdateRequest, WeightsRequest
    from learner.worker_settings import WorkerSettings
    from learner.workers import WorkerGroup

    checkpoint = {b.name: b for b in load_dir(bf16_model)}
    names = sorted(checkpoint)
    dtypes = {n: b.dtype for n, b in checkpoint.items()}
    assert set(dtypes.values()) == {"bfloat16"}
    base = {
        n: bfloat16_bits_to_float32(np.frombuffer(b.data, np.uint16).reshape(b.shape))
        for n, b in checkpoint.items()
    }

    settings = WorkerSettings(model_path=str(bf16_model), device="cuda", lr=1e-3, seed=1)
    group = WorkerGroup(settings, 1)
    try:
        (info,) = await group.start()
        assert info.backend == "nccl" and info.device.startswith("cuda"), info
        assert info.params == sum(a.size for a in base.values())

        plans = split_for_ranks(make_samples(8), mini_batches=1, ranks=1, micro_size=4)
        (metrics,) = await group.update([UpdateRequest("actor", plans[0])])
        assert metrics.optimizer_steps == 1 and metrics.skipped_steps == 0, metrics
        assert math.isfinite(metrics.grad_norm_sum) and metrics.grad_norm_sum > 0

        full = await group.full_weights(WeightsRequest(names))
        assert [n for n, _, _, _ in full] == names
        f32 = {}
        for name, wire, shape, array in full:
            assert wire == "float32" and array.dtype == np.float32, (name, wire, array.dtype)
            assert shape == checkpoint[name].shape == array.shape, name
            assert np.isfinite(array).all(), name
            f32[name] = array
        moved = max(float(np.abs(f32[n] - base[n]).max()) for n in names)
        assert 0 < moved < 0.1, f"largest change {moved}: one step of lr 1e-3 expected"

        bf16 = await group.full_weights(WeightsRequest(names, dtypes))
        assert [n for n, _, _, _ in bf16] == names
        for name, wire, shape, array in bf16:
            assert wire == "bfloat16" and array.itemsize == 2, (name, wire, array.dtype)
            assert shape == checkpoint[name].shape == array.shape, name
            np.testing.assert_array_equal(
                array.view(np.uint16), to_bfloat16_bits(f32[name]), err_msg=name
            )
    finally:
        try:
            await group.stop_workers()
        finally:
            group.shutdown()


@pytest.mark.anyio
async def test_shared_prefix_micro_batches_on_cuda(bf16_model: Path, ray_one_gpu: Any) -> None:
    """Samples sharing a 60-token head, packed under a token cap with the shared prefix, through
    FSDP2 with bf16 mixed precision on CUDA: the forward pass gives the unshared logprobs (the
    cast of the inputs keeps the row layout), and the update shares the prefix and takes one
    finite optimizer step."""
    from dataclasses import replace

    from learner.prepare import reduce_worker_metrics
    from learner.samples import Batching, split_for_ranks
    from learner.worker_api import UpdateRequest
    from learner.worker_settings import WorkerSettings
    from learner.workers import WorkerGroup

    head = np.random.default_rng(9).integers(0, 500, 60)
    samples = [
        replace(s, input_ids=np.concatenate([head, s.input_ids]), prompt_len=s.prompt_len + 60)
        for s in make_samples(8)
    ]
    group = WorkerGroup(WorkerSettings(model_path=str(bf16_model), device="cuda", lr=1e-3), 1)
    try:
        await group.start()
        assert group.can_pack and group.can_share_prefix
        logprobs = {}
        for share in (False, True):
            copies = [replace(s) for s in samples]
            await group.forward(
                "actor", copies, "old_logprobs", Batching(packed=True, share_prefix=share)
            )
            logprobs[share] = np.concatenate([s.get("old_logprobs") for s in copies])
        np.testing.assert_allclose(logprobs[True], logprobs[False], atol=2e-2)
        batching = Batching(max_tokens=400, packed=True, share_prefix=True)
        plans = split_for_ranks(samples, mini_batches=1, ranks=1, batching=batching)
        res = await group.update([UpdateRequest("actor", plans[0])])
        metrics = reduce_worker_metrics(res, "actor")
        assert res[0].optimizer_steps == 1 and res[0].skipped_steps == 0
        assert math.isfinite(res[0].grad_norm_sum) and res[0].grad_norm_sum > 0
        assert metrics["actor/shared_prefix_frac"] > 0.3, metrics
    finally:
        try:
            await group.stop_workers()
        finally:
            group.shutdown()
