"""Column-wise batches: the builder, lazy trajectories, and the zero-copy paths through the codec."""

from __future__ import annotations

import numpy as np
import pytest
from protocol_testkit import connected, make_traj, on_wire, trajs_equal

from protocol import codec
from protocol.batch import Trajectories, TrajectoryBuilder, as_columns, token_count
from protocol.messages import TrajectoryBatch


def _trajs(n: int = 5) -> list:
    return [
        make_traj(
            f"t{i}",
            prompt_len=2 + i,
            response_len=3 + 2 * i,
            seed=i,
            group_uid=f"g{i // 2}",
            reward_extras={"acc": float(i)},
            timings={"gen_s": 0.1 * i},
        )
        for i in range(n)
    ]


def test_builder_and_list_encode_to_the_same_bytes() -> None:
    trajs = _trajs()
    builder = TrajectoryBuilder(capacity_tokens=4)  # forces several buffer growths
    for t in trajs:
        builder.append(t)
    assert len(builder) == 5 and builder.token_count == token_count(trajs)
    built = builder.build()
    assert len(builder) == 0 and builder.token_count == 0  # build starts a fresh batch
    from_list = [bytes(memoryview(f)) for f in codec.encode(TrajectoryBatch(7, trajs))]
    from_builder = [bytes(memoryview(f)) for f in codec.encode(TrajectoryBatch(7, built))]
    assert from_list == from_builder


def test_builder_casts_to_canonical_dtypes() -> None:
    t = make_traj("wide")
    t.response_ids = t.response_ids.astype(np.int64)
    t.rollout_logprobs = t.rollout_logprobs.astype(np.float64)
    builder = TrajectoryBuilder()
    builder.append(t)
    built = builder.build()
    assert built.columns["response_ids"].dtype == np.int32
    assert built.columns["rollout_logprobs"].dtype == np.float32
    assert trajs_equal(built[0], make_traj("wide"))  # same values, canonical dtypes


def test_builder_rejects_ragged_response_arrays() -> None:
    t = make_traj("ragged")
    t.versions = t.versions[:-1]
    with pytest.raises(ValueError, match="ragged"):
        TrajectoryBuilder().append(t)


def test_decoded_batch_is_lazy_and_views_the_frames() -> None:
    trajs = _trajs()
    frames = on_wire(codec.encode(TrajectoryBatch(1, trajs)))
    batch = codec.decode(frames).trajectories
    assert isinstance(batch, Trajectories)
    assert batch._items is None  # nothing materialised by decoding
    assert batch.ids == [t.trajectory_id for t in trajs] and batch.token_count == token_count(trajs)
    assert batch._items is None
    assert all(trajs_equal(a, b) for a, b in zip(batch, trajs, strict=True))
    assert batch[2] is batch.materialize()[2]  # made once
    assert not batch[0].response_ids.flags.writeable  # a view into the received frame


def test_decoded_batch_reencodes_to_the_same_bytes_without_copying() -> None:
    trajs = _trajs()
    first = on_wire(codec.encode(TrajectoryBatch(3, trajs)))
    decoded = codec.decode(first).trajectories
    again = codec.encode(TrajectoryBatch(3, decoded))
    assert [bytes(memoryview(f)) for f in again] == [bytes(memoryview(f)) for f in first]
    assert np.shares_memory(again[3], decoded.columns["response_ids"])  # handed on, not copied


def test_accepted_wide_dtypes_reencode_canonically() -> None:
    trajs = _trajs(2)
    wide = Trajectories.from_list(trajs)
    wide.columns["prompt_ids"] = wide.columns["prompt_ids"].astype(np.int64)
    frames = codec.encode(TrajectoryBatch(1, wide))
    assert frames[2].dtype == np.int32
    assert [bytes(memoryview(f)) for f in frames] == [
        bytes(memoryview(f)) for f in codec.encode(TrajectoryBatch(1, trajs))
    ]


def test_as_columns_passes_column_batches_through() -> None:
    built = Trajectories.from_list(_trajs(2))
    assert as_columns(built) is built
    assert Trajectories.from_list(built) is built
    assert len(as_columns([])) == 0 and as_columns([]).token_count == 0


def test_learner_hands_fresh_batches_on_as_columns_and_deduplicated_ones_as_objects() -> None:
    net = connected(capacity=16, max_credits=4)
    conn = net.conns[b"r0"]
    conn.submit(_trajs(3))
    conn.submit([make_traj("t1"), make_traj("new")])  # t1 seen before
    net.pump()
    first, second = net.received()
    assert isinstance(first.trajectories, Trajectories) and first.duplicate_trajectories == 0
    assert [t.trajectory_id for t in second.trajectories] == [
        "new"
    ] and second.duplicate_trajectories == 1
