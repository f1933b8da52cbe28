"""The staleness rule (``protocol.staleness``): one inequality, its two meanings (weights lag and
token age), the deadline it derives, and which token each side ages a trajectory by."""

from __future__ import annotations

import numpy as np
import pytest

from learner.admission import feasible
from protocol.reference import synthetic_trajectory
from protocol.staleness import (
    deadline,
    due,
    group_too_old,
    oldest_sampled_version,
    oldest_version,
    steps_left,
    token_age,
    too_old,
    weights_lag,
    weights_too_old,
)


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("u", [0, 2, 7])
def test_data_is_usable_up_to_its_deadline_and_stale_after(u: int, k: int) -> None:
    assert deadline(u, k) == u + k
    for v in range(u, u + k + 1):
        assert not too_old(u, v, k) and token_age(u, v) == v - u <= k
    assert too_old(u, u + k + 1, k) and token_age(u, u + k + 1) == k + 1
    # Due exactly at the deadline (stale after that step), with no later step left then.
    assert due(deadline(u, k), u + k) and not due(deadline(u, k), u + k - 1)
    assert steps_left(deadline(u, k), u) == k and steps_left(deadline(u, k), u + k + 5) == 0


def test_data_without_tokens_has_no_age() -> None:
    assert not too_old(None, 10**6, 0)
    assert token_age(None, 10**6) == 0
    assert token_age(5, 3) == 0  # newer than the policy it is judged against: not behind


def test_weights_lag_is_the_same_rule_on_the_engine_version() -> None:
    assert weights_lag(7, 5) == 2
    assert not weights_too_old(7, 5, 2) and weights_too_old(7, 4, 2)
    assert not weights_too_old(3, 3, 0) and weights_too_old(4, 3, 0)
    for newest in range(6):
        for engine in range(newest + 1):
            for k in range(3):
                assert weights_too_old(newest, engine, k) == (weights_lag(newest, engine) > k)


def test_each_side_ages_a_trajectory_by_its_own_oldest_token() -> None:
    rng = np.random.default_rng(0)
    t = synthetic_trajectory(rng, server="s", version=4)
    # A tool span (mask 0) tagged with an older version: the rollout server ignores it, the
    # learner too as long as some token is trained.
    t.versions[t.response_mask == 0] = 1
    assert oldest_sampled_version(t) == 4 and oldest_version(t) == 4
    # No trained token at all: the learner falls back to any response token, the server to none.
    t.response_mask[:] = 0
    assert oldest_sampled_version(t) is None and oldest_version(t) == 1
    empty = synthetic_trajectory(rng, server="s", response_len=0)
    assert oldest_sampled_version(empty) is None and oldest_version(empty) is None


def test_a_group_is_stale_when_any_trajectory_is() -> None:
    rng = np.random.default_rng(1)
    fresh = [synthetic_trajectory(rng, server="s", version=4) for _ in range(2)]
    old = synthetic_trajectory(rng, server="s", version=2)
    assert not group_too_old(fresh, 5, 1)
    assert group_too_old([*fresh, old], 5, 2)  # 5 - 2 > 2
    assert not group_too_old([*fresh, old], 5, 3)
    assert not group_too_old([], 5, 0)


def test_admission_feasibility_counts_the_steps_left_before_each_deadline() -> None:
    # Two groups due at version 3, one step per version of one group each, stepping at 2: one
    # step (that of 3) is left for them, so only one fits.
    assert feasible([3], 2, 1) and not feasible([3, 3], 2, 1)
    assert feasible([3, 3], 2, 2)
    # A group due now (deadline == version) has no later step: it must not be left behind.
    assert not feasible([deadline(2, 0)], 2, 4)
