"""The typed fast path of a 1.5 batch header (``protocol.typed_header``) against the generic path.

The fast path may only accept what the generic path accepts, must hand back the same batch, and
must leave every refusal to the generic path (so the error, its field and the batch it names read
as before). Each test decodes the same frames both ways and compares the outcomes.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_testkit import header, make_traj, on_wire, with_header

from protocol import codec, typed_header
from protocol.errors import ErrorCode, ProtocolError
from protocol.limits import CodecLimits
from protocol.messages import TrajectoryBatch
from protocol.trajectory import COLUMNS, HEADER_FIELDS, NUMBERS

LIMITS = CodecLimits(vocab_size=1000)


def batch(seq: int = 7) -> list[bytes]:
    ts = [
        make_traj("a", prompt_len=3, response_len=4, seed=1),
        make_traj(
            "b",
            prompt_len=2,
            response_len=5,
            seed=2,
            termination="length",
            actions={"tool_calls": 2},
            reward_extras={"acc": 1, "ok": True, "note": "x", "f": 0.5},
            timings={"gen": 1, "tool": 0.25},
        ),
    ]
    return on_wire(codec.encode(TrajectoryBatch(seq, ts), number_frames=True))


def outcome(frames: list[bytes], *, fast: bool) -> tuple[Any, ...]:
    """What ``codec.decode`` makes of ``frames``, with the typed path on or off: the error's
    code, text, field and reference, or the batch (``repr`` tells 1 from 1.0 from True)."""
    with pytest.MonkeyPatch.context() as mp:
        if not fast:
            mp.setattr(typed_header, "decode", lambda data, columns: None)
        try:
            msg = codec.decode(frames, LIMITS)
        except ProtocolError as e:
            return ("error", e.code, e.message, e.field, e.ref_type, e.ref_seq)
    assert isinstance(msg, TrajectoryBatch)
    b = msg.trajectories
    cols = {k: (v.dtype.str, v.tobytes()) for k, v in b.columns.items()}  # type: ignore[attr-defined]
    return ("ok", msg.seq, repr(b.meta), cols)  # type: ignore[attr-defined]


def same_both_ways(frames: list[bytes]) -> tuple[Any, ...]:
    fast, generic = outcome(frames, fast=True), outcome(frames, fast=False)
    assert fast == generic
    return fast


def test_a_valid_batch_takes_the_typed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    frames = batch()
    expected = outcome(frames, fast=False)

    def no_generic(buf: Any) -> Any:
        raise AssertionError("the generic header decoder ran")

    monkeypatch.setattr(codec, "_unpack", no_generic)
    assert outcome(frames, fast=True) == expected
    assert expected[0] == "ok" and "'tool_calls': 2" in expected[2]


def test_the_legacy_form_is_left_to_the_generic_path() -> None:
    frames = on_wire(codec.encode(TrajectoryBatch(3, [make_traj("a")])))
    assert typed_header.decode(frames[1], 2 + len(COLUMNS) + len(NUMBERS) - 2) is None
    assert same_both_ways(frames)[0] == "ok"


def _set(h: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``h`` with the value at a dotted path (list indices as numbers) set."""
    *parents, last = path.split(".")
    node: Any = h
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return h


