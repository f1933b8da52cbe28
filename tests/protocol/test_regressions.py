"""Regression tests for bugs found in protocol/; those still open are marked xfail(strict=True).

When a bug is fixed its test starts passing, strict xfail turns that into a failure, and the marker
must be removed: the test then guards the fix. Each docstring names the proposed fix.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from protocol_testkit import connected, header, make_traj, on_wire, rollout, tensors, with_header

from protocol import codec
from protocol.errors import ErrorCode, ProtocolError
from protocol.events import BatchRejected, WeightsFailed, WeightsReceived
from protocol.limits import CodecLimits
from protocol.messages import Error, Limits, MsgType, TrajectoryBatch, Welcome
from protocol.schema import to_wire
from protocol.weights import plan_transfer

bug = pytest.mark.xfail(strict=True, raises=(AssertionError, ProtocolError, TypeError))


def test_decode_accepts_the_encoders_own_frames() -> None:
    """codec.decode(codec.encode(batch)) fails when the frames are the numpy arrays encode returns:
    decode_columns compares ``len(frame)`` (elements of an int32 memoryview) with a byte count.
    Fix: ``payload = [memoryview(f).cast("B") for f in frames[2:]]`` in codec.decode (or
    ``frame.nbytes`` in trajectory.decode_columns)."""
    batch = TrajectoryBatch(1, [make_traj("a")])
    back = codec.decode(codec.encode(batch))
    assert back.trajectories[0].trajectory_id == "a"


def test_rejected_batch_does_not_leak_a_credit() -> None:
    """A batch refused with an ERROR (INVALID_FIELD, TOO_LARGE, ...) spent a sender credit, but the
    learner never counted it (decode failed before ``_on_batch``): the sender ends up with one credit
    fewer than the learner thinks it has, for the rest of the session. With max_credits_per_peer=1 the
    sender stalls for good. Fix (sender): in ``_on_error`` give the credit back when a batch in flight
    is refused with any code but CREDIT_EXCEEDED (``self.credits += 1``, for the requeue branch too)."""
    net = connected(capacity=4, max_credits=1)
    conn = net.conns[b"r0"]
    frames = on_wire(codec.encode(TrajectoryBatch(1, [make_traj("bad")])))
    h = header(frames)
    h["meta"]["reward"] = ["x"]
    conn.enqueue(conn.allocate_seq(), with_header(frames, h))
    conn.submit([make_traj("good")])
    net.pump()
    assert net.events(b"r0", BatchRejected)
    assert conn.credits == net.learner.peers[b"r0"].credits
    assert net.delivered_ids() == ["good"]


def test_oversized_batch_is_matched_to_its_seq() -> None:
    """A batch over max_message_bytes is refused before its header is read, so ERROR.ref_seq is 0:
    the sender cannot match the rejection, keeps the batch in flight and resends it after every
    reconnect, forever. Fix: in codec.decode, unpack the header before the size check (or read just
    ``seq``), so ``ref_seq`` is filled in for TOO_LARGE too."""
    net = connected(capacity=4, max_credits=2, limits=CodecLimits(max_message_bytes=600))
    conn = net.conns[b"r0"]
    conn.submit([make_traj("big", prompt_len=200)])
    net.pump()
    (err,) = net.errors_sent("down")
    assert err.code == ErrorCode.TOO_LARGE
    assert err.ref_seq == 1 and net.events(b"r0", BatchRejected) and conn.pending == 0


def test_msgpack_timestamp_extension_is_refused() -> None:
    """msgpack's built-in Timestamp extension (type -1) never reaches ``ext_hook``: it decodes to a
    ``msgpack.Timestamp`` object, so "no extension types" does not hold for it. Harmless today (the
    schema rejects it where it checks, unknown keys are dropped) but it breaks the stated rule. Fix:
    an ``object_hook``/``list_hook`` in ``_unpack`` that refuses ``msgpack.Timestamp`` values."""
    frames = on_wire(codec.encode(Error(3, "x")))
    try:
        codec.decode(with_header(frames, {**header(frames), "zz": msgpack.Timestamp(1, 0)}))
    except ProtocolError as e:
        assert e.code is ErrorCode.MALFORMED
    else:
        raise AssertionError("Timestamp extension accepted")


def test_nested_msgpack_timestamp_is_refused_and_lookalike_bytes_are_not() -> None:
    """The timestamp scan is a byte search: a nested timestamp is still found, and the same bytes
    inside a bin value (a false match) only take the slow path, not a refusal."""
    frames = on_wire(codec.encode(Error(3, "x")))
    nested = with_header(frames, {**header(frames), "zz": [{"a": [msgpack.Timestamp(5, 0)]}]})
    with pytest.raises(ProtocolError) as e:
        codec.decode(nested)
    assert e.value.code is ErrorCode.MALFORMED and "timestamp" in e.value.message
    lookalike = with_header(frames, {**header(frames), "zz": b"\xd6\xff\xd7\xff\xc7\x0c\xff"})
    assert codec.decode(lookalike) == Error(3, "x")


def test_bool_mask_with_non_canonical_byte_is_refused() -> None:
    """(Minor.) A ``bool`` response_mask column skips the 0/1 check, and the decoded view keeps the
    raw byte: numpy's own reductions treat 2 as True, but anything reinterpreting the buffer
    (``.view(np.uint8)``, a zero-copy hand-over to torch) sees 2. Fix: check
    ``mask.view(np.uint8).max() > 1`` for both dtypes."""
    t = make_traj("a")
    frames = on_wire(codec.encode(TrajectoryBatch(1, [t])))
    h = header(frames)
    h["columns"][2] = ["response_mask", "bool"]
    mask = bytearray(frames[4])
    mask[0] = 2
    bad = with_header([*frames[:4], bytes(mask), *frames[5:]], h)
    try:
        got = codec.decode(bad).trajectories[0].response_mask
    except ProtocolError as e:
        assert e.field == "trajectories[0].response_mask[0]"
    else:
        assert int(got.view(np.uint8).max()) <= 1, "mask byte 2 accepted"


def test_error_from_unknown_peer_is_not_answered() -> None:
    """An ERROR from an identity with no session gets a HELLO_REQUIRED ERROR back: the learner builds
    that ProtocolError itself, with ref_type 0, so ``should_answer`` lets it through. Fix: in
    LearnerProtocol.receive set ``e.ref_type = int(TYPE_OF[type(msg)])`` on the HELLO_REQUIRED error
    (or on every error raised after decoding, in both receive methods)."""
    lp = connected().learner
    lp.receive(b"stranger", on_wire(codec.encode(Error(1, "x"))), 0.0)
    assert lp.data_to_send(0.0) == []


def test_single_frame_error_is_not_answered() -> None:
    """``[b"\\x09"]`` (an ERROR type byte and no header) is refused by the frame-count check before
    the type is read, so ref_type is 0 and it is answered. Fix: in codec.peek_type read the type
    byte first and attach it (``ref_type``) to the frame-count error."""
    conn = connected().conns[b"r0"]
    conn.receive([bytes((MsgType.ERROR,))], 0.0)
    assert conn.data_to_send(0.0) == []


@pytest.mark.parametrize("pv", [[1], [1, 0, 0], []])
def test_malformed_welcome_version_does_not_crash_the_sender(pv: list[int]) -> None:
    """WELCOME.protocol_version is not checked for length (HELLO's is, in ``__post_init__``), and
    ``ProtocolVersion(*pv)`` raises TypeError out of ``RolloutConnection.receive``. Fix: the same
    ``__post_init__`` check on Welcome."""
    conn = rollout()
    conn.start(0.0)
    conn.data_to_send(0.0)
    welcome = Welcome([1, 0], "learner", "s", 4, 0, 1, 1.0, 10.0, Limits(1 << 20, 16, 4096))
    # the constructor refuses it: forge the wire
    forged = to_wire(welcome) | {"protocol_version": pv}
    frames = [codec.encode(welcome)[0], msgpack.packb(forged)]
    events = conn.receive(on_wire(frames), 0.0)
    assert events and events[0].error.code is ErrorCode.INVALID_FIELD


def test_duplicate_chunk_after_completion_is_ignored() -> None:
    """Once a transfer completed, a repeated chunk of it is "a chunk of an unannounced transfer":
    the sender emits WeightsFailed and WEIGHTS_APPLIED(ok=False) for a version it has. Fix: remember
    finished transfer ids as well (e.g. add them to ``_abandoned`` in ``_finish_if_complete``)."""
    conn = connected().conns[b"r0"]
    announce, chunks = plan_transfer(1, tensors([8]), chunk_bytes=16)
    frames = [on_wire(codec.encode(m)) for m in (announce, *chunks)]
    events = [e for f in frames for e in conn.receive(f, 0.0)]
    assert any(isinstance(e, WeightsReceived) for e in events)
    conn.data_to_send(0.0)
    assert conn.receive(frames[-1], 0.0) == []
    assert not any(isinstance(e, WeightsFailed) for e in conn.receive(frames[-1], 0.0))


def test_sender_keeps_its_own_receive_limits() -> None:
    """The sender replaces its decode limits with the learner's WELCOME.limits (which say what the
    learner accepts, for splitting batches). A learner with max_message_bytes below its weight chunk
    size then has every WEIGHTS_CHUNK refused as TOO_LARGE by its rollout servers, and the transfer
    never completes. Fix: keep ``self.limits`` and store the learner's as ``self.peer_limits``."""
    net = connected(limits=CodecLimits(max_message_bytes=4096))
    net.learner.publish_weights(1, tensors([4096]), chunk_bytes=8192)  # 16 KiB in two chunks
    net.pump()
    assert net.events(b"r0", WeightsReceived)


def test_duplicate_trajectory_ids_within_one_batch() -> None:
    """The trajectory-id filter checks a batch against the window before adding the batch's own ids,
    so a batch carrying the same id twice delivers it twice. Fix: add ids to ``_seen`` as they are
    accepted (one loop instead of a comprehension then a loop)."""
    net = connected()
    net.conns[b"r0"].submit([make_traj("a"), make_traj("a")])
    net.pump()
    assert net.delivered_ids() == ["a"]
