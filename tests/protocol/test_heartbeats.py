"""Heartbeats at the interval the learner sets in WELCOME; silence for the timeout ends a session."""

from __future__ import annotations

import math

from protocol_testkit import Net, learner, make_traj, rollout

from protocol.errors import ErrorCode
from protocol.events import PeerError, PeerTimedOut
from protocol.messages import Heartbeat, MsgType
from protocol.sender import SenderState


def _net(**kw: float) -> Net:
    kw.setdefault("heartbeat_interval_s", 1.0)
    kw.setdefault("heartbeat_timeout_s", 5.0)
    net = Net(learner(**kw))
    # the sender's own settings are placeholders: WELCOME overrides them
    net.add(b"r0", rollout(heartbeat_interval_s=99.0, heartbeat_timeout_s=999.0))
    net.pump()
    return net


def test_heartbeats_at_the_interval_both_ways() -> None:
    net = _net()
    t0 = net.clock.now
    net.run_for(0.75)
    assert not net.sent("up", MsgType.HEARTBEAT) and not net.sent("down", MsgType.HEARTBEAT)
    net.run_for(0.25)
    (up,) = [r.decoded() for r in net.sent("up", MsgType.HEARTBEAT)]
    (down,) = [r.decoded() for r in net.sent("down", MsgType.HEARTBEAT)]
    assert up == Heartbeat(t0 + 1.0, 0) and down == Heartbeat(t0 + 1.0, 0)
    net.run_for(9.0)
    assert (
        len(net.sent("up", MsgType.HEARTBEAT)) == 10
        and len(net.sent("down", MsgType.HEARTBEAT)) == 10
    )


def test_heartbeat_carries_policy_versions() -> None:
    net = _net()
    net.conns[b"r0"].policy_version = 3
    net.learner.policy_version = 4
    net.run_for(1.0)
    assert net.sent("up", MsgType.HEARTBEAT)[0].decoded().policy_version == 3
    assert net.sent("down", MsgType.HEARTBEAT)[0].decoded().policy_version == 4


def test_traffic_postpones_the_senders_heartbeat() -> None:
    net = _net()
    conn = net.conns[b"r0"]
    net.run_for(0.5)
    conn.submit([make_traj("a")])
    net.pump()
    net.run_for(1.25)  # 0.5 + 1.25 = 1.75 s after the handshake, 1.25 s after the batch
    ups = net.sent("up", MsgType.HEARTBEAT)
    assert len(ups) == 1 and ups[0].decoded().time == net.clock.now - 0.25  # 1.0 s after the batch


def test_next_deadline() -> None:
    net = _net()
    conn, lp = net.conns[b"r0"], net.learner
    t = net.clock.now
    assert conn.next_deadline() == t + 1.0 and lp.next_deadline() == t + 1.0
    conn.start(t)
    assert conn.state is SenderState.HELLO_SENT and conn.next_deadline() == t + 5.0
    assert rollout().next_deadline() == math.inf  # IDLE: nothing to wait for
    assert learner().next_deadline() == math.inf  # no peers


def test_sender_detects_a_silent_learner() -> None:
    net = _net()
    conn = net.conns[b"r0"]
    conn.submit([make_traj("a")])
    net.drop = lambda direction, ident, frames: direction == "down"
    net.pump()
    net.run_for(4.75)
    assert conn.state is SenderState.READY
    net.run_for(0.25)
    assert conn.state is SenderState.IDLE and net.events(b"r0", PeerTimedOut) == [
        PeerTimedOut("learner")
    ]
    # the unacked batch waits for the next session
    assert conn.pending == 1 and len(conn._queue) == 1


def test_sender_gives_up_on_an_unanswered_hello() -> None:
    conn = rollout(heartbeat_timeout_s=3.0)
    conn.start(100.0)
    conn.data_to_send(100.0)
    assert conn.tick(102.9) == [] and conn.state is SenderState.HELLO_SENT
    assert conn.tick(103.0) == [PeerTimedOut("learner")] and conn.state is SenderState.IDLE


def test_learner_detects_a_silent_sender_and_frees_its_room() -> None:
    net = Net(
        learner(
            capacity=4, max_credits_per_peer=3, heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0
        )
    )
    net.add(b"r0", rollout("rollout-0"))
    net.add(b"r1", rollout("rollout-1"))
    net.pump()
    assert net.conns[b"r1"].credits == 1
    net.drop = lambda direction, ident, frames: direction == "up" and ident == b"r0"
    net.run_for(5.0)
    assert net.learner_events_of(PeerTimedOut) == [PeerTimedOut("rollout-0")]
    assert net.learner.ready_peers() == ["rollout-1"]
    assert net.conns[b"r1"].credits == 3  # the silent peer's credits went to the live one


def test_timed_out_peer_is_asked_for_hello_and_rejoins() -> None:
    net = _net()
    conn = net.conns[b"r0"]
    net.drop = lambda direction, ident, frames: direction == "up"
    net.run_for(5.0)
    assert net.learner.peers == {}
    net.drop = None
    net.run_for(1.0)  # the sender's next heartbeat reaches a learner that forgot it
    assert [e.error.code for e in net.events(b"r0", PeerError)] == [ErrorCode.HELLO_REQUIRED]
    net.reconnect_idle()
    net.pump()
    assert conn.state is SenderState.READY and net.learner.ready_peers() == ["rollout-0"]


def test_heartbeats_keep_an_idle_session_alive() -> None:
    net = _net()
    net.run_for(60.0, step=0.5)
    assert net.conns[b"r0"].state is SenderState.READY and net.learner.ready_peers() == [
        "rollout-0"
    ]
    assert not net.events(b"r0", PeerTimedOut) and not net.learner_events_of(PeerTimedOut)
