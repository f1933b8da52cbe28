"""Dynamic sampling (learner/group_filter.py): verl's keep rule, the metric registry, the bound of
``max_num_gen_batches``, the pass rate admission plans on, and the metrics; sans-IO."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from common.config import load_config
from common.group_rule import verdict
from learner import group_filter
from learner.admission import Admission
from learner.group_filter import MIN_PASS_RATE, GroupFilter
from protocol.trajectory import Trajectory

pytestmark = pytest.mark.unit


def ep(reward: float, *, source: str = "", response_len: int = 4, **extras: float) -> Trajectory:
    n = response_len
    return Trajectory(
        "t",
        "g",
        np.zeros(3, np.int32),
        np.zeros(n, np.int32),
        np.ones(n, np.uint8),
        np.zeros(n, np.float32),
        np.zeros(n, np.int32),
        reward=reward,
        data_source=source,
        reward_extras=dict(extras),
    )


def group(*rewards: float, source: str = "") -> list[Trajectory]:
    return [ep(r, source=source) for r in rewards]


def test_verdict_is_verls_rule() -> None:
    assert verdict([1.0, 0.0, 1.0]) is True
    assert verdict([0.0, 0.0, 0.0]) is False
    assert verdict([1.0, 1.0]) is False
    assert verdict([0.3]) is True  # a group of one is kept (rollout.n = 1 would filter all)
    assert verdict([1.0, None]) is None  # a missing value: kept, unjudged


def test_groups_of_equal_rewards_are_filtered_and_counted_per_source() -> None:
    f = GroupFilter("reward", 2)
    assert f.keeps(group(1, 0, source="math"))
    assert not f.keeps(group(0, 0, source="math"))
    assert not f.keeps(group(1, 1, source="code"))
    assert f.filtered == {"math": 1, "code": 1} and f.judged == {"math": 2, "code": 1}
    assert f.filtered_tokens == 2 * 2 * 4 and f.since_step == 2
    m = f.metrics()
    assert m["rollout/filtered_frac"] == pytest.approx(2 / 3)
    assert m["rollout/filtered_frac/math"] == 0.5 and m["rollout/filtered_frac/code"] == 1.0
    assert m["rollout/filtered_groups"] == 2 and m["rollout/filtered_tokens"] == 16
    assert f.keeps(group(0, 1)) and f.metrics()["rollout/filtered_frac_step"] == 0.0


def test_snapshots_are_not_episodes() -> None:
    """A StateLM episode's segments share its reward: one episode with a snapshot is a group of one."""
    final, snap = ep(1.0), ep(1.0)
    snap.is_snapshot = True
    assert GroupFilter("reward", 1).keeps([snap, final])
    assert not GroupFilter("reward", 1).keeps([snap, final, ep(1.0)])


def test_metrics_registry_reads_extras_and_the_shaped_reward() -> None:
    acc = GroupFilter("acc", 2)
    assert not acc.keeps([ep(0.2, acc=1.0), ep(0.9, acc=1.0)])  # rewards differ, acc does not
    assert acc.keeps([ep(0.0, acc=1.0), ep(0.0)]) and acc.unjudged == 1  # acc missing: kept

    def penalties(trajs: Sequence[Trajectory]) -> np.ndarray:
        return np.array([-0.1 * len(t.response_ids) for t in trajs])

    shaped = GroupFilter("seq_final_reward", 2, penalties=penalties)
    scored = GroupFilter("seq_reward", 2, penalties=penalties)
    same_score = [ep(1.0, response_len=2), ep(1.0, response_len=6)]
    assert shaped.keeps(same_score) and not scored.keeps(same_score)


