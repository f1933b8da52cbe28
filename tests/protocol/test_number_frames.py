"""The 1.5 batch form: per-trajectory numbers as binary frames after the token columns.

Every rule the 1.3/1.4 header lists had holds for the frames (same field paths in errors), both
forms decode to the same batch, and a sender uses the new form only with a learner that announced
1.5 (SPEC §4).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from protocol_testkit import (
    Net,
    decode_error,
    header,
    learner,
    make_traj,
    on_wire,
    rollout,
    trajs_equal,
    with_header,
)

from protocol import codec
from protocol.errors import ErrorCode
from protocol.limits import CodecLimits
from protocol.messages import MsgType, TrajectoryBatch
from protocol.sender import SenderState
from protocol.trajectory import COLUMNS, HEADER_FIELDS, NUMBERS
from protocol.version import ProtocolVersion

NAMES = [f.name for f in NUMBERS]
FIRST = 2 + len(COLUMNS)  # index of the first number frame


def trajs() -> list:
    return [
        make_traj("a", prompt_len=3, response_len=4, seed=1),
        make_traj(
            "b",
            prompt_len=2,
            response_len=5,
            seed=2,
            termination="length",
            num_turns=3,
            snapshot_index=2,
            is_snapshot=True,
            actions={"tool_calls": 2},
        ),
    ]


def batch(*ts, seq: int = 7) -> list[bytes]:
    return on_wire(codec.encode(TrajectoryBatch(seq, list(ts) or trajs()), number_frames=True))


def with_number(frames: list[bytes], name: str, values: list, dtype: str | None = None) -> list:
    """``frames`` with number column ``name`` replaced (and its descriptor, given ``dtype``)."""
    i = NAMES.index(name)
    spec = NUMBERS[i]
    dt = dtype or spec.dtype
    out = list(frames)
    out[FIRST + i] = np.asarray(values, dtype=np.dtype(dt).newbyteorder("<")).tobytes()
    if dtype:
        h = header(out)
        h["columns"][len(COLUMNS) + i] = [name, dtype]
        out = with_header(out, h)
    return out


def test_layout() -> None:
    ts = trajs()
    frames = batch(*ts)
    assert len(frames) == FIRST + len(NUMBERS) == 13
    h = header(frames)
    assert h["columns"][len(COLUMNS) :] == [
        ["reward", "float64"],
        ["snapshot_index", "int32"],
        ["is_snapshot", "uint8"],
        ["num_turns", "int32"],
        ["prompt_len", "int32"],
        ["response_len", "int32"],
    ]
    assert set(h["meta"]) == {f.name for f in HEADER_FIELDS}  # no number left in the header
    got = {
        n: np.frombuffer(frames[FIRST + i], NUMBERS[i].dtype).tolist() for i, n in enumerate(NAMES)
    }
    assert got == {
        "reward": [0.5, 0.5],
        "snapshot_index": [0, 2],
        "is_snapshot": [0, 1],
        "num_turns": [1, 3],
        "prompt_len": [3, 2],
        "response_len": [4, 5],
    }


def test_both_forms_decode_to_the_same_batch() -> None:
    ts = trajs()
    old = codec.decode(on_wire(codec.encode(TrajectoryBatch(7, ts))))
    new = codec.decode(batch(*ts))
    assert old.trajectories.meta == new.trajectories.meta
    for a, b, t in zip(old.trajectories, new.trajectories, ts, strict=True):
        assert trajs_equal(a, b) and trajs_equal(b, t)
        assert type(b.reward) is float and type(b.is_snapshot) is bool and type(b.num_turns) is int


def test_header_form_of_a_new_batch_is_the_old_encoding() -> None:
    ts = trajs()
    new = codec.encode(TrajectoryBatch(7, ts), number_frames=True)
    assert on_wire(codec.header_form(new)) == on_wire(codec.encode(TrajectoryBatch(7, ts)))
    old = codec.encode(TrajectoryBatch(7, ts))
    assert codec.header_form(old) is old


def test_empty_batch() -> None:
    frames = on_wire(codec.encode(TrajectoryBatch(1, []), number_frames=True))
    assert len(frames) == 13 and not any(frames[2:])
    assert len(codec.decode(frames).trajectories) == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("reward", math.nan),
        ("reward", math.inf),
        ("prompt_len", 0),
        ("prompt_len", -1),
        ("response_len", -2),
        ("num_turns", -1),
        ("snapshot_index", -3),
        ("is_snapshot", 2),
    ],
)
def test_invalid_number(name: str, value: object) -> None:
    frames = batch()
    good = np.frombuffer(frames[FIRST + NAMES.index(name)], NUMBERS[NAMES.index(name)].dtype)
    e = decode_error(with_number(frames, name, [good[0], value]))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, f"trajectories[1].{name}"), e
    assert (e.ref_type, e.ref_seq) == (MsgType.TRAJECTORY_BATCH, 7)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("reward", "float32"),
        ("num_turns", "int64"),
        ("prompt_len", "int64"),
        ("is_snapshot", "bool"),
    ],
)
def test_accepted_dtypes(name: str, dtype: str) -> None:
    frames = batch()
    values = np.frombuffer(frames[FIRST + NAMES.index(name)], NUMBERS[NAMES.index(name)].dtype)
    msg = codec.decode(with_number(frames, name, values.tolist(), dtype))
    assert msg.trajectories.meta[name] == codec.decode(frames).trajectories.meta[name]


@pytest.mark.parametrize(
    "bad", [["reward", "int32"], ["num_turns", "float64"], ["prompt_len"], "x"]
)
def test_wrong_number_descriptor(bad: object) -> None:
    frames = batch()
    h = header(frames)
    i = len(COLUMNS) + (NAMES.index(bad[0]) if isinstance(bad, list) else 0)
    h["columns"][i] = bad
    e = decode_error(with_header(frames, h))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, f"columns.{NAMES[i - len(COLUMNS)]}")


@pytest.mark.parametrize("name", ["reward", "num_turns", "response_len"])
def test_number_frame_of_the_wrong_length(name: str) -> None:
    frames = batch()
    i = FIRST + NAMES.index(name)
    frames[i] = frames[i][:-1]
    e = decode_error(frames)
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, name)


def test_lengths_disagree_with_token_frames() -> None:
    frames = batch()
    e = decode_error(with_number(frames, "response_len", [4, 6]))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, "response_ids")


def test_header_lists_must_match_the_number_frames() -> None:
    frames = batch()
    h = header(frames)
    h["meta"]["trajectory_id"].append("c")
    e = decode_error(with_header(frames, h))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, "meta.trajectory_id")


@pytest.mark.parametrize(("name", "value"), [("termination", "exploded"), ("timings", {"g": "x"})])
def test_invalid_header_value(name: str, value: object) -> None:
    frames = batch()
    h = header(frames)
    h["meta"][name][1] = value
    e = decode_error(with_header(frames, h))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, f"trajectories[1].{name}")


def test_missing_frame() -> None:
    e = decode_error(batch()[:-1])
    assert (e.code, e.field) == (ErrorCode.MALFORMED, "columns")


def test_limits() -> None:
    frames = batch()
    assert (
        decode_error(frames, CodecLimits(max_trajectories_per_batch=1)).code is ErrorCode.TOO_LARGE
    )
    e = decode_error(frames, CodecLimits(max_tokens_per_trajectory=6))
    assert (e.code, e.field) == (ErrorCode.TOO_LARGE, "trajectories[0]")
    e = decode_error(frames, CodecLimits(max_model_len=6))
    assert (e.code, e.field) == (ErrorCode.TOO_LARGE, "trajectories[0].prompt_len+response_len")
    e = decode_error(frames, CodecLimits(max_response_tokens=4))
    assert (e.code, e.field) == (ErrorCode.TOO_LARGE, "trajectories[1].response_len")
    codec.decode(frames, CodecLimits(max_trajectories_per_batch=2, max_model_len=7))


# -- negotiation ------------------------------------------------------------------------------------
def _batch_frames(net: Net) -> list[int]:
    return [len(r.frames) for r in net.sent("up", MsgType.TRAJECTORY_BATCH)]


@pytest.mark.parametrize(
    ("sender_v", "learner_v", "frames"),
    [((1, 5), (1, 5), 13), ((1, 5), (1, 4), 7), ((1, 4), (1, 5), 7), ((1, 9), (1, 7), 13)],
)
def test_new_form_only_between_1_5_peers(sender_v: tuple, learner_v: tuple, frames: int) -> None:
    net = Net(learner(version=ProtocolVersion(*learner_v)))
    conn = net.add(b"r0", rollout(version=ProtocolVersion(*sender_v)))
    conn.submit([make_traj("early")])  # encoded before WELCOME: the learner's version is unknown
    net.pump()
    assert conn.state is SenderState.READY
    conn.submit([make_traj("a"), make_traj("b")])
    net.pump()
    assert net.delivered_ids() == ["early", "a", "b"] and conn.pending == 0
    assert _batch_frames(net) == [frames, frames]


def test_resent_after_reconnecting_to_an_older_learner() -> None:
    """Batches encoded for a 1.5 learner and unacknowledged go to its 1.4 successor converted."""
    net = Net(learner())
    conn = net.add(b"r0", rollout())
    net.pump()
    net.drop = lambda direction, ident, frames: direction == "down"  # the ACK is lost
    conn.submit([make_traj("a")])
    net.pump()
    net.drop = None
    net.learner = learner(version=ProtocolVersion(1, 4))  # the learner restarts, older
    conn.start(net.clock.now)
    net.pump()
    assert conn.pending == 0
    assert _batch_frames(net) == [13, 7]


def test_a_1_5_batch_fits_the_learners_message_budget() -> None:
    """The transport reads a batch within the budget of a peer holding a credit: 13 frames too."""
    from protocol.budget import MessageReader

    net = Net(learner(capacity=4, max_credits_per_peer=2))
    net.add(b"r0", rollout())
    net.pump()
    reader = MessageReader(net.learner.message_budget(b"r0"))
    frames = batch()
    for f in frames:
        reader.add(f)
    assert reader.result() == frames
