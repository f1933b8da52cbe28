"""FSDP2 workers as Ray actors on gloo: the same batch gives the same update on 1 and on 2 ranks,
forward logprobs match a plain transformers forward, checkpoints round-trip, and the exported model
loads in transformers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from learner.samples import Sample, split_for_ranks
from learner.worker import WorkerSettings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    import ray

    from learner.workers import init_ray

    init_ray(None, 2, log_to_driver=False)
    yield ray
    ray.shutdown()


def make_samples(n: int, seed: int = 0, vocab: int = 500) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, r = int(rng.integers(3, 12)), int(rng.integers(2, 20))
        ids = rng.integers(0, vocab, p + r).astype(np.int64)
        mask = (rng.random(r) > 0.2).astype(np.float32)  # holes: tool tokens
        s = Sample(ids, p, mask)
        s.tokens["old_logprobs"] = (-rng.random(r) * 3).astype(np.float32) * mask
        s.tokens["advantages"] = rng.normal(size=r).astype(np.float32) * mask
        out.append(s)
    return out


def settings(model: Path, **kw: Any) -> WorkerSettings:
    return replace(WorkerSettings(model_path=str(model), lr=1e-3, loss_agg_mode="token-mean", seed=1), **kw)


async def _train(model: Path, world: int, samples: list[Sample], **kw: Any) -> tuple[dict[str, float], dict]:
    from learner.workers import WorkerGroup

    group = WorkerGroup(settings(model, **kw), world)
    try:
        await group.start()
        plans = split_for_ranks(samples, mini_batches=2, ranks=world, micro_size=3)
        metrics = await group.all("update_actor", [(p, 1) for p in plans])
        names = [n for n, _ in _hf_names(model)]
        weights = (await group.all("full_weights", [(names,)] * world))[0]
        return metrics[0], {n: a for n, _, _, a in weights}
    finally:
        group.shutdown()


def _hf_names(model: Path) -> list[tuple[str, Any]]:
    from common.safetensors_buffers import load_dir

    return [(t.name, t) for t in load_dir(model)]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_two_ranks_match_one_rank(tiny_model: Path, ray_cluster: Any, mode: str) -> None:
    samples = make_samples(10)
    _, one = anyio.run(lambda: _train(tiny_model, 1, samples, loss_agg_mode=mode))
    _, two = anyio.run(lambda: _train(tiny_model, 2, samples, loss_agg_mode=mode))
    from safetensors.numpy import load_file

    before = load_file(str(tiny_model / "model.safetensors"))
    moved = max(float(np.abs(one[n] - before[n]).max()) for n in one)
    assert moved > 1e-5, "the update did not change the weights"
    for n in one:
        np.testing.assert_allclose(two[n], one[n], atol=2e-6, rtol=1e-4, err_msg=n)
