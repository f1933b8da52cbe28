"""Invalid input gets a typed ERROR and the session carries on; an ERROR is never answered with an
ERROR; how each ERROR code acts on the sender; BYE from either side."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_testkit import (
    Net,
    connected,
    header,
    make_traj,
    on_wire,
    sample_messages,
    with_header,
)

from protocol import codec
from protocol.errors import ErrorCode
from protocol.events import BatchAcked, BatchRejected, PeerClosed, PeerError, ProtocolViolation
from protocol.messages import Error, MsgType, TrajectoryBatch
from protocol.sender import SenderState

SAMPLES = sample_messages()
GARBAGE = {
    "unknown type": [b"\x63", msgpack.packb({})],
    "bad msgpack": [bytes((MsgType.HEARTBEAT,)), b"\xc1"],
    "ext type": [bytes((MsgType.HEARTBEAT,)), msgpack.packb({"time": msgpack.ExtType(1, b"")})],
    "not a map": [bytes((MsgType.HEARTBEAT,)), msgpack.packb([1.0])],
    "one frame": [bytes((MsgType.HEARTBEAT,))],
    "long type frame": [b"\x08\x08", msgpack.packb({"time": 1.0})],
}


def _bad_batch(seq: int) -> list[bytes]:
    frames = on_wire(codec.encode(TrajectoryBatch(seq, [make_traj("bad")])))
    h = header(frames)
    h["meta"]["reward"] = ["NaN?"]
    return with_header(frames, h)


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_learner_answers_garbage_and_keeps_the_session(kind: str) -> None:
    net = connected()
    lp, now = net.learner, net.clock.now
    (ev,) = lp.receive(b"r0", GARBAGE[kind], now)
    assert isinstance(ev, ProtocolViolation) and ev.peer_id == "rollout-0"
    ((ident, frames),) = lp.data_to_send(now)
    err = codec.decode(frames)
    assert (
        ident == b"r0"
        and err.code in (ErrorCode.MALFORMED, ErrorCode.UNKNOWN_TYPE)
        and not err.fatal
    )
    assert lp.ready_peers() == ["rollout-0"]
    net.conns[b"r0"].submit([make_traj("good")])
    net.pump()
    assert net.delivered_ids() == ["good"]


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_sender_answers_garbage_and_keeps_the_session(kind: str) -> None:
    net = connected()
    conn, now = net.conns[b"r0"], net.clock.now
    (ev,) = conn.receive(GARBAGE[kind], now)
    assert isinstance(ev, ProtocolViolation) and ev.peer_id == "learner"
    (frames,) = conn.data_to_send(now)
    assert codec.decode(frames).code in (ErrorCode.MALFORMED, ErrorCode.UNKNOWN_TYPE)
    assert conn.state is SenderState.READY


def test_invalid_batch_is_rejected_and_dropped_the_session_goes_on() -> None:
    net = connected()
    conn = net.conns[b"r0"]
    seq = conn.allocate_seq()
    conn.enqueue(seq, _bad_batch(seq))
    conn.submit([make_traj("good")])
    net.pump()
    (err,) = net.errors_sent("down")
    assert (err.code, err.field, err.ref_type, err.ref_seq) == (
        ErrorCode.INVALID_FIELD,
        "trajectories[0].reward",
        MsgType.TRAJECTORY_BATCH,
        1,
    )
    (rej,) = net.events(b"r0", BatchRejected)
    assert rej.seq == 1 and rej.error == err
    assert net.delivered_ids() == ["good"] and conn.pending == 0  # refused for good: not kept
    assert conn.state is SenderState.READY
    conn.start(net.clock.now)
    net.pump()
    # never resent
    assert [header(r.frames)["seq"] for r in net.sent("up", MsgType.TRAJECTORY_BATCH)] == [1, 2]


@pytest.mark.parametrize(
    "t",
    [
        MsgType.WELCOME,
        MsgType.ACK,
        MsgType.WEIGHTS_ANNOUNCE,
        MsgType.WEIGHTS_CHUNK,
        MsgType.VALIDATE_REQUEST,
    ],
)
def test_learner_refuses_messages_meant_for_rollout_servers(t: MsgType) -> None:
    net = connected()
    (ev,) = net.learner.receive(b"r0", on_wire(codec.encode(SAMPLES[t])), net.clock.now)
    assert ev.error.code is ErrorCode.UNEXPECTED and net.learner.ready_peers() == ["rollout-0"]


@pytest.mark.parametrize(
    "t", [MsgType.HELLO, MsgType.TRAJECTORY_BATCH, MsgType.WEIGHTS_APPLIED, MsgType.VALIDATE_RESULT]
)
def test_sender_refuses_messages_meant_for_the_learner(t: MsgType) -> None:
    conn = connected().conns[b"r0"]
    (ev,) = conn.receive(on_wire(codec.encode(SAMPLES[t])), 0.0)
    assert ev.error.code is ErrorCode.UNEXPECTED and conn.state is SenderState.READY
    (frames,) = conn.data_to_send(0.0)
    assert codec.decode(frames).code == ErrorCode.UNEXPECTED


# -- never answer an ERROR with an ERROR -------------------------------------------------------------
def _broken_errors() -> list[list[bytes]]:
    ok = on_wire(codec.encode(Error(3, "x")))
    h = header(ok)
    return [
        [ok[0], b"\xc1"],
        with_header(ok, [1]),
        with_header(ok, {**h, "code": "three"}),
        with_header(ok, {k: v for k, v in h.items() if k != "message"}),
        [*ok, b"payload"],
    ]


@pytest.mark.parametrize("i", range(5))
def test_undecodable_error_is_not_answered(i: int) -> None:
    net = connected()
    frames = _broken_errors()[i]
    assert [type(e) for e in net.learner.receive(b"r0", frames, 0.0)] == [ProtocolViolation]
    assert net.learner.data_to_send(net.clock.now) == []
    conn = net.conns[b"r0"]
    assert [type(e) for e in conn.receive(frames, 0.0)] == [ProtocolViolation]
    assert conn.data_to_send(net.clock.now) == []


def test_valid_error_is_reported_not_answered() -> None:
    net = connected()
    frames = on_wire(codec.encode(Error(10, "what?", ref_type=int(MsgType.HEARTBEAT))))
    assert net.learner.receive(b"r0", frames, net.clock.now) == [
        PeerError("rollout-0", codec.decode(frames))
    ]
    assert net.learner.data_to_send(net.clock.now) == []
    conn = net.conns[b"r0"]
    assert conn.receive(frames, net.clock.now) == [PeerError("learner", codec.decode(frames))]
    assert conn.data_to_send(net.clock.now) == [] and conn.state is SenderState.READY


def test_no_error_storm_when_every_header_is_corrupted() -> None:
    """Both directions mangle every header: each side answers what it cannot decode, but ERRORs
    that cannot be decoded are not answered, so the exchange dies out."""
    net = connected()

    def mangle(direction: str, ident: bytes, frames: list) -> list:
        return [frames[0], frames[1][:-1] + b"\xc1", *frames[2:]]

    net.mutate = mangle
    net.conns[b"r0"].submit([make_traj("a")])
    net.run_for(3.0)  # heartbeats both ways, all mangled; Net.pump raises on a storm
    up, down = net.sent("up", MsgType.ERROR), net.sent("down", MsgType.ERROR)
    assert len(up) <= len(
        [r for r in net.wire if r.direction == "down" and r.type is not MsgType.ERROR]
    )
    assert len(down) <= len(
        [r for r in net.wire if r.direction == "up" and r.type is not MsgType.ERROR]
    )
    assert net.conns[b"r0"].state is SenderState.READY


@settings(max_examples=150, deadline=None)
@given(
    frames=st.lists(st.binary(max_size=30), min_size=0, max_size=4),
    t=st.sampled_from([*list(MsgType), 0, 77]),
    known=st.booleans(),
)
def test_learner_never_raises_and_answers_at_most_once(
    frames: list[bytes], t: int, known: bool
) -> None:
    net = connected()
    ident = b"r0" if known else b"stranger"
    net.learner.receive(ident, [bytes((t,)), *frames], net.clock.now)
    out = [f for i, f in net.learner.data_to_send(net.clock.now) if i == ident]
    assert len(out) <= 1
    assert all(codec.peek_type(f) is MsgType.ERROR for f in out)
    if t == MsgType.ERROR and known and frames:  # single-frame ERROR: see test_regressions
        assert out == []


@settings(max_examples=150, deadline=None)
@given(
    frames=st.lists(st.binary(max_size=30), min_size=0, max_size=4),
    t=st.sampled_from([*list(MsgType), 0, 77]),
)
def test_sender_never_raises_and_answers_at_most_once(frames: list[bytes], t: int) -> None:
    conn = connected().conns[b"r0"]
    conn.receive([bytes((t,)), *frames], 0.0)
    out = conn.data_to_send(0.0)
    assert len(out) <= 1
    if t == MsgType.ERROR and frames:  # single-frame ERROR: see test_regressions
        assert out == []


# -- what each ERROR code does to the sender --------------------------------------------------------
def _sender_with_batch_in_flight() -> tuple[Net, int]:
    net = connected()
    net.drop = lambda d, i, f: d == "down"  # no ACK
    seq = net.conns[b"r0"].submit([make_traj("a")])
    net.pump()
    net.drop = None
    return net, seq


@pytest.mark.parametrize(
    "code", [ErrorCode.CREDIT_EXCEEDED, ErrorCode.SHUTTING_DOWN, ErrorCode.INTERNAL]
)
def test_retryable_error_keeps_the_batch(code: ErrorCode) -> None:
    net, seq = _sender_with_batch_in_flight()
    conn = net.conns[b"r0"]
    events = conn.receive(
        on_wire(codec.encode(Error(int(code), "later", ref_type=3, ref_seq=seq))), 0.0
    )
    assert [type(e) for e in events] == [PeerError]
    assert conn.pending == 1 and conn._queue[0][0] == seq and conn.state is SenderState.READY


@pytest.mark.parametrize(
    "code", [ErrorCode.INVALID_FIELD, ErrorCode.TOO_LARGE, ErrorCode.MALFORMED]
)
def test_permanent_error_drops_the_batch(code: ErrorCode) -> None:
    net, seq = _sender_with_batch_in_flight()
    conn = net.conns[b"r0"]
    events = conn.receive(
        on_wire(codec.encode(Error(int(code), "no", ref_type=3, ref_seq=seq))), 0.0
    )
    assert [type(e) for e in events] == [PeerError, BatchRejected] and conn.pending == 0


def test_fatal_error_fails_the_connection() -> None:
    conn = connected().conns[b"r0"]
    err = Error(int(ErrorCode.INCOMPATIBLE_MODEL), "no", fatal=True)
    conn.receive(on_wire(codec.encode(err)), 0.0)
    assert conn.state is SenderState.FAILED and conn.fatal_error == err
    assert conn.data_to_send(0.0) == []  # no batches, no heartbeats once failed


def test_unknown_error_code_is_only_reported() -> None:
    net, seq = _sender_with_batch_in_flight()
    conn = net.conns[b"r0"]
    events = conn.receive(
        on_wire(codec.encode(Error(4242, "from the future", ref_type=3, ref_seq=seq))), 0.0
    )
    assert [type(e) for e in events] == [PeerError, BatchRejected]
    events = conn.receive(on_wire(codec.encode(Error(4243, "from the future"))), 0.0)
    assert [type(e) for e in events] == [PeerError] and conn.state is SenderState.READY


def test_stale_ack_outside_a_session_is_ignored() -> None:
    net, _seq = _sender_with_batch_in_flight()
    conn = net.conns[b"r0"]
    conn.start(net.clock.now)  # new session; the batch is requeued
    ack = on_wire(codec.encode(codec.decode(on_wire(codec.encode(SAMPLES[MsgType.ACK])))))
    assert conn.receive(ack, 0.0) == [] and conn.credits == 0 and conn.pending == 1


# -- BYE ----------------------------------------------------------------------------------------------
def test_sender_bye() -> None:
    net = connected(capacity=4, max_credits=2)
    conn = net.conns[b"r0"]
    conn.close("shutting down")
    assert conn.state is SenderState.CLOSED
    net.pump()
    assert net.sent("up", MsgType.BYE)[0].decoded().reason == "shutting down"
    assert net.learner_events_of(PeerClosed) == [PeerClosed("rollout-0", "shutting down")]
    assert net.learner.peers == {} and net.learner.free_room == 4
    assert not net.sent("up", MsgType.HEARTBEAT)
    with pytest.raises(RuntimeError):
        conn.start(net.clock.now)


def test_learner_bye() -> None:
    """A learner BYE (e.g. before a restart) sends rollout servers back to IDLE to reconnect."""
    net = connected(n=2)
    net.learner.close("maintenance")
    net.pump()
    for ident, conn in net.conns.items():
        assert conn.state is SenderState.IDLE
        assert net.events(ident, PeerClosed) == [PeerClosed("learner", "maintenance")]


def test_close_before_handshake_sends_nothing() -> None:
    from protocol_testkit import rollout

    conn = rollout()
    conn.close()
    assert conn.state is SenderState.CLOSED and conn.data_to_send(0.0) == []


def test_acked_batches_reported_once() -> None:
    net = connected()
    conn = net.conns[b"r0"]
    conn.submit([make_traj("a")])
    conn.submit([make_traj("b")])
    net.pump()
    assert [e for e in net.sender_events[b"r0"] if isinstance(e, BatchAcked)] == [
        BatchAcked([1], []),
        BatchAcked([2], []),
    ]
