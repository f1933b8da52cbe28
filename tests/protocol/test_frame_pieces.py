"""Frame pieces (1.6): a learner with a frame bound announces it in WELCOME, senders split every
larger frame into pieces of exactly that size and a shorter last one, and the learner joins them
(SPEC §2). The bound is what lets the transport refuse big frames before authentication (§13)."""

from __future__ import annotations

import numpy as np
import pytest
from protocol_testkit import Net, learner, make_traj, rollout, trajs_equal

from protocol import codec
from protocol.budget import MessageReader, Truncated
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import MsgType, TrajectoryBatch
from protocol.sender import SenderState, encode_batch
from protocol.version import ProtocolVersion

PIECE = 4096


@pytest.mark.parametrize("n", [0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE, 3 * PIECE + 7])
def test_split_and_join_round_trip(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    frames = [b"\x01", b"header", data, b"tail"]
    split = codec.split_frames(frames, PIECE)
    sizes = [codec.view(f).nbytes for f in split[2:-1]]
    # every piece but the last is exactly PIECE bytes; the last is shorter, possibly empty
    assert len(sizes) == n // PIECE + 1 and all(s == PIECE for s in sizes[:-1])
    assert sizes[-1] == n % PIECE
    joined = codec.join_pieces(split, PIECE)
    assert [codec.view(f).tobytes() for f in joined] == [
        b"\x01",
        b"header",
        data.tobytes(),
        b"tail",
    ]


def test_pieces_are_views_and_small_frames_pass_through() -> None:
    big = np.arange(3 * PIECE, dtype=np.uint8)
    split = codec.split_frames([b"\x01", big], PIECE)
    assert split[0] == b"\x01" and np.shares_memory(np.frombuffer(split[1], np.uint8), big)
    assert codec.join_pieces([b"\x01", b"x"], PIECE) == [b"\x01", b"x"]


def test_a_message_ending_inside_a_split_frame_is_malformed() -> None:
    frames = [bytes((MsgType.HEARTBEAT,)), bytes(PIECE)]
    with pytest.raises(ProtocolError) as e:
        codec.decode(frames, piece_bytes=PIECE)
    assert e.value.code is ErrorCode.MALFORMED and e.value.ref_type == MsgType.HEARTBEAT


def _pieced_net() -> tuple[Net, object]:
    net = Net(learner(max_frame_bytes=PIECE, capacity=4, max_credits_per_peer=2))
    conn = net.add(b"r0", rollout())
    net.pump()
    assert conn.state is SenderState.READY
    return net, conn


def test_welcome_announces_the_frame_bound_and_batches_travel_in_pieces() -> None:
    net, conn = _pieced_net()
    welcome = net.sent("down", MsgType.WELCOME)[0].decoded()
    assert welcome.limits.max_frame_bytes == PIECE
    trajs = [make_traj("a", prompt_len=3000, response_len=5000), make_traj("b")]
    conn.submit(trajs)  # type: ignore[attr-defined]
    net.pump()
    [record] = net.sent("up", MsgType.TRAJECTORY_BATCH)
    assert max(len(f) for f in record.frames) == PIECE and len(record.frames) > 13
    [received] = net.received()
    assert all(trajs_equal(x, y) for x, y in zip(received.trajectories, trajs, strict=True))
    assert net.acked(b"r0") == [1]


def test_a_pieced_batch_fits_the_budget_of_a_peer_with_a_credit() -> None:
    """The transport counts pieces against the budget's frames: a batch at the message bound
    fits, one over it does not."""
    net, _ = _pieced_net()
    frames = codec.split_frames(
        encode_batch(1, [make_traj("a", prompt_len=3000, response_len=5000)], True), PIECE
    )
    reader = MessageReader(net.learner.message_budget(b"r0"))
    for f in frames:
        reader.add(codec.view(f))
    assert not isinstance(reader.result(), Truncated)
    assert isinstance(codec.decode(reader.result(), piece_bytes=PIECE), TrajectoryBatch)


def test_a_learner_with_a_frame_bound_refuses_a_sender_older_than_1_6() -> None:
    """Its batch frames would be dropped by the transport: refused at HELLO, saying why."""
    net = Net(learner(max_frame_bytes=PIECE))
    conn = net.add(b"r0", rollout(version=ProtocolVersion(1, 5)))
    net.pump()
    assert conn.state is SenderState.FAILED
    [err] = net.errors_sent("down")
    assert err.code == ErrorCode.VERSION_MISMATCH and f"at most {PIECE} bytes" in err.message


def test_a_1_6_sender_sends_whole_frames_to_a_learner_without_a_bound() -> None:
    net = Net(learner(version=ProtocolVersion(1, 5)))
    conn = net.add(b"r0", rollout())
    net.pump()
    conn.submit([make_traj("a", prompt_len=3000, response_len=5000)])
    net.pump()
    [record] = net.sent("up", MsgType.TRAJECTORY_BATCH)
    assert len(record.frames) == 13 and net.delivered_ids() == ["a"]
