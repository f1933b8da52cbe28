"""FSDP2 workers as Ray actors on gloo: the same batch gives the same update on 1 and on 2 ranks
(padded or packed micro-batches, fixed or token-capped, parameters kept gathered or resharded),
forward logprobs match a plain transformers forward, checkpoints round-trip, and the exported model
loads in transformers."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from learner.samples import Batching, Sample, split_for_ranks
from learner.worker_api import (
    ForwardRequest,
    ForwardResult,
    UpdateRequest,
    WeightsFileRequest,
    WeightsRequest,
)
from learner.worker_settings import WorkerSettings

OWN_RAY_CLUSTER = True  # tests/conftest.py: runs in the serial pass

pytestmark = pytest.mark.e2e


def make_samples(n: int, seed: int = 0, vocab: int = 500) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, r = int(rng.integers(3, 12)), int(rng.integers(2, 20))
        ids = rng.integers(0, vocab, p + r).astype(np.int64)
        mask = (rng.random(r) > 0.2).astype(np.float32)  # holes: tool tokens
        s = Sample(ids, p, mask)
        s.old_logprobs = (-rng.random(r) * 3).astype(np.float32) * mask
        s.advantages = rng.normal(size=r).astype(np.float32) * mask
        out.append(s)
    return out


def settings(model: Path, **kw: Any) -> WorkerSettings:
    return replace(
        WorkerSettings(model_path=str(model), lr=1e-3, loss_agg_mode="token-mean", seed=1), **kw
    )


async def _train(
    model: Path, world: int, samples: list[Sample], batching: Batching | None = None, **kw: Any
) -> tuple[dict[str, float], dict]:
    """The update's metrics as the trainer reports them, and the weights after it."""
    from learner.prepare import reduce_worker_metrics
    from learner.workers import WorkerGroup

    group = WorkerGroup(settings(model, **kw), world)
    try:
        await group.start()
        plans = split_for_ranks(
            samples, mini_batches=2, ranks=world, micro_size=3, batching=batching
        )
        metrics = await group.update([UpdateRequest("actor", p) for p in plans])
        names = [n for n, _ in _hf_names(model)]
        weights = await group.full_weights(WeightsRequest(names))
        return reduce_worker_metrics(metrics, "actor"), {n: a for n, _, _, a in weights}
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


@pytest.mark.parametrize("keep_gathered", [True, False])
def test_packed_token_capped_two_ranks_match_padded_one_rank(
    tiny_model: Path, ray_cluster: Any, keep_gathered: bool
) -> None:
    """Packed micro-batches of at most 60 tokens on 2 ranks, with FSDP2 keeping the parameters
    gathered through the step (the default for a small model) or resharding after every forward and
    backward, update the weights as padded micro-batches of 3 samples on 1 rank do."""
    samples = make_samples(12, seed=7)
    _, one = anyio.run(lambda: _train(tiny_model, 1, samples))
    _, two = anyio.run(
        lambda: _train(
            tiny_model,
            2,
            samples,
            Batching(max_tokens=60, packed=True),
            keep_gathered=keep_gathered,
        )
    )
    for n in one:
        np.testing.assert_allclose(two[n], one[n], atol=2e-6, rtol=1e-4, err_msg=n)


def test_shared_prefix_reaches_the_workers_and_changes_no_update(
    tiny_model: Path, ray_cluster: Any
) -> None:
    """Samples that share a 9-token head, packed under a token cap with ``share_prefix`` on 2
    ranks: the workers lay the head out once per micro-batch (``shared_prefix_frac`` > 0) and the
    weights move as with padded micro-batches on 1 rank, which share nothing."""
    head = np.random.default_rng(3).integers(0, 500, 9)
    samples = [
        replace(s, input_ids=np.concatenate([head, s.input_ids]), prompt_len=s.prompt_len + 9)
        for s in make_samples(12, seed=5)
    ]
    plain, one = anyio.run(lambda: _train(tiny_model, 1, samples))
    shared, two = anyio.run(
        lambda: _train(
            tiny_model, 2, samples, Batching(max_tokens=90, packed=True, share_prefix=True)
        )
    )
    assert plain["actor/shared_prefix_frac"] == 0
    assert 0.1 < shared["actor/shared_prefix_frac"] < 0.5, shared
    for n in one:
        np.testing.assert_allclose(two[n], one[n], atol=2e-6, rtol=1e-4, err_msg=n)


