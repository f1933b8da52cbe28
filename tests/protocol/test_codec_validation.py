"""Every validation rule of the codec: each bad input gets the right ErrorCode and field path."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_testkit import decode_error, header, make_traj, on_wire, sample_messages, with_header

from protocol import codec
from protocol.errors import ErrorCode, ProtocolError
from protocol.limits import CodecLimits
from protocol.messages import MsgType, TrajectoryBatch
from protocol.trajectory import COLUMNS

SAMPLES = sample_messages()


def batch(*trajs, seq: int = 7) -> list[bytes]:
    return on_wire(
        codec.encode(TrajectoryBatch(seq, list(trajs) or [make_traj("a"), make_traj("b", seed=1)]))
    )


def bad_batch_error(traj_b, limits: CodecLimits | None = None) -> ProtocolError:
    """Error for a batch whose second trajectory is ``traj_b``; the first one is valid."""
    e = decode_error(batch(make_traj("a"), traj_b), limits)
    # the sender can match it to its batch
    assert (e.ref_type, e.ref_seq) == (MsgType.TRAJECTORY_BATCH, 7)
    return e


# -- token columns -----------------------------------------------------------------------------------
def test_mask_value_2() -> None:
    t = make_traj("b")
    t.response_mask[2] = 2
    e = bad_batch_error(t)
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, "trajectories[1].response_mask[2]")


@pytest.mark.parametrize("value", [0.5, math.nan, math.inf, -math.inf])
def test_logprob_positive_or_not_finite(value: float) -> None:
    t = make_traj("b")
    t.rollout_logprobs[3] = value
    e = bad_batch_error(t)
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, "trajectories[1].rollout_logprobs[3]")


def test_logprob_zero_is_allowed() -> None:
    t = make_traj("b")
    t.rollout_logprobs[:] = 0.0
    codec.decode(batch(make_traj("a"), t))


def test_negative_policy_version() -> None:
    t = make_traj("b")
    t.versions[0] = -1
    e = bad_batch_error(t)
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, "trajectories[1].versions[0]")


@pytest.mark.parametrize(("column", "index"), [("prompt_ids", 1), ("response_ids", 3)])
def test_negative_token_id(column: str, index: int) -> None:
    t = make_traj("b")
    getattr(t, column)[index] = -1
    e = bad_batch_error(t)
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, f"trajectories[1].{column}[{index}]")


@pytest.mark.parametrize("column", ["prompt_ids", "response_ids"])
def test_token_id_at_or_above_vocab_size(column: str) -> None:
    t = make_traj("b")
    getattr(t, column)[0] = 1000
    e = bad_batch_error(t, CodecLimits(vocab_size=1000))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, f"trajectories[1].{column}[0]")
    assert "1000" in e.message
    codec.decode(batch(make_traj("a"), t), CodecLimits(vocab_size=1001))  # 1000 < 1001: fine
    codec.decode(batch(make_traj("a"), t))  # vocab_size 0: ids are only checked for >= 0


@pytest.mark.parametrize(
    ("column", "delta"),
    [
        ("prompt_ids", 4),
        ("response_ids", -4),
        ("response_mask", 1),
        ("rollout_logprobs", -4),
        ("versions", 8),
    ],
)
def test_frame_length_disagrees_with_header_lengths(column: str, delta: int) -> None:
    frames = batch()
    i = [c for c, *_ in COLUMNS].index(column)
    f = frames[2 + i]
    frames[2 + i] = f + b"\x00" * delta if delta > 0 else f[:delta]
    e = decode_error(frames)
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, column)
    assert "bytes" in e.message


def test_header_lengths_disagree_with_frames() -> None:
    frames = batch()
    h = header(frames)
    h["meta"]["response_len"][0] += 1  # every response column is now one token short
    e = decode_error(with_header(frames, h))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, "response_ids")


def test_missing_column_frame() -> None:
    frames = batch()
    e = decode_error(frames[:-1])
    assert (e.code, e.field) == (ErrorCode.MALFORMED, "columns")


@pytest.mark.parametrize(
    "bad",
    [
        ["response_mask", "float16"],
        ["versions", "uint8"],
        ["response_mask"],
        "x",
        ["response_mask", ["uint8"]],
        ["response_mask", {"a": 1}],
    ],
)
def test_wrong_column_descriptor(bad: object) -> None:
    frames = batch()
    h = header(frames)
    i = 4 if bad[0] == "versions" else 2
    h["columns"][i] = bad
    e = decode_error(with_header(frames, h))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, f"columns.{COLUMNS[i][0]}")


def test_columns_out_of_order() -> None:
    frames = batch()
    h = header(frames)
    h["columns"][0], h["columns"][1] = h["columns"][1], h["columns"][0]
    e = decode_error(with_header(frames, h))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, "columns.prompt_ids")


# -- per-trajectory meta columns ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("reward", math.nan),
        ("reward", "high"),
        ("termination", "exploded"),
        ("prompt_len", 0),
        ("prompt_len", -1),
        ("response_len", -2),
        ("num_turns", -1),
        ("snapshot_index", 1.5),
        ("is_snapshot", 1),
        ("trajectory_id", 5),
        ("group_uid", None),
        ("reward_extras", {"x": [1]}),
        ("reward_extras", [1]),
        ("timings", {"gen": "slow"}),
        ("timings", {"gen": math.inf}),
    ],
)
def test_invalid_trajectory_scalar(name: str, value: object) -> None:
    frames = batch()
    h = header(frames)
    h["meta"][name][1] = value
    e = decode_error(with_header(frames, h))
    assert e.code is ErrorCode.INVALID_FIELD
    assert e.field == f"trajectories[1].{name}", e


def test_meta_columns_of_different_lengths() -> None:
    frames = batch()
    h = header(frames)
    h["meta"]["group_uid"].append("extra")
    e = decode_error(with_header(frames, h))
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, "meta.group_uid")


@pytest.mark.parametrize("meta", [None, [], "x", {"trajectory_id": "a"}])
def test_meta_not_a_map_of_lists(meta: object) -> None:
    frames = batch()
    h = header(frames)
    h["meta"] = meta
    e = decode_error(with_header(frames, h))
    assert e.code is ErrorCode.INVALID_FIELD
    assert e.field in ("meta", "meta.trajectory_id")


@pytest.mark.parametrize("seq", [0, -3, "1", True, None, 1.0])
def test_invalid_seq(seq: object) -> None:
    frames = batch()
    h = header(frames)
    h["seq"] = seq
    e = decode_error(with_header(frames, h))
    assert e.code is ErrorCode.INVALID_FIELD
    assert e.field in ("seq", "TRAJECTORY_BATCH.seq")
    assert e.ref_seq == 0  # nothing the sender could match


# -- size limits -------------------------------------------------------------------------------------
def test_too_many_trajectories() -> None:
    e = decode_error(
        batch(make_traj("a"), make_traj("b"), make_traj("c")),
        CodecLimits(max_trajectories_per_batch=2),
    )
    assert e.code is ErrorCode.TOO_LARGE and "3 trajectories" in e.message
    codec.decode(batch(make_traj("a"), make_traj("b")), CodecLimits(max_trajectories_per_batch=2))


def test_too_many_tokens_in_one_trajectory() -> None:
    frames = batch(
        make_traj("a", prompt_len=2, response_len=4), make_traj("b", prompt_len=3, response_len=4)
    )
    e = decode_error(frames, CodecLimits(max_tokens_per_trajectory=6))
    assert (e.code, e.field) == (ErrorCode.TOO_LARGE, "trajectories[1]")
    codec.decode(frames, CodecLimits(max_tokens_per_trajectory=7))


def test_message_too_large() -> None:
    frames = batch()
    size = sum(len(f) for f in frames)
    e = decode_error(frames, CodecLimits(max_message_bytes=size - 1))
    assert e.code is ErrorCode.TOO_LARGE and e.ref_type == MsgType.TRAJECTORY_BATCH
    codec.decode(frames, CodecLimits(max_message_bytes=size))


# -- framing and msgpack -----------------------------------------------------------------------------
def _hello_with(value: object) -> list[bytes]:
    frames = on_wire(codec.encode(SAMPLES[MsgType.HELLO]))
    h = header(frames)
    h["capabilities"] = value
    return with_header(frames, h)


@pytest.mark.parametrize(
    "value", [msgpack.ExtType(5, b"x"), [msgpack.ExtType(0, b"")], {"a": msgpack.ExtType(127, b"")}]
)
def test_ext_types_are_refused(value: object) -> None:
    e = decode_error(_hello_with(value))
    assert e.code is ErrorCode.MALFORMED and "extension" in e.message


@pytest.mark.parametrize("hdr", [[1, 2], 5, "hello", None, b"\x00"])
def test_header_not_a_map(hdr: object) -> None:
    frames = with_header(on_wire(codec.encode(SAMPLES[MsgType.HEARTBEAT])), hdr)
    e = decode_error(frames)
    assert e.code is ErrorCode.MALFORMED and e.ref_type == MsgType.HEARTBEAT


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"\x81", b"\x80\x80", b"\x81\x01\x02"])
def test_header_not_valid_msgpack_or_non_string_keys(raw: bytes) -> None:
    e = decode_error([bytes((MsgType.BYE,)), raw])
    assert e.code is ErrorCode.MALFORMED


@pytest.mark.parametrize("type_frame", [b"", b"\x01\x00", b"\x08\x08"])
def test_type_frame_not_one_byte(type_frame: bytes) -> None:
    e = decode_error([type_frame, msgpack.packb({})])
    assert e.code is ErrorCode.MALFORMED and e.ref_type == 0


@pytest.mark.parametrize("code", [0, 14, 99, 255])  # 11 and 12 exist since 1.1, 13 since 1.3
def test_unknown_type(code: int) -> None:
    e = decode_error([bytes((code,)), msgpack.packb({})])
    assert e.code is ErrorCode.UNKNOWN_TYPE and str(code) in e.message


@pytest.mark.parametrize("frames", [[], [b"\x08"]])
def test_too_few_frames(frames: list[bytes]) -> None:
    assert decode_error(frames).code is ErrorCode.MALFORMED


@pytest.mark.parametrize(
    "t", [MsgType.HELLO, MsgType.ACK, MsgType.ERROR, MsgType.BYE], ids=lambda t: t.name
)
def test_payload_frames_on_a_header_only_message(t: MsgType) -> None:
    e = decode_error([*on_wire(codec.encode(SAMPLES[t])), b"extra"])
    assert e.code is ErrorCode.MALFORMED and e.ref_type == t


# -- field types and values of header-only messages -------------------------------------------------
@pytest.mark.parametrize(
    ("t", "name", "value", "field"),
    [
        (MsgType.HELLO, "peer_id", 5, "HELLO.peer_id"),
        (MsgType.HELLO, "role", "learner-ish", "HELLO.role"),
        (MsgType.HELLO, "policy_version", True, "HELLO.policy_version"),
        (MsgType.HELLO, "model", {"name": "m"}, "HELLO.model.sha256"),
        (MsgType.HELLO, "capabilities", "x", "HELLO.capabilities"),
        (MsgType.HELLO, "capabilities", ["a", 1], "HELLO.capabilities[1]"),
        (MsgType.HELLO, "protocol_version", [1], "HELLO"),
        (MsgType.HELLO, "peer_id", "", "HELLO"),
        (MsgType.WELCOME, "credits", "4", "WELCOME.credits"),
        (MsgType.WELCOME, "heartbeat_interval_s", math.nan, "WELCOME.heartbeat_interval_s"),
        (MsgType.ACK, "seqs", [1, "2"], "ACK.seqs[1]"),
        (MsgType.ACK, "credits", -1, "ACK"),
        (MsgType.HEARTBEAT, "time", math.inf, "HEARTBEAT.time"),
        (MsgType.ERROR, "code", 1.5, "ERROR.code"),
        (MsgType.WEIGHTS_APPLIED, "ok", 1, "WEIGHTS_APPLIED.ok"),
        (MsgType.WEIGHTS_ANNOUNCE, "tensors", [{"name": "w"}], "WEIGHTS_ANNOUNCE.tensors[0].dtype"),
    ],
)
def test_invalid_header_field(t: MsgType, name: str, value: object, field: str) -> None:
    frames = on_wire(codec.encode(SAMPLES[t]))
    h = header(frames)
    h[name] = value
    e = decode_error(with_header(frames, h))
    assert (e.code, e.field, e.ref_type) == (ErrorCode.INVALID_FIELD, field, t)


def test_float_field_accepts_integers() -> None:
    frames = on_wire(codec.encode(SAMPLES[MsgType.HEARTBEAT]))
    h = header(frames)
    h["time"] = 12
    hb = codec.decode(with_header(frames, h))
    assert hb.time == 12.0 and isinstance(hb.time, float)


def test_chunk_parts_and_frames_disagree() -> None:
    frames = on_wire(codec.encode(SAMPLES[MsgType.WEIGHTS_CHUNK]))
    assert decode_error(frames[:-1]).code is ErrorCode.MALFORMED
    bad = [*frames[:-1], frames[-1] + b"!"]
    e = decode_error(bad)
    assert (e.code, e.field) == (ErrorCode.INVALID_FIELD, "parts[1]")
    h = header(frames)
    h["parts"][0]["offset"] = -1
    assert decode_error(with_header(frames, h)).field == "parts[0]"


# -- what goes back on the wire ----------------------------------------------------------------------
def test_error_message_carries_code_field_and_reference() -> None:
    frames = batch()
    h = header(frames)
    h["meta"]["reward"][0] = "x"
    e = decode_error(with_header(frames, h))
    err = codec.error_message(e)
    assert (err.code, err.fatal, err.field, err.ref_type, err.ref_seq) == (
        ErrorCode.INVALID_FIELD,
        False,
        "trajectories[0].reward",
        MsgType.TRAJECTORY_BATCH,
        7,
    )
    assert err.message == e.message and codec.should_answer(e)


def test_fatal_codes() -> None:
    assert {c for c in ErrorCode if c.fatal} == {
        ErrorCode.VERSION_MISMATCH,
        ErrorCode.INCOMPATIBLE_MODEL,
    }


def test_undecodable_error_is_not_answered() -> None:
    frames = on_wire(codec.encode(SAMPLES[MsgType.ERROR]))
    h = header(frames)
    del h["code"]
    e = decode_error(with_header(frames, h))
    assert e.ref_type == MsgType.ERROR and not codec.should_answer(e)


def test_error_codes_are_stable() -> None:
    """Values are wire format: append only."""
    assert [(c.name, c.value) for c in ErrorCode][:12] == [
        ("MALFORMED", 1),
        ("UNKNOWN_TYPE", 2),
        ("INVALID_FIELD", 3),
        ("TOO_LARGE", 4),
        ("CREDIT_EXCEEDED", 5),
        ("VERSION_MISMATCH", 6),
        ("HELLO_REQUIRED", 7),
        ("INCOMPATIBLE_MODEL", 8),
        ("CHECKSUM_MISMATCH", 9),
        ("UNEXPECTED", 10),
        ("SHUTTING_DOWN", 11),
        ("INTERNAL", 12),
    ]
    assert [(t.name, t.value) for t in MsgType][:10] == [
        ("HELLO", 1),
        ("WELCOME", 2),
        ("TRAJECTORY_BATCH", 3),
        ("ACK", 4),
        ("WEIGHTS_ANNOUNCE", 5),
        ("WEIGHTS_CHUNK", 6),
        ("WEIGHTS_APPLIED", 7),
        ("HEARTBEAT", 8),
        ("ERROR", 9),
        ("BYE", 10),
    ]


# -- hostile input never raises anything but ProtocolError -----------------------------------------
VALID = [on_wire(codec.encode(m)) for m in SAMPLES.values()]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(VALID) - 1), data=st.data())
def test_mutated_messages_fail_only_with_protocol_errors(which: int, data: st.DataObject) -> None:
    frames = list(VALID[which])
    i = data.draw(st.integers(1, len(frames) - 1), label="frame")
    f = bytearray(frames[i])
    for _ in range(data.draw(st.integers(1, 4))):
        if f and data.draw(st.booleans()):
            f[data.draw(st.integers(0, len(f) - 1))] = data.draw(st.integers(0, 255))
        else:
            del f[data.draw(st.integers(0, len(f))) :]
    frames[i] = bytes(f)
    try:
        codec.decode(frames, CodecLimits(vocab_size=1000))
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode)


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.binary(max_size=40), max_size=8), t=st.sampled_from([*range(14), 200]))
def test_random_frames_fail_only_with_protocol_errors(frames: list[bytes], t: int) -> None:
    try:
        codec.decode([bytes((t,)), *frames])
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode)


@settings(max_examples=200, deadline=None)
@given(
    value=st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=5)
        | st.binary(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=10,
    ),
    t=st.sampled_from(list(MsgType)),
    key=st.sampled_from(
        [
            "seq",
            "meta",
            "columns",
            "parts",
            "peer_id",
            "limits",
            "tensors",
            "protocol_version",
            "model",
            "code",
        ]
    ),
)
def test_any_msgpack_value_in_any_field_fails_cleanly(value: object, t: MsgType, key: str) -> None:
    frames = on_wire(codec.encode(SAMPLES[t]))
    h = header(frames)
    h[key] = value
    try:
        codec.decode(with_header(frames, h))
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode)


def test_bool_mask_column_is_accepted() -> None:
    t = make_traj("a")
    frames = batch(t)
    h = header(frames)
    h["columns"][2] = ["response_mask", "bool"]
    back = codec.decode(with_header(frames, h)).trajectories[0]
    assert back.response_mask.dtype == np.bool_ and np.array_equal(
        back.response_mask, t.response_mask.astype(bool)
    )


VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    value=VALUES,
    where=st.sampled_from(["meta", "meta_item", "column", "column_dtype"]),
    name=st.sampled_from(
        [name for name, *_ in COLUMNS]
        + ["trajectory_id", "reward", "termination", "reward_extras", "timings", "prompt_len"]
    ),
)
def test_any_value_inside_a_batch_header_fails_cleanly(
    value: object, where: str, name: str
) -> None:
    frames = batch()
    h = header(frames)
    col = next((i for i, (c, *_r) in enumerate(COLUMNS) if c == name), 0)
    if where == "meta":
        h["meta"][name] = value
    elif where == "meta_item":
        h["meta"].setdefault(name, [None, None])[0] = value
    elif where == "column":
        h["columns"][col] = value
    else:
        h["columns"][col][1] = value
    try:
        codec.decode(with_header(frames, h), CodecLimits(vocab_size=1000))
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode)
