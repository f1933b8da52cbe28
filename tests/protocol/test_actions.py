"""``Trajectory.actions`` on the wire: round trips, left out when empty, validated when present."""

from __future__ import annotations

import math

import pytest
from protocol_testkit import decode_error, header, make_traj, on_wire, with_header

from protocol import codec
from protocol.batch import TrajectoryBuilder
from protocol.errors import ErrorCode
from protocol.messages import TrajectoryBatch


def _frames(*trajs) -> list[bytes]:
    return on_wire(codec.encode(TrajectoryBatch(3, list(trajs))))


def test_actions_round_trip_and_snapshots_carry_none() -> None:
    snap = make_traj("e-0", is_snapshot=True)
    final = make_traj("e-1", snapshot_index=1, actions={"snapshots": 1, "tool_calls/note": 2.0})
    frames = _frames(snap, final)
    assert header(frames)["meta"]["actions"] == [{}, {"snapshots": 1, "tool_calls/note": 2.0}]
    back = codec.decode(frames)
    assert isinstance(back, TrajectoryBatch)
    assert [t.actions for t in back.trajectories] == [{}, {"snapshots": 1, "tool_calls/note": 2.0}]
    assert on_wire(codec.encode(back)) == frames  # canonical


def test_empty_actions_are_left_out_and_default_to_empty() -> None:
    builder = TrajectoryBuilder()
    builder.append(make_traj("a"))
    builder.append(make_traj("b", seed=1))
    frames = on_wire(codec.encode(TrajectoryBatch(1, builder.build())))
    assert "actions" not in header(frames)["meta"]  # an older peer's batch, byte for byte
    back = codec.decode(frames)
    assert isinstance(back, TrajectoryBatch)
    assert [t.actions for t in back.trajectories] == [{}, {}]


@pytest.mark.parametrize(
    "value",
    [{"tool_calls": -1}, {"snapshots": math.nan}, {"x": math.inf}, {"x": True}, {"x": "2"}, [1], 5],
)
def test_invalid_actions_are_refused_naming_the_trajectory(value: object) -> None:
    frames = _frames(make_traj("a", actions={"tool_calls": 1}), make_traj("b", seed=1))
    h = header(frames)
    h["meta"]["actions"][1] = value
    e = decode_error(with_header(frames, h))
    assert e.code is ErrorCode.INVALID_FIELD
    assert e.field == "trajectories[1].actions", e
