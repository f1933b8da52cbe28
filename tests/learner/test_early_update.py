"""`learner.early_update`'s rules, without workers: which configs may train a step's first
mini-batch in the wait (the learner refuses the others, naming the key), when the buffer fixes that
mini-batch, and whether the step's batch is the one held. The step itself, on FSDP workers, is
tests/learner/test_early_update_step.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.config.errors import ConfigError
from common.config.loader import load_config
from learner.buffer import Group
from learner.early_update import EarlyUpdate, unavailable
from learner.intake import TakenBatch
from protocol.trajectory import Trajectory

BASE = [
    "actor_rollout_ref.model.path=/nonexistent",
    "data.train_files=[/nonexistent.jsonl]",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # 8 samples: 2 mini-batches of 2 groups
]


def config(*extra: str) -> Any:
    return load_config(None, [*BASE, *extra], check_paths=False)


def group(uid: str, oldest: int | None, size: int = 2, carried: bool = False) -> Group:
    trajs = [
        Trajectory(
            trajectory_id=f"{uid}-{i}",
            group_uid=uid,
            prompt_ids=np.arange(3, dtype=np.int32),
            response_ids=np.arange(2, dtype=np.int32),
            response_mask=np.ones(2, np.uint8),
            rollout_logprobs=np.zeros(2, np.float32),
            versions=np.zeros(2, np.int32),
        )
        for i in range(size)
    ]
    return Group((0, uid), trajs, oldest, carried=carried)


def early(cfg: Any) -> EarlyUpdate:
    # the workers, batching, KL controller, reference and timeline are not used by these rules
    none: Any = None
    return EarlyUpdate(cfg, none, none, none, none, none, none)


def test_the_default_config_may_and_the_learner_refuses_what_may_not(tmp_path: Path) -> None:
    assert unavailable(config()) is None
    for extra, words in [
        (["actor_rollout_ref.actor.ppo_mini_batch_size=8"], "one mini-batch"),
        (["algorithm.adv_estimator=reinforce_plus_plus"], "per group"),
        (["algorithm.use_kl_in_reward=true"], "own forward"),
        (["actor_rollout_ref.actor.off_policy.skip_old_logprob_forward=never"], "own forward"),
        (["actor_rollout_ref.actor.ppo_epochs=2"], "own forward"),
        (["algorithm.filter_groups.enable=true"], "dynamic sampling"),
    ]:
        why = unavailable(config(*extra))
        assert why is not None and words in why, (extra, why)
    from learner.trainer import Trainer

    bad = config(
        "actor_rollout_ref.actor.first_mini_batch_in_waits=true",
        "algorithm.adv_estimator=reinforce_plus_plus",
        f"trainer.run_dir={tmp_path}",
    )
    with pytest.raises(ConfigError) as err:
        Trainer(bad, tmp_path)
    assert "actor_rollout_ref.actor.first_mini_batch_in_waits" in str(err.value)
    assert "per group" in str(err.value)


def test_the_first_mini_batch_is_fixed_once_due_groups_of_full_size_fill_it() -> None:
    e = early(config())
    assert e.first_groups == 2
    # at version 3 with max_staleness 1, groups whose oldest token is version 2 are due
    due = [group("a", 2), group("b", 2)]
    assert e.first_mini_batch([*due, group("c", 3)], 3, 1) == due
    assert e.first_mini_batch(due[:1], 3, 1) is None, "not filled yet"
    assert e.first_mini_batch([due[0], group("c", 3)], 3, 1) is None, "c is not due: may move"
    # ... unless admission knows every group still generating starts at version 3 or later (a
    # later one of version 3 sorts after c), or none is generating
    assert e.first_mini_batch([due[0], group("c", 3)], 3, 1, generating_from=3) is not None
    assert e.first_mini_batch([due[0], group("c", 3)], 3, 1, generating_from=math.inf)
    assert e.first_mini_batch([due[0], group("c", 3)], 3, 1, generating_from=2) is None
    assert e.first_mini_batch([due[0], group("b", 2, size=1)], 3, 1) is None, "a short group"
    assert e.first_mini_batch([due[0], group("b", 2, carried=True)], 3, 1) is None, "replayed"
    assert e.first_mini_batch([due[0], group("b", None)], 3, 1) is None, "no response token"
    # a mini-batch that cuts a group (5 groups of 2 in 2 mini-batches: 5 samples first) holds none
    assert (
        early(
            config("data.train_batch_size=5", "actor_rollout_ref.actor.ppo_mini_batch_size=5")
        ).first_groups
        == 0
    )


def taken(groups: list[Group]) -> TakenBatch:
    return TakenBatch(
        trajectories=[t for g in groups for t in g.trajectories],
        group_uids=[g.key[1] for g in groups],
        group_sizes=[len(g.trajectories) for g in groups],
        staleness=[1] * len(groups),
        dropped_stale=0,
        wait_s=0.0,
        keys=[g.key for g in groups],
    )


def test_a_held_mini_batch_is_continued_only_by_the_batch_it_starts() -> None:
    from learner.early_update import Held

    e = early(config())
    batch = [group(u, 2) for u in "abcd"]
    assert e.take(taken(batch)) is None, "nothing held"
    assert e.metrics(None) == {
        "prepare/early_update": 0.0,
        "timing/early_update_s": 0.0,
        "timing/early_update_wasted_s": 0.0,
    }
    e.held = Held(((0, "a"), (0, "b")), 4, 0.5)
    got = e.take(taken(batch))
    assert got is not None and e.held is None
    assert e.metrics(got)["prepare/early_update"] == 1.0
    # another order, or a larger group (a StateLM episode's snapshots) that moves the first
    # mini-batch's bound (9 samples: 5 first): dropped, counted
    e.held = Held(((0, "b"), (0, "a")), 4, 0.5)
    assert e.take(taken(batch)) is None
    e.held = Held(((0, "a"), (0, "b")), 4, 0.25)
    assert e.take(taken([*batch[:3], group("d", 2, size=3)])) is None
    # a smaller one that leaves it (7 samples: 4 first) still continues it
    e.held = Held(((0, "a"), (0, "b")), 4, 0.25)
    assert e.take(taken([*batch[:3], group("d", 2, size=1)])) is not None
    m = e.metrics(None)
    assert m["timing/early_update_wasted_s"] == 0.75 and m["prepare/early_update"] == 0.0
    assert e.metrics(None)["timing/early_update_wasted_s"] == 0.0, "reported once"
