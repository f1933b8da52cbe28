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


async def prepare(model: Path, tmp: Path, overrides: list[str]) -> tuple[list[Sample], Any, dict]:
    """`Trainer._prepare` of one batch (3 groups of 4, 3 mini-batches, KL loss, 2 ranks)."""
    from common.config.loader import load_config
    from learner.prepare import to_samples
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
    trajs = trajectories(3, 4)
    samples = to_samples(trajs)
    await trainer._prepare(trajs, samples)
    return samples, group, heads


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
    ran = {
        role: sum(
            s is not None
            for r in group.requests
            if r.role == role
            for m in r.micro_batches
            for s in m
        )
        for role in ("actor", "ref")
    }
    assert ran == {"actor": 12 - first, "ref": 12}


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