TS = msgpack.Timestamp(1)
EXT = msgpack.ExtType(5, b"x")
NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("path", "value", "code"),
    [
        ("seq", 0, ErrorCode.INVALID_FIELD),
        ("seq", True, ErrorCode.INVALID_FIELD),
        ("seq", 1.0, ErrorCode.INVALID_FIELD),
        ("meta.trajectory_id", None, ErrorCode.INVALID_FIELD),
        ("meta.trajectory_id.1", b"b", ErrorCode.INVALID_FIELD),
        ("meta.trajectory_id.1", 5, ErrorCode.INVALID_FIELD),
        ("meta.group_uid", ["g"], ErrorCode.INVALID_FIELD),  # one value for two trajectories
        ("meta.source_server", None, None),  # nil: the default, both ways
        ("meta.termination.0", "exploded", ErrorCode.INVALID_FIELD),
        ("meta.termination.0", b"answered", ErrorCode.INVALID_FIELD),
        ("meta.reward_extras.1.acc", NAN, None),  # scalars may be NaN
        ("meta.reward_extras.1.acc", None, ErrorCode.INVALID_FIELD),
        ("meta.reward_extras.1.acc", TS, ErrorCode.MALFORMED),
        ("meta.reward_extras.1.acc", EXT, ErrorCode.MALFORMED),
        ("meta.timings.1.gen", NAN, ErrorCode.INVALID_FIELD),
        ("meta.timings.1.gen", -INF, ErrorCode.INVALID_FIELD),
        ("meta.timings.1.gen", True, ErrorCode.INVALID_FIELD),
        ("meta.timings.1.gen", "1", ErrorCode.INVALID_FIELD),
        ("meta.timings.1.gen", 2**64 - 1, None),  # an int stays an int
        ("meta.actions", [{}, {"tool_calls": -1}], ErrorCode.INVALID_FIELD),
        ("meta.actions", [{}, {"tool_calls": INF}], ErrorCode.INVALID_FIELD),
        ("meta.actions", [{}, {"tool_calls": 0.5}], None),
        ("meta.actions", [{}, {7: 1}], ErrorCode.MALFORMED),  # map keys must be strings
        ("meta.unknown", EXT, ErrorCode.MALFORMED),  # skipped unread by msgspec: must not pass
        ("meta.unknown", 1, None),  # ignored, as the generic path ignores it
        ("unknown", TS, ErrorCode.MALFORMED),
        ("unknown", "x", None),
        ("columns.0.1", "int16", ErrorCode.INVALID_FIELD),
        ("columns.1.1", "int64", ErrorCode.INVALID_FIELD),  # the frame no longer matches
        ("columns.5", ["reward", "float32"], ErrorCode.INVALID_FIELD),
        ("meta", [], ErrorCode.INVALID_FIELD),
    ],
)
def test_both_paths_agree_on(path: str, value: Any, code: ErrorCode | None) -> None:
    frames = batch()
    got = same_both_ways(with_header(frames, _set(header(frames), path, value)))
    assert got[0] == ("ok" if code is None else "error")
    if code is not None:
        assert got[1] == code
        named = path != "seq" and code != ErrorCode.MALFORMED  # an unreadable header names none
        assert got[5] == (7 if named else 0)


def test_duplicate_keys_keep_the_last_value_both_ways() -> None:
    frames = batch()
    packed = msgpack.packb(header(frames), use_bin_type=True)
    assert packed[0] == 0x83  # a fixmap of 3: seq, columns, meta
    # A fourth entry repeating "seq": the last one counts, as msgpack reads it.
    raw = bytes([0x84]) + packed[1:] + msgpack.packb("seq") + msgpack.packb(9)
    got = same_both_ways([frames[0], raw, *frames[2:]])
    assert got[:2] == ("ok", 9)
    raw = bytes([0x84]) + packed[1:] + msgpack.packb("seq") + msgpack.packb(-1)
    assert same_both_ways([frames[0], raw, *frames[2:]])[1] == ErrorCode.INVALID_FIELD


def test_invalid_utf8_anywhere_is_malformed_both_ways() -> None:
    frames = batch()
    h = header(frames)
    h["meta"]["zz"] = "\u00e9"
    raw = bytearray(msgpack.packb(h, use_bin_type=True))
    raw[raw.index("\u00e9".encode())] = 0xFF  # an unknown key's value, which msgspec would skip
    assert same_both_ways([frames[0], bytes(raw), *frames[2:]])[1] == ErrorCode.MALFORMED


def test_every_header_field_is_covered() -> None:
    # A header field of a rule the typed path does not know fails at import (``_ELEMENT``); this
    # pins the fields it was written for.
    assert [f.name for f in HEADER_FIELDS] == [
        "trajectory_id",
        "group_uid",
        "source_server",
        "data_source",
        "agent_type",
        "termination",
        "reward_extras",
        "timings",
        "actions",
    ]


VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=4)
    | st.binary(max_size=3)
    | st.sampled_from(["answered", "length", "a", "gsm8k", TS, EXT]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
PATHS = [
    "seq",
    "columns",
    "meta",
    "extra",
    *(f"meta.{f.name}" for f in HEADER_FIELDS),
    *(f"meta.{f.name}.1" for f in HEADER_FIELDS),
    "meta.reward_extras.1.acc",
    "meta.timings.1.gen",
    "meta.actions.1.tool_calls",
    "columns.3",
    "columns.7.1",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), value=VALUES)
def test_any_value_anywhere_decodes_the_same_both_ways(path: str, value: Any) -> None:
    frames = batch()
    same_both_ways(with_header(frames, _set(header(frames), path, value)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_header_bytes_decode_the_same_both_ways(data: st.DataObject) -> None:
    frames = batch()
    raw = bytearray(frames[1])
    for _ in range(data.draw(st.integers(1, 3))):
        if data.draw(st.booleans()):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        else:
            i = data.draw(st.integers(0, len(raw)))
            raw[i:i] = bytes(data.draw(st.binary(min_size=1, max_size=3)))
    same_both_ways([frames[0], bytes(raw), *frames[2:]])
