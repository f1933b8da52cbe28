"""Handshake, protocol versions (major must match, minors interoperate) and model identity."""

from __future__ import annotations

import pytest
from protocol_testkit import (
    MODEL,
    TOKENIZER,
    Net,
    header,
    learner,
    make_traj,
    on_wire,
    rollout,
    sample_messages,
    with_header,
)

from protocol import codec
from protocol.errors import ErrorCode
from protocol.events import Connected, PeerError, PeerJoined, ProtocolViolation
from protocol.messages import Hello, Identity, Limits, MsgType, Welcome
from protocol.sender import SenderState
from protocol.version import PROTOCOL_VERSION, ProtocolVersion


def test_handshake() -> None:
    net = Net(
        learner(
            capacity=10, max_credits_per_peer=4, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0
        )
    )
    conn = net.add(b"r0", rollout("rollout-0", "epoch-1"))
    assert conn.state is SenderState.HELLO_SENT
    net.pump()
    assert conn.state is SenderState.READY
    hello = net.sent("up", MsgType.HELLO)[0].decoded()
    assert (hello.protocol_version, hello.peer_id, hello.role, hello.epoch) == (
        list(PROTOCOL_VERSION),
        "rollout-0",
        "rollout-server",
        "epoch-1",
    )
    assert (hello.model, hello.tokenizer) == (MODEL, TOKENIZER)
    (welcome,) = [r.decoded() for r in net.sent("down", MsgType.WELCOME)]
    assert (welcome.credits, welcome.next_seq, welcome.policy_version) == (4, 1, 0)
    assert welcome.session_id == net.learner.session_id and welcome.protocol_version == list(
        PROTOCOL_VERSION
    )
    # the sender adopts the learner's heartbeat settings
    assert (conn.heartbeat_interval_s, conn.heartbeat_timeout_s) == (0.5, 3.0)
    assert conn.credits == 4 and net.learner.free_room == 6
    assert [type(e) for e in net.sender_events[b"r0"]] == [Connected]
    (joined,) = net.learner_events
    assert isinstance(joined, PeerJoined) and joined.peer_id == "rollout-0"
    assert net.learner.ready_peers() == ["rollout-0"]


def test_welcome_credits_limited_by_capacity() -> None:
    net = Net(learner(capacity=3, max_credits_per_peer=2))
    for i in range(3):
        net.add(f"r{i}".encode(), rollout(f"rollout-{i}"))
    net.pump()
    assert [c.credits for c in net.conns.values()] == [2, 1, 0]
    assert net.learner.free_room == 0


def test_welcome_advertises_limits() -> None:
    limits = codec.CodecLimits(
        max_message_bytes=1 << 20, max_trajectories_per_batch=8, max_tokens_per_trajectory=99
    )
    net = Net(learner(limits=limits))
    net.add(b"r0", rollout())
    net.pump()
    w = net.sent("down", MsgType.WELCOME)[0].decoded()
    assert (
        w.limits.max_message_bytes,
        w.limits.max_trajectories_per_batch,
        w.limits.max_tokens_per_trajectory,
    ) == (1 << 20, 8, 99)


@pytest.mark.parametrize(
    "t", [MsgType.TRAJECTORY_BATCH, MsgType.HEARTBEAT, MsgType.WEIGHTS_APPLIED, MsgType.BYE]
)
def test_message_before_hello_is_hello_required(t: MsgType) -> None:
    lp = learner()
    events = lp.receive(b"x", on_wire(codec.encode(sample_messages()[t])), 0.0)
    assert (
        isinstance(events[0], ProtocolViolation)
        and events[0].error.code is ErrorCode.HELLO_REQUIRED
    )
    ((ident, frames),) = lp.data_to_send(0.0)
    err = codec.decode(frames)
    assert ident == b"x" and err.code == ErrorCode.HELLO_REQUIRED and not err.fatal
    if t is MsgType.TRAJECTORY_BATCH:
        assert err.ref_seq == 5  # the sender can tell which batch to keep


# -- versions ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sender_v", "learner_v"), [((2, 0), (1, 0)), ((1, 3), (2, 1)), ((0, 9), (1, 0))]
)
def test_major_version_mismatch_refused_by_learner(sender_v: tuple, learner_v: tuple) -> None:
    net = Net(learner(version=ProtocolVersion(*learner_v)))
    conn = net.add(b"r0", rollout(version=ProtocolVersion(*sender_v)))
    net.pump()
    (err,) = net.errors_sent("down")
    assert err.code == ErrorCode.VERSION_MISMATCH and err.fatal
    assert (
        str(ProtocolVersion(*sender_v)) in err.message
        and str(ProtocolVersion(*learner_v)) in err.message
    )
    assert conn.state is SenderState.FAILED and conn.fatal_error == err
    assert net.learner.ready_peers() == [] and net.learner.peers == {}
    assert not net.errors_sent("up")  # the sender does not answer the ERROR
    with pytest.raises(RuntimeError):
        conn.start(net.clock.now)


