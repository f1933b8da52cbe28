"""GroupBuffer: grouping, take order, staleness drops and the per-record room accounting."""

from __future__ import annotations

import random

import numpy as np
import pytest

from learner.buffer import GroupBuffer, oldest_version, split_groups
from protocol.lineage import Lineage
from protocol.trajectory import Trajectory


def traj(
    tid: str, group: str, versions: list[int] | None = None, mask: list[int] | None = None
) -> Trajectory:
    versions = [3, 3, 3, 3] if versions is None else versions
    mask = [1] * len(versions) if mask is None else mask
    n = len(versions)
    return Trajectory(
        tid,
        group,
        np.arange(3, dtype=np.int32),
        np.arange(n, dtype=np.int32),
        np.array(mask, np.uint8),
        np.zeros(n, np.float32),
        np.array(versions, np.int32),
    )


def record(groups: dict[str, int], version: int = 3, tag: str = "") -> list[Trajectory]:
    """A batch: ``groups`` maps group uid -> size; every token made by ``version``."""
    return [traj(f"{tag}{g}-{i}", g, [version] * 4) for g, n in groups.items() for i in range(n)]


def test_oldest_version_counts_trained_tokens_only() -> None:
    # a tool token's version is ignored
    assert oldest_version(traj("a", "g", [1, 5, 6], [0, 1, 1])) == 5
    assert oldest_version(traj("b", "g", [4, 2, 7], [0, 0, 0])) == 2  # nothing trained: all tokens
    assert oldest_version(traj("c", "g", [], [])) is None
    bool_mask = traj("d", "g", [9, 2], [1, 0])
    bool_mask.response_mask = bool_mask.response_mask.astype(bool)
    assert oldest_version(bool_mask) == 9


def test_groups_keep_their_variable_sizes_and_batch_order() -> None:
    trajs = [traj("a0", "A"), traj("b0", "B"), traj("a1", "A"), traj("c0", "C"), traj("a2", "A")]
    groups = split_groups(7, trajs)
    assert [g.key for g in groups] == [(7, "A"), (7, "B"), (7, "C")]
    assert [[t.trajectory_id for t in g.trajectories] for g in groups] == [
        ["a0", "a1", "a2"],
        ["b0"],
        ["c0"],
    ]
    empty = split_groups(1, [traj("e", "E", [], [])])[0]
    assert empty.oldest_version is None and empty.staleness(100) == 0


def test_take_is_oldest_first_and_groups_stay_whole() -> None:
    buf = GroupBuffer()
    assert len(buf.add(1, record({"a": 3, "b": 1}))) == 2
    assert len(buf.add(2, record({"c": 2}))) == 1
    out = buf.take(2, policy_version=3, max_staleness=0)
    assert [g.key for g in out.groups] == [(1, "a"), (1, "b")] and [
        len(g.trajectories) for g in out.groups
    ] == [3, 1]
    assert not out.dropped and len(buf) == 1 and buf.in_flight == 2
    assert buf.take(5, 3, 0).groups[0].key == (2, "c")  # fewer than asked: what there is
    assert buf.take(1, 3, 0).groups == []


def test_stale_groups_are_dropped_and_counted() -> None:
    buf = GroupBuffer()
    buf.add(1, record({"old": 2}, version=1) + record({"new": 2}, version=4))
    buf.add(2, record({"older": 1}, version=0))
    out = buf.take(4, policy_version=5, max_staleness=1)  # staleness: old 4, new 1, older 5
    assert [g.uid for g in out.groups] == ["new"]
    assert sorted(g.uid for g in out.dropped) == ["old", "older"]
    assert out.done_records == [2]  # record 1 still has "new" in flight
    assert buf.dropped_stale == 2
    assert out.groups[0].staleness(5) == 1
    assert buf.finish([(1, "new")]) == [1]


def test_staleness_uses_the_oldest_trained_token_of_the_group() -> None:
    buf = GroupBuffer()
    buf.add(
        1, [traj("x", "g", [5, 5]), traj("y", "g", [2, 5], [1, 1]), traj("z", "g", [0, 5], [0, 1])]
    )
    (g,) = buf.take(1, policy_version=6, max_staleness=10).groups
    assert g.oldest_version == 2 and g.staleness(6) == 4
    buf2 = GroupBuffer()
    buf2.add(1, [traj("x", "g", [5, 5]), traj("y", "g", [2, 5], [1, 1])])
    assert buf2.drop_stale(6, 3).dropped and buf2.dropped_stale == 1 and buf2.records == 0


def test_room_is_freed_exactly_once_per_record() -> None:
    buf = GroupBuffer()
    buf.add(1, record({"a": 1, "b": 1}))
    buf.add(2, record({"c": 1}))
    assert buf.records == 2
    t1 = buf.take(1, 3, 0)
    assert buf.finish([g.key for g in t1.groups]) == []  # record 1 still has b
    t2 = buf.take(2, 3, 0)
    assert buf.finish([(2, "c")]) == [2]
    assert buf.finish([(1, "b")]) == [1]
    assert buf.records == 0
    with pytest.raises(ValueError, match="finished twice"):
        buf.finish([(1, "b")])
    assert [g.key for g in t2.groups] == [(1, "b"), (2, "c")]


