"""From trajectories to training inputs: samples, reward placement, mini/micro-batch plans that
keep every rank in step and carry the global counts, and metric reduction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.prepare import (
    batch_metrics,
    reduce_worker_metrics,
    remax_baselines,
    response_tensors,
    set_tokens,
    to_samples,
    token_level_scores,
)
from learner.samples import Sample, count_tokens, split_for_ranks
from protocol.trajectory import Trajectory


def traj(
    tid: str, group: str, prompt: int, mask: list[int], reward: float, **kw: object
) -> Trajectory:
    r = len(mask)
    return Trajectory(
        trajectory_id=tid,
        group_uid=group,
        prompt_ids=np.arange(prompt, dtype=np.int32),
        response_ids=np.arange(100, 100 + r, dtype=np.int32),
        response_mask=np.array(mask, np.uint8),
        rollout_logprobs=np.where(np.array(mask) == 1, -0.5, 0.0).astype(np.float32),
        versions=np.zeros(r, np.int32),
        reward=reward,
        **kw,
    )  # type: ignore[arg-type]


def test_samples_and_reward_on_last_trained_token() -> None:
    trajs = [
        traj("a", "g", 3, [1, 1, 0, 0, 1, 0], 1.0),
        traj("b", "g", 2, [1, 0], 0.5),
        traj("c", "h", 2, [0, 0], 2.0),
    ]
    samples = to_samples(trajs)
    assert [s.prompt_len for s in samples] == [3, 2, 2]
    assert samples[0].input_ids.tolist() == [0, 1, 2, 100, 101, 102, 103, 104, 105]
    mask = response_tensors(samples)
    assert mask.shape == (3, 6)
    scores = token_level_scores(trajs, mask)
    # the reward sits on the last token the model generated (a trailing tool token gets none)
    assert scores[0].tolist() == [0, 0, 0, 0, 1.0, 0]
    assert scores[1].tolist() == [0.5, 0, 0, 0, 0, 0]
    assert scores[2].abs().sum() == 0  # nothing trained: no reward anywhere
    set_tokens(samples, "advantages", torch.arange(18, dtype=torch.float32).reshape(3, 6))
    assert samples[1].get("advantages").tolist() == [6.0, 7.0]


def test_remax_needs_the_baseline_from_the_rollout_side() -> None:
    ok = traj("a", "g", 2, [1], 1.0, reward_extras={"remax_baseline": 0.25})
    assert remax_baselines([ok]).tolist() == [0.25]
    with pytest.raises(ValueError, match=r"remax_baseline.*adv_estimator"):
        remax_baselines([ok, traj("b", "g", 2, [1], 0.0)])


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        r = int(rng.integers(1, 9))
        out.append(
            Sample(
                np.zeros(3 + r, np.int64),
                3,
                (rng.random(r) > 0.3).astype(np.float32),
                {"advantages": np.ones(r, np.float32)},
            )
        )
    return out


@pytest.mark.parametrize(
    ("n", "ranks", "mini", "micro"), [(10, 2, 2, 3), (7, 2, 1, 4), (5, 4, 1, 1), (12, 3, 4, 2)]
)
def test_plans_cover_every_sample_once_with_equal_micro_counts(
    n: int, ranks: int, mini: int, micro: int
) -> None:
    samples = _samples(n)
    plans = split_for_ranks(samples, mini_batches=mini, ranks=ranks, micro_size=micro)
    assert len(plans) == ranks and all(len(p) == mini for p in plans)
    seen: list[int] = []
    for m in range(mini):
        counts = {len(plans[r][m].micro_batches) for r in range(ranks)}
        assert len(counts) == 1, "every rank runs the same number of micro-batches"
        placed = [s for r in range(ranks) for mb in plans[r][m].micro_batches for s in mb]
        ids = {id(x): i for i, x in enumerate(samples)}
        seen += [ids[id(s)] for s in placed if id(s) in ids]
        assert all(not s.response_mask.any() for s in placed if id(s) not in ids), (
            "dummies train nothing"
        )
        tokens = sum(count_tokens(mb) for r in range(ranks) for mb in plans[r][m].micro_batches)
        assert plans[0][m].num_tokens == tokens, "dummies add no tokens; counts are global"
        assert all(len(mb) <= micro for r in range(ranks) for mb in plans[r][m].micro_batches)
    assert sorted(seen) == list(range(n))


def test_batch_metrics_per_source_and_staleness() -> None:
    trajs = [
        traj("a", "g", 2, [1, 1], 1.0, data_source="math", num_turns=3),
        traj("b", "g", 2, [1], 0.0, data_source="qa", termination="length"),
    ]
    m = batch_metrics(trajs, [0, 2], version=5)
    assert m["reward/mean"] == 0.5 and m["reward/mean/math"] == 1.0 and m["reward/mean/qa"] == 0.0
    assert m["episode/turns_mean"] == 2.0 and m["episode/termination/length"] == 0.5
    assert m["staleness/max"] == 2 and m["staleness/frac_0"] == 0.5
    assert m["response/length_mean"] == 1.5


def test_batch_metrics_per_source_counts_lengths_turns_terminations() -> None:
    trajs = [
        traj("a", "g", 2, [1, 1, 1, 1], 1.0, data_source="math", num_turns=3),
        traj("b", "g", 2, [1, 1], 0.0, data_source="math", num_turns=1, termination="length"),
        traj("c", "h", 2, [1], 0.5, data_source="nq", num_turns=2),
    ]
    m = batch_metrics(trajs, [0, 0, 1], version=5)
    assert (
        m["batch/count/math"] == 2.0
        and m["batch/count/nq"] == 1.0
        and m["batch/trajectories"] == 3.0
    )
    assert m["response/length_mean/math"] == 3.0 and m["response/length_mean/nq"] == 1.0
    assert m["episode/turns_mean/math"] == 2.0 and m["episode/turns_mean/nq"] == 2.0
    assert (
        m["episode/termination/length/math"] == 0.5
        and m["episode/termination/answered/math"] == 0.5
    )
    assert m["episode/termination/answered/nq"] == 1.0 and "episode/termination/length/nq" not in m
    # one unnamed source: the overall keys say it all, no per-source copies
    plain = batch_metrics([traj("d", "g", 2, [1], 1.0)], [0], version=5)
    assert (
        not any(k.startswith("batch/count/") for k in plain) and "reward/mean/unknown" not in plain
    )


def test_worker_metrics_reduce_to_means() -> None:
    from learner.worker_api import UpdateResult

    ranks = [
        UpdateResult(
            "actor",
            optimizer_steps=2,
            skipped_steps=0,
            grad_norm_sum=4.0,
            lr=1e-3,
            sums={"pg_loss": 0.25, "tokens": 10.0, "clipfrac_tok": 2.0},
        ),
        UpdateResult(
            "actor",
            optimizer_steps=2,
            skipped_steps=0,
            grad_norm_sum=4.0,
            lr=1e-3,
            sums={"pg_loss": 0.75, "tokens": 30.0, "clipfrac_tok": 6.0},
        ),
    ]
    out = reduce_worker_metrics(ranks, "actor")
    assert out["actor/pg_loss"] == 0.5  # (0.25 + 0.75) over 2 optimizer steps
    assert out["actor/clipfrac"] == 0.2  # token-weighted
    assert out["actor/grad_norm"] == 2.0 and out["actor/lr"] == 1e-3
