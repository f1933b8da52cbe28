"""The forwards before the update (`Trainer._prepare`) give the logprobs a plain per-sample
transformers forward gives, while running no more than they must: with the first mini-batch's old
logprobs taken from the update's own forward, only the later mini-batches get an old-logprob forward,
cut into the micro-batches the update runs them in, and the update's forward gives the forward-only
pass's numbers bit for bit.

Fast tier: `TrainWorker.forward` runs in this process on unsharded models (tests/learner/
test_skip_old_forward.py runs whole steps on FSDP workers under Ray)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from learner.samples import Batching, Sample, split_for_ranks, split_forward
from learner.workers import WorkerGroup

CPU = torch.device("cpu")


def trajectories(groups: int, n: int, seed: int = 0) -> list[Any]:
    """GRPO groups: one prompt per group (a head shared by every group, as a system prompt is),
    mixed response lengths, tool-token holes in the masks."""
    from protocol.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    system = rng.integers(0, 500, 7)
    out = []
    for g in range(groups):
        prompt = np.concatenate([system, rng.integers(0, 500, int(rng.integers(2, 8)))])
        for i in range(n):
            r = int(rng.integers(2, 30))
            mask = (rng.random(r) > 0.2).astype(np.uint8)
            out.append(
                Trajectory(
                    trajectory_id=f"t{g}-{i}",
                    group_uid=f"g{g}",
                    prompt_ids=prompt.astype(np.int32),
                    response_ids=rng.integers(0, 500, r).astype(np.int32),
                    response_mask=mask,
                    rollout_logprobs=(-rng.random(r) * 5).astype(np.float32),
                    versions=np.zeros(r, np.int32),
                    reward=float(rng.random()),
                )
            )
    return out


class LocalWorkers(WorkerGroup):
    """`WorkerGroup`'s forward (the split, the requests, the results put back into the samples)
    with each rank a `TrainWorker` in this process instead of a Ray actor."""

    def __init__(self, workers: Sequence[Any]) -> None:
        self.world, self.local = len(workers), list(workers)
        self.can_pack = self.can_share_prefix = True
        self.requests: list[Any] = []  # every rank's forward requests, as sent

    async def forward_per_rank(self, requests: Sequence[Any]) -> list[Any]:
        self.requests.extend(requests)
        return [w.forward(r) for w, r in zip(self.local, requests, strict=True)]


def policy(model: Path, temperature: float, nudge: float = 0.0) -> Any:
    """A PolicyHead over the model; ``nudge`` moves every weight (seeded): an actor that has
    trained away from the reference."""
    from learner.model import PolicyHead, load_causal_lm

    lm = load_causal_lm(str(model), trust_remote_code=False, gradient_checkpointing=False)
    if nudge:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in lm.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * nudge)
    return PolicyHead(lm, temperature)


def per_sample_logprobs(head: Any, s: Sample) -> np.ndarray:
    """The plain transformers forward of one sequence: log softmax(logits / T) of its response."""
    with torch.no_grad():
        logits = head.lm(torch.from_numpy(s.input_ids)[None]).logits[0] / head.temperature
    logp = torch.log_softmax(logits[s.prompt_len - 1 : -1], -1)
    return logp.gather(1, torch.from_numpy(s.input_ids[s.prompt_len :])[:, None])[:, 0].numpy()


def local_trainer(model: Path, tmp: Path, overrides: list[str]) -> tuple[Any, LocalWorkers, dict]:
    """A `Trainer` for batches of 3 groups of 4 (3 mini-batches, KL loss, 2 ranks) over
    `LocalWorkers`, with its actor and reference heads."""
    from common.config.loader import load_config
    from learner.trainer import Trainer
    from learner.worker import TrainWorker

    config = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={model}",
            f"data.train_files=[{tmp / 'none.jsonl'}]",
            "data.train_batch_size=3",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
            "trainer.n_gpus_per_node=2",
            "trainer.device=cpu",
            "trainer.total_training_steps=1",
            f"trainer.run_dir={tmp}",
            *overrides,
        ],
        check_paths=False,
    )
    trainer = Trainer(config, tmp)
    trainer._init_algorithm_state(None)
    temperature = config.actor_rollout_ref.rollout.temperature
    heads = {"actor": policy(model, temperature, nudge=0.02), "ref": policy(model, temperature)}
    ranks = [TrainWorker(r, 2, trainer.settings) for r in range(2)]
    for w in ranks:
        w.models = dict(heads)
    trainer.workers = group = LocalWorkers(ranks)
    return trainer, group, heads


async def prepare(model: Path, tmp: Path, overrides: list[str]) -> tuple[list[Sample], Any, dict]:
    """`Trainer._prepare` of one batch (`local_trainer`)."""
    from learner.prepare import to_samples

    trainer, group, heads = local_trainer(model, tmp, overrides)
    trajs = trajectories(3, 4)
    samples = to_samples(trajs)
    await trainer._prepare(trajs, samples, None)
    return samples, group, heads


def ran(group: LocalWorkers, role: str) -> int:
    """The samples ``role``'s forwards have run over so far (placeholders not counted)."""
    return sum(
        s is not None for r in group.requests if r.role == role for m in r.micro_batches for s in m
    )


