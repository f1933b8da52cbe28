"""At-least-once delivery with deduplication: unacknowledged batches are resent with their original
seqs after a reconnect, WELCOME.next_seq skips what arrived, the learner drops repeats by
(peer_id, epoch, seq) and by trajectory id."""

from __future__ import annotations

from protocol_testkit import Net, connected, learner, make_traj, rollout

from protocol import codec
from protocol.errors import ErrorCode
from protocol.events import BatchAcked, PeerError, PeerTimedOut
from protocol.messages import MsgType
from protocol.sender import SenderState


def _partition(net: Net) -> dict[str, bool]:
    """Drop learner -> rollout traffic while ``state['down']`` is set."""
    state = {"down": False}
    net.drop = lambda direction, ident, frames: direction == "down" and state["down"]
    return state


def test_lost_acks_reconnect_and_next_seq() -> None:
    net = connected(capacity=8, max_credits=4)
    conn = net.conns[b"r0"]
    cut = _partition(net)
    cut["down"] = True
    for i in range(3):
        conn.submit([make_traj(f"t{i}")])
    net.pump()
    assert net.delivered_ids() == ["t0", "t1", "t2"]  # the learner owns them ...
    assert conn.pending == 3 and len(conn._unacked) == 3  # ... but the sender never heard so
    net.run_for(conn.heartbeat_timeout_s)  # heartbeats go up; nothing comes down
    assert net.events(b"r0", PeerTimedOut) and conn.state is SenderState.IDLE
    assert net.learner.ready_peers() == ["rollout-0"]  # the learner still hears the sender
    assert len(conn._queue) == 3 and not conn._unacked  # requeued in order for the next session
    cut["down"] = False
    hello_at = len(net.wire)
    net.reconnect_idle()
    net.pump()
    welcome = net.sent("down", MsgType.WELCOME)[-1].decoded()
    assert welcome.next_seq == 4  # everything up to seq 3 arrived
    # nothing resent
    assert not [r for r in net.wire[hello_at:] if r.type is MsgType.TRAJECTORY_BATCH]
    assert conn.pending == 0
    assert BatchAcked([1, 2, 3], [1, 2, 3]) in net.sender_events[b"r0"]
    assert net.delivered_ids() == ["t0", "t1", "t2"]


def test_resend_with_original_seqs_and_dedup_of_the_repeats() -> None:
    """Batch 2 is lost on the way up, every ACK on the way down: after the reconnect the learner
    reports next_seq 2, the sender resends 2 and 3 byte for byte, 3 is acknowledged as duplicate."""
    net = connected(capacity=8, max_credits=4)
    conn = net.conns[b"r0"]
    state = {"down": True}

    def drop(direction: str, ident: bytes, frames: list) -> bool:
        if direction == "down":
            return state["down"]
        return (
            codec.peek_type(frames) is MsgType.TRAJECTORY_BATCH
            and codec.decode(frames).seq == 2
            and state["down"]
        )

    net.drop = drop
    for i in (1, 2, 3):
        conn.submit([make_traj(f"t{i}")])
    net.pump()
    assert net.delivered_ids() == ["t1", "t3"]
    first = {r.decoded().seq: r.frames for r in net.sent("up", MsgType.TRAJECTORY_BATCH)}
    net.run_for(conn.heartbeat_timeout_s)
    assert conn.state is SenderState.IDLE
    state["down"] = False
    mark = len(net.wire)
    net.reconnect_idle()
    net.pump()
    assert net.sent("down", MsgType.WELCOME)[-1].decoded().next_seq == 2
    resent = [r for r in net.wire[mark:] if r.type is MsgType.TRAJECTORY_BATCH]
    assert [r.decoded().seq for r in resent] == [2, 3]
    assert all(r.frames == first[r.decoded().seq] for r in resent)  # same bytes, same seq
    acks = [r.decoded() for r in net.wire[mark:] if r.type is MsgType.ACK]
    assert [(a.seqs, a.duplicates) for a in acks if a.seqs] == [([2], []), ([3], [3])]
    assert sorted(net.delivered_ids()) == ["t1", "t2", "t3"] and len(net.delivered_ids()) == 3
    assert conn.pending == 0 and sorted(net.acked(b"r0")) == [1, 2, 3]
    assert net.learner.stats["duplicate_batches"] == 1
    assert net.learner.buffered == 3  # the duplicate took no room


