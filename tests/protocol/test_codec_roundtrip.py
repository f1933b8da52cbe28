"""Codec round trips, the trajectory column layout, zero-copy decoding and minor-version tolerance."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from protocol_testkit import (
    decode_error,
    header,
    make_traj,
    on_wire,
    sample_messages,
    trajs_equal,
    with_header,
)

from protocol import codec
from protocol.errors import ErrorCode
from protocol.messages import MESSAGE_TYPES, ChunkPart, MsgType, TrajectoryBatch, WeightsChunk
from protocol.trajectory import COLUMNS, FIELDS, META_ORDER, Trajectory

SAMPLES = sample_messages()


def _same(a: object, b: object) -> bool:
    if isinstance(a, TrajectoryBatch):
        assert isinstance(b, TrajectoryBatch)
        return (
            a.seq == b.seq
            and len(a.trajectories) == len(b.trajectories)
            and all(trajs_equal(x, y) for x, y in zip(a.trajectories, b.trajectories, strict=True))
        )
    if isinstance(a, WeightsChunk):
        assert isinstance(b, WeightsChunk)
        return dataclasses.replace(a, frames=()) == dataclasses.replace(b, frames=()) and [
            bytes(f) for f in a.frames
        ] == [bytes(f) for f in b.frames]
    return a == b


def test_samples_cover_every_message_type() -> None:
    assert set(SAMPLES) == set(MsgType) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("t", list(MsgType), ids=lambda t: t.name)
def test_round_trip(t: MsgType) -> None:
    msg = SAMPLES[t]
    frames = on_wire(codec.encode(msg))
    assert frames[0] == bytes((t,))
    assert codec.peek_type(frames) is t
    back = codec.decode(frames)
    assert type(back) is type(msg)
    assert _same(msg, back)
    # encoding is canonical: decode -> encode reproduces every frame byte for byte
    assert on_wire(codec.encode(back)) == frames


@pytest.mark.parametrize(
    "t",
    [t for t in MsgType if t not in (MsgType.TRAJECTORY_BATCH, MsgType.WEIGHTS_CHUNK)],
    ids=lambda t: t.name,
)
def test_header_only_messages_have_two_frames_in_field_order(t: MsgType) -> None:
    frames = codec.encode(SAMPLES[t])
    assert len(frames) == 2
    # Fields appended since 1.2 are left out at their default (older encodings keep their bytes).
    names = [
        f.name
        for f in dataclasses.fields(MESSAGE_TYPES[t])
        if not (f.metadata.get("omit_default") and getattr(SAMPLES[t], f.name) == f.default)
    ]
    assert list(header(frames)) == names


def test_fields_since_1_2_are_encoded_only_when_set() -> None:
    plain = codec.encode(SAMPLES[MsgType.HELLO])
    assert "host" not in header(plain)
    with_host = dataclasses.replace(SAMPLES[MsgType.HELLO], host="machine-a")
    assert header(codec.encode(with_host))["host"] == "machine-a"
    assert codec.decode(codec.encode(with_host)) == with_host


def test_batch_column_layout() -> None:
    trajs = [
        make_traj("a", prompt_len=3, response_len=4, seed=1),
        make_traj("b", prompt_len=2, response_len=5, seed=2, termination="length", num_turns=3),
    ]
    frames = codec.encode(TrajectoryBatch(9, trajs))
    assert len(frames) == 2 + len(COLUMNS) == 7
    h = header(frames)
    assert list(h) == ["seq", "columns", "meta"]
    assert h["seq"] == 9
    assert h["columns"] == [
        ["prompt_ids", "int32"],
        ["response_ids", "int32"],
        ["response_mask", "uint8"],
        ["rollout_logprobs", "float32"],
        ["versions", "int32"],
    ]
    # per-trajectory scalars are columns too: field -> one value per trajectory, lengths included
    # (optional maps that are empty for the whole batch are left out: tests/protocol/test_actions.py)
    assert set(h["meta"]) == set(META_ORDER) - {f.name for f in FIELDS if f.omit_when_empty}
    assert h["meta"]["trajectory_id"] == ["a", "b"]
    assert (h["meta"]["prompt_len"], h["meta"]["response_len"]) == ([3, 2], [4, 5])
    assert (h["meta"]["termination"], h["meta"]["num_turns"]) == (["answered", "length"], [1, 3])
    # each token column frame: that column of every trajectory, concatenated, little-endian raw bytes
    for i, (name, _attr, dtype, _ok) in enumerate(COLUMNS):
        want = np.concatenate([getattr(t, name) for t in trajs]).astype(
            np.dtype(dtype).newbyteorder("<")
        )
        assert on_wire(frames)[2 + i] == want.tobytes()


def test_batch_of_zero_trajectories_round_trips() -> None:
    frames = on_wire(codec.encode(TrajectoryBatch(1, [])))
    assert [len(f) for f in frames[2:]] == [0] * 5
    assert list(codec.decode(frames).trajectories) == []


def test_encoder_normalises_dtypes_and_accepts_wide_columns() -> None:
    t = make_traj("a", seed=3)
    wide = Trajectory(
        **{
            **t.__dict__,
            "prompt_ids": t.prompt_ids.astype(np.int64),
            "rollout_logprobs": t.rollout_logprobs.astype(np.float64),
            "response_mask": t.response_mask.astype(bool),
        }
    )
    frames = on_wire(codec.encode(TrajectoryBatch(1, [wide])))
    assert header(frames)["columns"][0] == ["prompt_ids", "int32"]
    assert trajs_equal(codec.decode(frames).trajectories[0], t)


def test_receiver_accepts_every_allowed_column_dtype() -> None:
    """A sender may ship int64 ids, bool masks and float64 logprobs; dtypes are named in the header."""
    t = make_traj("a", seed=4)
    frames = codec.encode(TrajectoryBatch(1, [t]))
    h = header(frames)
    h["columns"] = [
        ["prompt_ids", "int64"],
        ["response_ids", "int64"],
        ["response_mask", "bool"],
        ["rollout_logprobs", "float64"],
        ["versions", "int64"],
    ]
    payload = [
        t.prompt_ids.astype("<i8").tobytes(),
        t.response_ids.astype("<i8").tobytes(),
        t.response_mask.astype(bool).tobytes(),
        t.rollout_logprobs.astype("<f8").tobytes(),
        t.versions.astype("<i8").tobytes(),
    ]
    back = codec.decode([frames[0], msgpack.packb(h), *payload]).trajectories[0]
    assert back.prompt_ids.dtype == np.dtype("<i8") and back.response_mask.dtype == np.bool_
    assert np.array_equal(back.prompt_ids, t.prompt_ids) and np.array_equal(
        back.rollout_logprobs, t.rollout_logprobs
    )


def test_decoded_arrays_are_read_only_views_of_the_frames() -> None:
    frames = on_wire(codec.encode(TrajectoryBatch(1, [make_traj("a"), make_traj("b", seed=1)])))
    batch = codec.decode(frames)
    for i, (name, *_rest) in enumerate(COLUMNS):
        frame_arr = np.frombuffer(frames[2 + i], np.uint8)
        for t in batch.trajectories:
            arr = getattr(t, name)
            assert np.shares_memory(arr, frame_arr), name  # no copy was made
            assert not arr.flags.writeable


def test_weight_chunk_frames_are_views_of_the_received_frames() -> None:
    frames = on_wire(codec.encode(SAMPLES[MsgType.WEIGHTS_CHUNK]))
    chunk = codec.decode(frames)
    for f, mv in zip(frames[2:], chunk.frames, strict=True):
        assert isinstance(mv, memoryview) and mv.obj is f


def test_encoded_chunk_frames_are_the_callers_buffers() -> None:
    buf = np.arange(8, dtype=np.uint8)
    mv = memoryview(buf)
    chunk = WeightsChunk("t", 1, 0, [ChunkPart(0, 0, 3)], (mv[:3],))
    frames = codec.encode(chunk)
    # handed to the transport as is (send_multipart(copy=False))
    assert frames[2] is chunk.frames[0]


# -- newer minor versions: unknown keys are ignored ------------------------------------------------
def _add_unknown_keys(obj: object) -> object:
    """Append a key to every map in a header, recursively: what a newer minor version may send."""
    if isinstance(obj, dict):
        out = {k: _add_unknown_keys(v) for k, v in obj.items()}
        out["zz_added_in_1_9"] = {"nested": [1, 2.5, "x", None, b"\x00"]}
        return out
    if isinstance(obj, list):
        return [_add_unknown_keys(v) for v in obj]
    return obj


@pytest.mark.parametrize("t", list(MsgType), ids=lambda t: t.name)
def test_unknown_keys_are_ignored_at_every_level(t: MsgType) -> None:
    msg = SAMPLES[t]
    frames = on_wire(codec.encode(msg))
    h = header(frames)
    if t is MsgType.TRAJECTORY_BATCH:  # a newer minor appends a per-trajectory meta column
        n = len(h["meta"]["trajectory_id"])
        h = {
            **h,
            "meta": {**h["meta"], "zz_added_in_1_9": [{"k": 1}] * n, "zz_scalar": 3},
            "zz_added_in_1_9": 1,
        }
    elif t in (MsgType.HELLO, MsgType.WELCOME, MsgType.WEIGHTS_ANNOUNCE, MsgType.WEIGHTS_CHUNK):
        h = _add_unknown_keys(h)  # nested structs (Identity, Limits, TensorSpec, ChunkPart) too
    else:
        h = {**h, "zz_added_in_1_9": [1, 2]}
    newer = with_header(frames, h)
    back = codec.decode(newer)
    assert _same(msg, back)


def test_missing_optional_fields_take_their_defaults() -> None:
    """An older minor version omits appended fields: the decoder fills in the defaults."""
    frames = on_wire(codec.encode(SAMPLES[MsgType.HELLO]))
    h = header(frames)
    del h["policy_version"], h["capabilities"]
    del h["tokenizer"]["vocab_size"]
    hello = codec.decode(with_header(frames, h))
    assert (
        hello.policy_version == 0 and hello.capabilities == [] and hello.tokenizer.vocab_size == 0
    )
    frames = on_wire(codec.encode(TrajectoryBatch(1, [make_traj("a"), make_traj("b")])))
    h = header(frames)
    required = [f.name for f in FIELDS if f.required and f.placement != "token"]
    h["meta"] = {k: h["meta"][k] for k in required}
    a, b = codec.decode(with_header(frames, h)).trajectories
    for t in (a, b):
        assert (t.termination, t.num_turns, t.is_snapshot, t.snapshot_index) == (
            "answered",
            1,
            False,
            0,
        )
        assert (t.source_server, t.reward_extras, t.timings) == ("", {}, {})
    assert a.reward_extras is not b.reward_extras  # defaults are not shared between trajectories


# -- missing required fields ------------------------------------------------------------------------
def _required(cls: type) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


REQUIRED = [
    (t, name)
    for t in MsgType
    if t not in (MsgType.TRAJECTORY_BATCH, MsgType.WEIGHTS_CHUNK)
    for name in _required(MESSAGE_TYPES[t])
]


@pytest.mark.parametrize(("t", "name"), REQUIRED, ids=[f"{t.name}.{n}" for t, n in REQUIRED])
def test_missing_required_field_is_invalid_field_naming_it(t: MsgType, name: str) -> None:
    frames = on_wire(codec.encode(SAMPLES[t]))
    h = header(frames)
    del h[name]
    e = decode_error(with_header(frames, h))
    assert e.code is ErrorCode.INVALID_FIELD
    assert e.field == f"{t.name}.{name}" and "missing required field" in e.message
    assert e.ref_type == t


@pytest.mark.parametrize("name", [f.name for f in FIELDS if f.required and f.placement != "token"])
def test_missing_required_trajectory_field(name: str) -> None:
    frames = on_wire(codec.encode(TrajectoryBatch(4, [make_traj("a"), make_traj("b")])))
    h = header(frames)
    del h["meta"][name]
    e = decode_error(with_header(frames, h))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, f"meta.{name}")
    assert "missing required field" in e.message
    assert (e.ref_type, e.ref_seq) == (MsgType.TRAJECTORY_BATCH, 4)


@pytest.mark.parametrize(
    ("t", "name"),
    [
        (MsgType.TRAJECTORY_BATCH, "seq"),
        (MsgType.WEIGHTS_CHUNK, "transfer_id"),
        (MsgType.WEIGHTS_CHUNK, "version"),
        (MsgType.WEIGHTS_CHUNK, "index"),
        (MsgType.WEIGHTS_CHUNK, "parts"),
    ],
)
def test_missing_required_field_of_payload_messages(t: MsgType, name: str) -> None:
    frames = on_wire(codec.encode(SAMPLES[t]))
    h = header(frames)
    del h[name]
    e = decode_error(with_header(frames, h))
    assert e.code in (ErrorCode.INVALID_FIELD, ErrorCode.MALFORMED)
    assert e.field == f"{t.name}.{name}"


def test_missing_nested_field_names_the_dotted_path() -> None:
    frames = on_wire(codec.encode(SAMPLES[MsgType.WELCOME]))
    h = header(frames)
    del h["limits"]["max_tokens_per_trajectory"]
    e = decode_error(with_header(frames, h))
    assert e.field == "WELCOME.limits.max_tokens_per_trajectory"