@pytest.mark.parametrize(("skip", "temperature"), [("auto", 1.0), ("auto", 0.7), ("never", 1.0)])
def test_prepare_logprobs_equal_a_per_sample_forward(
    tiny_model: Path, tmp_path: Path, skip: str, temperature: float
) -> None:
    samples, group, heads = anyio.run(
        prepare,
        tiny_model,
        tmp_path,
        [
            f"actor_rollout_ref.actor.off_policy.skip_old_logprob_forward={skip}",
            f"actor_rollout_ref.rollout.temperature={temperature}",
        ],
    )
    # auto: the update takes the first mini-batch's (samples 0-3) from its own forward
    first = 4 if skip == "auto" else 0
    for i, s in enumerate(samples):
        # packed with a shared prefix against one sequence alone: float32 rounding apart
        want = per_sample_logprobs(heads["ref"], s)
        np.testing.assert_allclose(s.ref_logprobs, want, atol=1e-5, rtol=1e-5, err_msg=str(i))
        if i < first:
            assert s.old_logprobs is None, i
            continue
        want = per_sample_logprobs(heads["actor"], s)
        np.testing.assert_allclose(s.old_logprobs, want, atol=1e-5, rtol=1e-5, err_msg=str(i))
        assert np.abs(s.old_logprobs - s.ref_logprobs).max() > 1e-3, "actor and reference differ"
    # what ran: the reference over the 12 samples, the actor over 8 (auto) or 12 (never)
    assert {role: ran(group, role) for role in ("actor", "ref")} == {"actor": 12 - first, "ref": 12}


async def early_then_prepare(model: Path, tmp: Path) -> dict[str, Any]:
    """Reference forwards run while the step waits (`learner.early_reference`): 2 groups buffered,
    then 2 more arrive; the step takes 3 of the 4, the 4th is dropped; then the next batch of 3
    groups, only one of which was seen in a wait."""
    from common.timeline import TimelineWriter
    from learner.buffer import Group
    from learner.early_reference import EarlyReference
    from learner.prepare import to_samples

    trainer, group, heads = local_trainer(model, tmp, [])
    trajs = trajectories(7, 4, seed=5)
    groups = [Group((i, f"g{i}"), trajs[4 * i : 4 * i + 4], 0) for i in range(7)]
    early = EarlyReference(group, trainer._batching, 5, TimelineWriter.off())
    out: dict[str, Any] = {"heads": heads}
    visible, arrivals, taken = groups[:2], [anyio.Event()], anyio.Event()

    async def arrival() -> None:
        await arrivals[-1].wait()

    async def until(n: int) -> None:
        with anyio.fail_after(60):
            while early.computed < n:
                await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(early.run, lambda: visible, arrival, taken, 1)
        await until(8)
        out["calls_first"] = sum(r.role == "ref" for r in group.requests) // 2  # a request a rank
        visible = groups[:4]
        arrivals.append(anyio.Event())
        arrivals[-2].set()
        await until(16)
        taken.set()
    out["calls"] = sum(r.role == "ref" for r in group.requests) // 2
    batch = [t for g in groups[:3] for t in g.trajectories]
    out["samples"] = samples = to_samples(batch)
    out["missing"] = early.take(batch, samples, still=[])  # the 4th group was dropped
    out["metrics"] = early.metrics(len(samples))
    out["kept_after"] = early.computed
    before = ran(group, "ref")
    await trainer._prepare(batch, samples, out["missing"])
    out["ref_in_prepare"] = ran(group, "ref") - before
    # the next step: one group computed in a wait, two not
    visible, taken = groups[4:5], anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(early.run, lambda: visible, arrival, taken, 2)
        await until(4)
        taken.set()
    batch = [t for g in groups[4:7] for t in g.trajectories]
    out["samples2"] = samples = to_samples(batch)
    out["missing2"] = early.take(batch, samples, still=[])
    before = ran(group, "ref")
    await trainer._prepare(batch, samples, out["missing2"])
    out["ref_in_prepare2"] = ran(group, "ref") - before
    return out