def test_forward_logprobs_match_transformers(tiny_model: Path, ray_cluster: Any) -> None:
    from transformers import AutoModelForCausalLM

    from learner.workers import WorkerGroup

    samples = make_samples(5, seed=3)

    async def run() -> list[ForwardResult]:
        group = WorkerGroup(settings(tiny_model, temperature=0.7), 2)
        try:
            await group.start()
            chunks: list[list[list[Sample | None]]] = [
                [[samples[0], samples[2], samples[4]]],
                [[samples[1], samples[3]]],
            ]
            return await group.forward_per_rank(
                [ForwardRequest("actor", c, with_entropy=True) for c in chunks]
            )
        finally:
            group.shutdown()

    res = anyio.run(run)
    order = {0: (0, 0), 2: (0, 1), 4: (0, 2), 1: (1, 0), 3: (1, 1)}  # sample -> (rank, position)
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    for i, s in enumerate(samples):
        with torch.no_grad():
            logits = lm(torch.from_numpy(s.input_ids)[None]).logits[0].float() / 0.7
        logp = torch.log_softmax(logits[s.prompt_len - 1 : -1], -1)
        want = logp.gather(1, torch.from_numpy(s.input_ids[s.prompt_len :])[:, None])[:, 0]
        rank, pos = order[i]
        np.testing.assert_allclose(res[rank].outputs[pos], want.numpy(), atol=1e-5)
        ent = -(logp.exp() * logp).sum(-1)
        entropy = res[rank].entropy
        assert entropy is not None
        np.testing.assert_allclose(entropy[pos], ent.numpy(), atol=1e-4)