def test_max_num_gen_batches_bounds_the_groups_judged_for_one_step() -> None:
    f = GroupFilter("reward", 4, max_num_gen_batches=2)
    for _ in range(4):
        f.keeps(group(0, 0))
    assert not f.exhausted(buffered=3)  # 4 filtered + 3 kept: 7 of the 8 judged allowed
    f.keeps(group(1, 1))
    assert f.exhausted(buffered=3) and not f.exhausted(buffered=4)  # 4 kept: the step goes
    assert "max_num_gen_batches=2" in str(f.exhausted_error(3))
    f.step_taken()
    assert not f.exhausted(buffered=0)
    unbounded = GroupFilter("reward", 4)
    for _ in range(100):
        unbounded.keeps(group(0, 0))
    assert not unbounded.exhausted(buffered=0)


def test_pass_rate_follows_recent_groups_and_state_round_trips() -> None:
    f = GroupFilter("reward", 2)
    assert f.pass_rate == 1.0  # nothing judged: plan as without a filter
    for kept in (True, False, False, False):
        f.keeps(group(0, 1) if kept else group(0, 0))
    assert f.pass_rate == (1 + 2) / (4 + 2)  # a prior of one batch (2 groups) kept
    for _ in range(8):  # the window is 4 batches of 2: only the last 8 count
        f.keeps(group(0, 0))
    assert f.pass_rate == 2 / 10
    for _ in range(100):
        f.keeps(group(0, 0))
    assert GroupFilter("reward", 1000).pass_rate == 1.0 and f.pass_rate >= MIN_PASS_RATE
    g = GroupFilter("reward", 2)
    g.load_state_dict(f.state_dict())
    assert g.pass_rate == f.pass_rate and g.filtered == f.filtered
    assert g.metrics()["rollout/filtered_frac_step"] == 0.0  # restored counts are not new


def test_config_keys_are_verls_and_unknown_ones_refused() -> None:
    base = ["actor_rollout_ref.model.path=m", "data.train_files=t.jsonl"]
    cfg = load_config(
        None,
        [
            *base,
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=acc",
            "algorithm.filter_groups.max_num_gen_batches=10",
        ],
        check_paths=False,
    )
    f = group_filter.from_config(cfg)
    assert f is not None and f.metric == "acc" and f.max_num_gen_batches == 10
    assert group_filter.from_config(load_config(None, base, check_paths=False)) is None
    with pytest.raises(Exception, match="filter_groups"):
        load_config(None, [*base, "algorithm.filter_groups.nope=1"], check_paths=False)


def test_admission_plans_on_an_upper_bound_of_the_groups_kept() -> None:
    a = Admission(batch_groups=4, max_staleness=1)
    a.joined("s")
    a.pass_rate = 0.5
    for n in range(1, 200):  # at least the mean, at most all, 2 standard deviations above the mean
        assert n * 0.5 <= a.kept_bound(n) <= n
        assert a.kept_bound(n) >= min(n, n * 0.5 + 2 * (n * 0.25) ** 0.5)
    # A window of 8: more than 8 generating, as many as keep the bound within it.
    ((_, granted),) = a.grants(held=0, remaining=100, min_version=0)
    assert granted > 8 and a.kept_bound(granted) <= 8 < a.kept_bound(granted + 1)
    assert a.grants(held=0, remaining=100, min_version=0) == []
    assert len(a.deadlines()) == a.kept_bound(granted)  # what feasibility counts
    # As without a filter: 8 (at most) due by version 1, and one step of 4 before it.
    assert not a.can_take([], 0)
    for _ in range(granted - 2):
        a.received("s", 0)  # arrived: filtered, or held in the buffer
    assert a.generating == 2 and len(a.deadlines()) == 2 and a.can_take([], 0)
    # the run's end bounds it: 3 groups left to train, 2 generating, 3 at least planned
    assert a.grants(held=0, remaining=3, min_version=0) == [("s", 1)]
    a.pass_rate = 1.0
    assert a.kept_bound(7) == 7


def test_admission_without_a_filter_is_unchanged() -> None:
    a = Admission(batch_groups=4, max_staleness=1)
    a.joined("s")
    assert a.grants(held=3, remaining=100, min_version=0) == [("s", 5)]
    assert a.deadlines() == [1] * 5