def test_reference_logprobs_computed_in_the_wait_are_those_of_prepare(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = anyio.run(early_then_prepare, tiny_model, tmp_path)
    # in chunks of at most 5: 8 samples in 2 calls, the 8 that arrived in 2 more; no call after
    assert (out["calls_first"], out["calls"]) == (2, 4)
    assert out["missing"] == [] and out["ref_in_prepare"] == 0
    assert out["kept_after"] == 0  # the dropped group's are forgotten with it
    assert out["metrics"]["prepare/ref_early_frac"] == 1.0
    assert out["metrics"]["timing/ref_early_s"] > 0
    assert out["missing2"] == list(range(4, 12)) and out["ref_in_prepare2"] == 8
    for samples in (out["samples"], out["samples2"]):
        for i, s in enumerate(samples):
            want = per_sample_logprobs(out["heads"]["ref"], s)
            np.testing.assert_allclose(s.ref_logprobs, want, atol=1e-5, rtol=1e-5, err_msg=str(i))


@pytest.mark.parametrize(
    "batching",
    [
        Batching(max_tokens=40, packed=True, share_prefix=True),
        Batching(micro_size=3),
    ],
    ids=["packed-capped-shared", "padded-fixed"],
)
@pytest.mark.parametrize("ranks", [1, 2])
def test_old_logprob_parts_run_in_the_update_s_micro_batches(
    batching: Batching, ranks: int
) -> None:
    """The forward of the later mini-batches holds exactly the micro-batches the update will run
    them in (same samples, same order, same rank), so their old logprobs are the update's numbers
    at the weights before it; placeholders stand where the update runs dummies."""
    from learner.prepare import to_samples
    from learner.samples import even_chunks

    samples = to_samples(trajectories(4, 4, seed=3))
    parts = even_chunks(range(len(samples)), 4)[1:]
    forward = split_forward(samples, ranks=ranks, batching=batching, parts=parts)
    plans = split_for_ranks(samples, mini_batches=4, ranks=ranks, batching=batching)
    for rank in range(ranks):
        update = [m for plan in plans[rank][1:] for m in plan.micro_batches]
        assert len(forward[rank]) == len(update)
        for f, u in zip(forward[rank], update, strict=True):
            if f == [-1]:  # a placeholder, where the update runs a zero-weight dummy
                assert len(u) == 1 and not u[0].response_mask.any()
            else:
                assert [samples[i] for i in f] == u


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_update_s_forward_is_the_forward_only_pass_bit_for_bit(
    tiny_model: Path, checkpointing: bool
) -> None:
    """What taking the first mini-batch's old logprobs from the update rests on: in train() with
    gradients (and recomputation under checkpointing) the same micro-batch gives the same numbers
    as the forward-only pass, eval() under no_grad."""
    from learner.model import PolicyHead, collate, load_causal_lm, policy_outputs
    from learner.prepare import to_samples

    head = PolicyHead(
        load_causal_lm(
            str(tiny_model), trust_remote_code=False, gradient_checkpointing=checkpointing
        ),
        temperature=0.7,
    )
    b = collate(to_samples(trajectories(2, 4, seed=5)), CPU, packed=True, share_prefix=True)
    assert b.prefix > 0
    with torch.no_grad():
        forward_only, _ = policy_outputs(head.eval(), b)
    in_update, _ = policy_outputs(head.train(), b, with_entropy=True)
    in_update.sum().backward()
    assert torch.equal(in_update.detach(), forward_only)