def test_checkpoint_resume_continues_identically_and_export_loads(
    tiny_model: Path, ray_cluster: Any, tmp_path: Path
) -> None:
    """Train A, save, train B -> W. A fresh group that loads the checkpoint and trains B gets W too
    (model, optimizer and schedule restored); the HF export loads in transformers."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from learner.workers import WorkerGroup

    a, b = make_samples(8, seed=5), make_samples(8, seed=6)
    names = [n for n, _ in _hf_names(tiny_model)]
    kw = {"warmup_steps": 3, "total_steps": 10}

    async def step(group: WorkerGroup, samples: list[Sample]) -> None:
        plans = split_for_ranks(samples, mini_batches=2, ranks=2, micro_size=2)
        await group.update([UpdateRequest("actor", p) for p in plans])

    async def first() -> dict[str, np.ndarray]:
        group = WorkerGroup(settings(tiny_model, **kw), 2)
        try:
            await group.start()
            await step(group, a)
            await group.save_checkpoint(str(tmp_path / "ckpt"))
            await group.export_hf(str(tmp_path / "hf"), str(tiny_model))
            await step(group, b)
            return {n: x for n, _, _, x in await group.full_weights(WeightsRequest(names))}
        finally:
            group.shutdown()

    async def resumed() -> dict[str, np.ndarray]:
        group = WorkerGroup(settings(tiny_model, **kw), 2)
        try:
            await group.start()
            await group.load_checkpoint(str(tmp_path / "ckpt"))
            await step(group, b)
            return {n: x for n, _, _, x in await group.full_weights(WeightsRequest(names))}
        finally:
            group.shutdown()

    w1, w2 = anyio.run(first), anyio.run(resumed)
    for n in names:
        np.testing.assert_allclose(w2[n], w1[n], atol=1e-7, err_msg=n)
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(names)
    lm = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "tokenizer.json").exists()
    orig = load_file(str(tiny_model / "model.safetensors"))
    assert any(not np.array_equal(exported[n], orig[n]) for n in names), (
        "export holds the old weights"
    )
    sd = lm.state_dict()
    for n in names:
        np.testing.assert_array_equal(sd[n].numpy(), exported[n])


def test_critic_learns_returns_on_two_ranks(tiny_model: Path, ray_cluster: Any) -> None:
    """The critic (value head on the same base) gives values at the response positions and its
    clipped value loss falls when it is trained towards fixed returns (GAE's path)."""
    from learner.workers import WorkerGroup

    samples = make_samples(6, seed=9)
    for s in samples:
        s.returns = np.full(s.response_len, 0.5, np.float32)

    async def run() -> list[float]:
        group = WorkerGroup(
            settings(
                tiny_model, critic_model_path=str(tiny_model), critic_lr=3e-4, cliprange_value=10.0
            ),
            2,
        )
        losses = []
        try:
            await group.start()
            for _ in range(6):
                chunks: list[list[list[Sample | None]]] = [[list(samples[r::2])] for r in range(2)]
                res = await group.forward_per_rank(
                    [ForwardRequest("critic", chunks[r]) for r in range(2)]
                )
                for r in range(2):
                    for s, out in zip(samples[r::2], res[r].outputs, strict=True):
                        assert out.shape == (s.response_len,)
                        s.values = out
                plans = split_for_ranks(samples, mini_batches=1, ranks=2, micro_size=2)
                metrics = await group.update([UpdateRequest("critic", p) for p in plans])
                losses.append(sum(m.sums["value_loss"] for m in metrics))
            return losses
        finally:
            group.shutdown()

    losses = anyio.run(run)
    assert losses[-1] < losses[0] * 0.5, losses


async def _weights_file_vs_gather(model: Path, folder: Path) -> tuple[dict, dict, list[Any]]:
    from learner.workers import WorkerGroup

    group = WorkerGroup(settings(model), 2)
    try:
        await group.start()
        await group.update(
            [
                UpdateRequest("actor", p)
                for p in split_for_ranks(make_samples(6), mini_batches=1, ranks=2, micro_size=3)
            ]
        )
        names = [n for n, _ in _hf_names(model)]
        dtypes = {n: "bfloat16" for n in names}  # cast on the way, as for a bf16 serving engine
        gathered = {n: a for n, _, _, a in await group.full_weights(WeightsRequest(names, dtypes))}
        infos = []
        for slot_dir in ("v1", "v2"):  # the second write reuses the same slot file in place
            path = folder / "slot" / "model.safetensors"
            path.parent.mkdir(exist_ok=True)
            infos.append(
                await group.write_weights_file(
                    WeightsFileRequest(WeightsRequest(names, dtypes), 1, str(path))
                )
            )
            (folder / slot_dir).write_text("")
        from common.safetensors_buffers import load_file

        written = {
            t.name: np.frombuffer(t.data, np.uint16).reshape(t.shape) for t in load_file(path)
        }
        return gathered, written, infos
    finally:
        group.shutdown()


def test_weights_file_matches_the_gathered_weights(
    tiny_model: Path, ray_cluster: Any, tmp_path: Path
) -> None:
    """The file hand-over's writer (two ranks, rank 0 writes) produces a valid safetensors file with
    exactly the bytes the chunked path sends, also when it rewrites its slot in place."""
    gathered, written, infos = anyio.run(lambda: _weights_file_vs_gather(tiny_model, tmp_path))
    assert set(written) == set(gathered)
    for n, a in gathered.items():
        np.testing.assert_array_equal(written[n], a.view(np.uint16).reshape(a.shape), err_msg=n)
    assert all(i.bytes == sum(a.nbytes for a in gathered.values()) for i in infos)
    from safetensors.torch import load_file as st_load  # the reader vLLM and transformers use

    loaded = st_load(str(tmp_path / "slot" / "model.safetensors"))
    assert {str(t.dtype) for t in loaded.values()} == {"torch.bfloat16"}


def test_workers_that_cannot_be_placed_fail_naming_the_resource(
    ray_cluster: Any, tiny_model: Path
) -> None:
    asyncio.run(_unplaceable(ray_cluster, tiny_model))


async def _unplaceable(ray_cluster: Any, tiny_model: Path) -> None:
    from learner.workers import PlacementError, WorkerGroup

    # Both CPUs held (as rollout servers placed on the cluster once held them): the workers wait,
    # then fail naming CPU, instead of leaving the learner at step 0 without a word.
    class Hold:  # defined here: Ray ships it by value (the tests are no package on its workers)
        def ping(self) -> bool:
            return True

    hold = ray_cluster.remote(num_cpus=2)(Hold).remote()
    await hold.ping.remote()
    try:
        group = WorkerGroup(settings(tiny_model), 2, place_timeout_s=6)
        with pytest.raises(PlacementError, match=r"wait for CPU: each needs 1, 0 of 2 are free"):
            await group.start()
        group.shutdown()
    finally:
        ray_cluster.kill(hold)
    # GPU workers on a cluster without any: final at the first look.
    gpu = WorkerGroup(settings(tiny_model, device="cuda"), 1, place_timeout_s=600)
    with pytest.raises(PlacementError, match=r"has GPU=0 in all"):
        await gpu.start()
    gpu.shutdown()