def test_pending_keys_cover_queued_and_in_flight_groups() -> None:
    buf = GroupBuffer()
    buf.add(3, record({"a": 1, "b": 1}))
    buf.add(4, record({"c": 1}))
    buf.take(1, 3, 0)
    assert buf.pending_keys() == [(3, "a"), (3, "b"), (4, "c")]


def test_replayed_record_adds_only_the_named_groups() -> None:
    buf = GroupBuffer()
    assert len(buf.add(5, record({"a": 1, "b": 2, "c": 1}), only={"b"})) == 1
    assert [g.key for g in buf.take(9, 3, 0).groups] == [(5, "b")]
    with pytest.raises(ValueError, match="no group"):
        buf.add(6, record({"a": 1}), only={"zz"})
    with pytest.raises(ValueError, match="already"):
        buf.add(5, record({"a": 1}))


def test_random_workload_frees_every_record_exactly_once() -> None:
    rng = random.Random(0)
    buf = GroupBuffer()
    freed: list[int] = []
    added, in_flight = 0, []
    version = 0
    for rid in range(1, 400):
        buf.add(
            rid,
            record(
                {f"g{j}": rng.randint(1, 3) for j in range(rng.randint(1, 4))},
                version=max(0, version - rng.randint(0, 3)),
                tag=f"r{rid}",
            ),
        )
        added += 1
        if rng.random() < 0.5:
            out = buf.take(rng.randint(1, 5), version, max_staleness=2)
            freed += out.done_records
            in_flight.append([g.key for g in out.groups])
        if in_flight and rng.random() < 0.5:
            freed += buf.finish(in_flight.pop(0))
        version += rng.random() < 0.2
    while in_flight:
        freed += buf.finish(in_flight.pop())
    while len(buf):
        out = buf.take(7, version, max_staleness=2)
        freed += out.done_records + buf.finish([g.key for g in out.groups])
    # each record's room freed once, none left over
    assert sorted(freed) == list(range(1, added + 1))
    assert buf.records == 0 and buf.dropped_stale > 0


def test_after_a_restart_groups_are_aged_by_the_updates_between_the_weights() -> None:
    # Checkpoint at version 10, versions up to 12 published, resumed as 13 (the weights of 10).
    # Plain differences made every group accepted before the restart 3 versions older than it
    # is: with max_staleness 2 all were dropped, collateral of the restart.
    buf = GroupBuffer(Lineage().resumed(13, 10))
    buf.add(1, record({"at10": 2}, version=10) + record({"at9": 2}, version=9))
    buf.add(2, record({"at12": 2}, version=12) + record({"at8": 2}, version=8))
    out = buf.take(4, policy_version=14, max_staleness=2)
    # 10 -> 13 is no update: 1 at 14; 9: 2; 12 is on the discarded branch, 2 back to 10: 3
    # (stale); 8: 3 (stale)
    assert sorted(g.uid for g in out.groups) == ["at10", "at9"]
    assert sorted(g.uid for g in out.dropped) == ["at12", "at8"]
    assert {g.uid: g.staleness(14) for g in out.groups} == {"at10": 1, "at9": 2}
    plain = GroupBuffer()
    plain.add(1, record({"at10": 2}, version=10))
    assert [g.uid for g in plain.take(1, policy_version=14, max_staleness=2).dropped] == ["at10"]


def test_groups_carried_over_a_restart_are_trained_past_the_bound_not_dropped() -> None:
    # The same restart, the records replayed from the journal (carried): the rollback put "at12"
    # (discarded branch) and "at8" past the bound, yet they were accepted under it: trained once,
    # first, and counted as past the bound; a group accepted after the restart is still dropped.
    buf = GroupBuffer(Lineage().resumed(13, 10))
    buf.add(1, record({"at10": 2}, version=10) + record({"at9": 2}, version=9), carried=True)
    buf.add(2, record({"at12": 2}, version=12) + record({"at8": 2}, version=8), carried=True)
    buf.add(3, record({"new": 2}, version=13))
    buf.add(4, record({"late": 2}, version=8))  # accepted now (a resend, say), past the bound
    assert [g.deadline(2) for g in buf.by_deadline() if g.carried] == [None] * 4
    out = buf.take(4, policy_version=14, max_staleness=2)
    assert [g.uid for g in out.dropped] == ["late"]
    assert sorted(g.uid for g in out.groups) == ["at10", "at12", "at8", "at9"]
    assert sorted(g.uid for g in out.groups if g.past_bound(14, 2)) == ["at12", "at8"]
    assert [g.uid for g in buf.take(4, policy_version=14, max_staleness=2).groups] == ["new"]
    assert buf.dropped_stale == 1