def test_major_version_mismatch_detected_by_sender() -> None:
    """A learner that wrongly accepts a foreign major: the sender checks WELCOME itself."""
    conn = rollout()
    conn.start(0.0)
    conn.data_to_send(0.0)
    bad = Welcome([2, 0], "learner", "s", 4, 0, 1, 1.0, 10.0, Limits(1 << 20, 16, 4096))
    events = conn.receive(on_wire(codec.encode(bad)), 0.0)
    assert conn.state is SenderState.FAILED and conn.credits == 0
    (v,) = events
    assert isinstance(v, ProtocolViolation) and v.error.code is ErrorCode.VERSION_MISMATCH
    assert "2.0" in v.error.message and str(PROTOCOL_VERSION) in v.error.message
    (frames,) = conn.data_to_send(0.0)
    err = codec.decode(frames)
    assert err.code == ErrorCode.VERSION_MISMATCH and err.fatal
    assert "2.0" in err.message and str(PROTOCOL_VERSION) in err.message


@pytest.mark.parametrize(("sender_v", "learner_v"), [((1, 7), (1, 0)), ((1, 0), (1, 7))])
def test_minor_versions_interoperate(sender_v: tuple, learner_v: tuple) -> None:
    net = Net(learner(version=ProtocolVersion(*learner_v)))
    conn = net.add(b"r0", rollout(version=ProtocolVersion(*sender_v)))
    net.pump()
    assert conn.state is SenderState.READY
    conn.submit([make_traj("a")])
    net.pump()
    assert net.delivered_ids() == ["a"] and conn.pending == 0
    assert net.sent("down", MsgType.WELCOME)[0].decoded().protocol_version == list(learner_v)


def test_newer_minor_hello_and_welcome_with_extra_fields() -> None:
    """A 1.9 peer appends fields to HELLO and WELCOME and columns to batches: a 1.0 peer ignores them."""

    def newer(direction: str, ident: bytes, frames: list) -> list:
        h = header(frames)
        t = codec.peek_type(frames)
        if t in (MsgType.HELLO, MsgType.WELCOME):
            h["protocol_version"] = [1, 9]
            h["zz_new_field"] = {"anything": [1, 2]}
        elif t is MsgType.TRAJECTORY_BATCH:
            h["meta"]["zz_new_column"] = [0.5] * len(h["meta"]["trajectory_id"])
        return with_header(frames, h)

    net = Net(learner(), mutate=newer)
    conn = net.add(b"r0", rollout())
    net.pump()
    assert conn.state is SenderState.READY and conn.welcome.protocol_version == [1, 9]
    assert net.learner_events[0].hello.protocol_version == [1, 9]
    conn.submit([make_traj("a"), make_traj("b")])
    net.pump()
    assert (
        net.delivered_ids() == ["a", "b"]
        and not net.errors_sent("up")
        and not net.errors_sent("down")
    )


# -- model identity ----------------------------------------------------------------------------------
def test_incompatible_tokenizer_is_fatal() -> None:
    net = Net(learner())
    other = Identity("other-tokenizer", "ef" * 32, 1000)
    conn = net.add(b"r0", rollout(tokenizer=other))
    net.pump()
    (err,) = net.errors_sent("down")
    assert (err.code, err.fatal, err.field) == (
        ErrorCode.INCOMPATIBLE_MODEL,
        True,
        "HELLO.tokenizer",
    )
    assert "other-tokenizer" in err.message and TOKENIZER.name in err.message
    assert conn.state is SenderState.FAILED
    assert isinstance(net.sender_events[b"r0"][0], PeerError)
    assert net.learner.peers == {}


def test_learner_without_tokenizer_hash_accepts_any() -> None:
    net = Net(learner(tokenizer=Identity("any", "")))
    conn = net.add(b"r0", rollout(tokenizer=Identity("other", "ef" * 32)))
    net.pump()
    assert conn.state is SenderState.READY


def test_hello_with_learner_role_is_refused() -> None:
    lp = learner()
    hello = Hello([1, 0], "x", "learner", "e", MODEL, TOKENIZER)
    (ev,) = lp.receive(b"x", on_wire(codec.encode(hello)), 0.0)
    assert ev.error.code is ErrorCode.INVALID_FIELD and ev.error.field == "HELLO.role"
    assert lp.peers == {}


def test_request_weights_sends_policy_version_minus_one() -> None:
    conn = rollout()
    conn.policy_version = 5
    conn.start(0.0, request_weights=True)
    hello = codec.decode(conn.data_to_send(0.0)[0])
    assert hello.policy_version == -1
    conn.start(0.0)
    assert codec.decode(conn.data_to_send(0.0)[0]).policy_version == 5


def test_second_welcome_is_unexpected() -> None:
    net = Net(learner())
    conn = net.add(b"r0", rollout())
    net.pump()
    welcome = net.sent("down", MsgType.WELCOME)[0].frames
    (ev,) = conn.receive(welcome, net.clock.now)
    assert ev.error.code is ErrorCode.UNEXPECTED and conn.state is SenderState.READY