def test_learner_restart_hello_required_then_resend() -> None:
    net = connected(capacity=8, max_credits=4)
    conn = net.conns[b"r0"]
    conn.submit([make_traj("t1")])
    conn.submit([make_traj("t2")])
    net.pump()
    assert conn.pending == 0
    net.learner = learner(capacity=8, max_credits_per_peer=4)  # restarted: every session forgotten
    conn.submit([make_traj("t3")])
    net.step()  # the batch reaches the new learner, which answers HELLO_REQUIRED
    (err,) = [e.error for e in net.events(b"r0", PeerError)]
    assert (err.code, err.ref_seq) == (ErrorCode.HELLO_REQUIRED, 3)
    assert conn.state is SenderState.IDLE and conn.pending == 1
    net.reconnect_idle()
    net.pump()
    assert conn.state is SenderState.READY and conn.pending == 0
    assert net.sent("down", MsgType.WELCOME)[-1].decoded().next_seq == 1
    assert net.delivered_ids() == ["t1", "t2", "t3"]  # t3 delivered once, to the new learner
    assert [r.decoded().seq for r in net.sent("up", MsgType.TRAJECTORY_BATCH)] == [1, 2, 3, 3]


def test_learner_restart_detected_by_heartbeat() -> None:
    net = connected()
    conn = net.conns[b"r0"]
    net.learner = learner()
    net.advance(conn.heartbeat_interval_s)  # the sender's heartbeat is its next message
    assert conn.state is SenderState.IDLE
    assert [e.error.code for e in net.events(b"r0", PeerError)] == [ErrorCode.HELLO_REQUIRED]
    net.reconnect_idle()
    net.pump()
    assert conn.state is SenderState.READY and net.learner.ready_peers() == ["rollout-0"]


def test_restarted_sender_new_epoch_same_trajectory_ids_filtered() -> None:
    """A restarted rollout server (new epoch, seqs from 1 again) resends spooled trajectories."""
    net = connected(capacity=8, max_credits=4)
    net.conns[b"r0"].submit([make_traj("t1"), make_traj("t2")])
    net.pump()
    restarted = net.add(b"r0-new", rollout("rollout-0", "epoch-2"))
    net.pump()
    assert net.learner.ready_peers() == ["rollout-0"]  # the old session was replaced
    assert net.sent("down", MsgType.WELCOME, b"r0-new")[0].decoded().next_seq == 1
    restarted.submit([make_traj("t1"), make_traj("t2")])  # all seen
    restarted.submit([make_traj("t2"), make_traj("t3")])  # half seen
    net.pump()
    received = net.received()
    assert [
        (e.seq, [t.trajectory_id for t in e.trajectories], e.duplicate_trajectories)
        for e in received
    ] == [(1, ["t1", "t2"], 0), (2, ["t3"], 1)]
    assert net.learner.stats["duplicate_trajectories"] == 3
    # the all-duplicate batch took no room
    assert restarted.pending == 0 and net.learner.buffered == 2


def test_trajectory_id_window_is_bounded() -> None:
    """The window remembers at least the last ``dedup_window`` ids and forgets older generations."""
    net = connected(capacity=16, max_credits=4, dedup_window=2)
    conn = net.conns[b"r0"]
    for t in ("t1", "t2", "t3", "t4", "t5"):
        conn.submit([make_traj(t)])
        net.pump()
        net.learner.batch_consumed()
    assert "t1" not in net.learner._seen and all(t in net.learner._seen for t in ("t4", "t5"))
    assert len(net.learner._seen) <= 2 * 2
    conn.submit([make_traj("t1"), make_traj("t5")])  # t1 fell out of the window: accepted again
    net.pump()
    assert net.received()[-1].duplicate_trajectories == 1
    assert [t.trajectory_id for t in net.received()[-1].trajectories] == ["t1"]


def test_streams_are_per_peer_and_epoch() -> None:
    net = Net(learner())
    a = net.add(b"a", rollout("rollout-a", "same-epoch"))
    b = net.add(b"b", rollout("rollout-b", "same-epoch"))
    net.pump()
    a.submit([make_traj("a1")])
    b.submit([make_traj("b1")])
    net.pump()
    assert sorted(net.delivered_ids()) == ["a1", "b1"]  # both seq 1, no false duplicate
    assert net.learner.stats["duplicate_batches"] == 0


def test_unacked_batches_survive_any_number_of_reconnects() -> None:
    net = connected(capacity=4, max_credits=2)
    conn = net.conns[b"r0"]
    cut = _partition(net)
    cut["down"] = True
    for i in range(5):
        conn.submit([make_traj(f"t{i}")])
    for _ in range(3):
        net.pump()
        conn.start(net.clock.now)  # session after session without a single ACK arriving
    cut["down"] = False
    for _ in range(5):
        net.pump()
        net.learner.batch_consumed(net.learner.buffered)
    net.pump()
    assert conn.pending == 0 and net.delivered_ids() == [f"t{i}" for i in range(5)]
    assert sorted(net.acked(b"r0")) == [1, 2, 3, 4, 5]
