"""Per-message budgets (protocol.budget), the learner's choice of budget per peer, the codec's
answer to a message dropped over its budget, and the run's trajectory length limits."""

from __future__ import annotations

import anyio
import pytest
import zmq
from protocol_testkit import connected, learner, make_traj

from protocol import codec
from protocol.budget import MessageBudget, MessageReader, Truncated
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Heartbeat, MsgType, TrajectoryBatch
from protocol.zmq_transport import ZmqServerChannel, exposure_warning, is_loopback


def _batch_frames(seq: int = 1, n: int = 2) -> list[bytes]:
    return [
        bytes(memoryview(f))
        for f in codec.encode(TrajectoryBatch(seq, [make_traj(f"t{i}") for i in range(n)]))
    ]


def _read(budget: MessageBudget, frames: list[bytes]) -> list[bytes]:
    r = MessageReader(budget)
    for f in frames:
        r.add(f)
    return r.result()


def test_reader_keeps_a_message_within_its_budget() -> None:
    frames = _batch_frames()
    assert _read(MessageBudget(1 << 20, 7), frames) == frames


def test_reader_over_budget_keeps_only_type_and_small_header() -> None:
    frames = _batch_frames()
    out = _read(MessageBudget(1 << 20, 2, "before HELLO"), frames)
    assert isinstance(out, Truncated) and out == frames[:2]
    assert out.nframes == 7 and out.nbytes == sum(map(len, frames))
    assert "more than 2 frames" in out.what and "before HELLO" in out.what
    big = _read(MessageBudget(100, 7), [b"\x03", b"\x80", b"x" * 1000, b"y"])
    assert isinstance(big, Truncated) and len(big) == 2 and "more than 100 bytes" in big.what


@pytest.mark.parametrize(
    ("budget_index", "msg_type", "code"),
    [
        # a forgotten sender handshakes again
        (0, MsgType.TRAJECTORY_BATCH, ErrorCode.HELLO_REQUIRED),
        (0, MsgType.HELLO, ErrorCode.TOO_LARGE),
        (1, MsgType.TRAJECTORY_BATCH, ErrorCode.CREDIT_EXCEEDED),  # kept and resent by the sender
        (1, MsgType.HEARTBEAT, ErrorCode.TOO_LARGE),
        (2, MsgType.TRAJECTORY_BATCH, ErrorCode.TOO_LARGE),
    ],
)
def test_decode_answers_a_truncated_message_with_the_budgets_code(
    budget_index: int, msg_type: MsgType, code: ErrorCode
) -> None:
    budget = learner()._budgets[budget_index]
    frames = _batch_frames(seq=5)
    frames[0] = bytes((msg_type,))
    t = Truncated(frames[:2], nbytes=10 << 30, nframes=9, budget=budget)
    with pytest.raises(ProtocolError) as ei:
        codec.decode(t)
    assert ei.value.code == code and ei.value.ref_type == msg_type
    assert ei.value.ref_seq == (5 if msg_type == MsgType.TRAJECTORY_BATCH else 0)


def test_learner_budget_by_peer_state() -> None:
    net = connected(max_credits=2)
    proto = net.learner
    assert proto.message_budget(b"stranger").name == "before HELLO"
    assert proto.message_budget(b"r0").max_bytes == proto.limits.max_message_bytes
    proto.peers[b"r0"].credits = 0
    assert proto.message_budget(b"r0").name == "a peer without a credit"


def test_what_a_peer_may_make_the_transport_hold_follows_its_credits() -> None:
    """``hold_allowance`` (``protocol.hold_ledger``): a stranger one small message, a peer in
    session a batch per credit and one more for small messages."""
    net = connected(max_credits=2)
    proto, batch = net.learner, net.learner.limits.max_message_bytes
    assert (
        proto.hold_allowance(None) == proto.hold_allowance(b"stranger") == proto.small_message_bytes
    )
    assert proto.hold_allowance(b"r0") == 3 * batch
    proto.peers[b"r0"].credits = 0
    assert proto.hold_allowance(b"r0") == batch


def test_truncated_batch_from_a_stranger_is_answered_hello_required() -> None:
    proto = learner()
    t = _read(proto.message_budget(b"x"), _batch_frames(seq=3))
    (ev,) = proto.receive(b"x", t, 0.0)
    assert ev.error.code == ErrorCode.HELLO_REQUIRED and "frames" in ev.error.message
    ((_, frames),) = proto.data_to_send(0.0)
    assert codec.decode(frames).code == ErrorCode.HELLO_REQUIRED


def test_trajectory_lengths_against_the_run() -> None:
    limits = codec.CodecLimits(max_model_len=100, max_response_tokens=40)
    ok = codec.encode(TrajectoryBatch(1, [make_traj("a", prompt_len=60, response_len=40)]))
    codec.decode(ok, limits)
    for prompt, response, field, limit in [
        (61, 40, "trajectories[0].prompt_len+response_len", "100"),
        (10, 41, "trajectories[0].response_len", "40"),
    ]:
        frames = codec.encode(
            TrajectoryBatch(7, [make_traj("a", prompt_len=prompt, response_len=response)])
        )
        with pytest.raises(ProtocolError) as ei:
            codec.decode(frames, limits)
        e = ei.value
        assert (e.code, e.field, e.ref_seq) == (
            ErrorCode.TOO_LARGE,
            field,
            7,
        ) and limit in e.message


def test_run_message_bytes_follows_the_run() -> None:
    limits = codec.CodecLimits(max_trajectories_per_batch=4096, max_model_len=768)
    assert codec.run_message_bytes(limits) == 4096 * 768 * 17 + codec.HEADER_ROOM_BYTES  # 67 MiB
    long = codec.CodecLimits(max_trajectories_per_batch=4096, max_model_len=16384)
    assert codec.run_message_bytes(long) == long.max_message_bytes


def test_loopback_addresses() -> None:
    assert (
        is_loopback("tcp://127.0.0.1:5555")
        and is_loopback("tcp://localhost:1")
        and is_loopback("ipc:///x")
    )
    assert is_loopback("tcp://[::1]:5555")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    assert exposure_warning("tcp://0.0.0.0:5555", curve=False) is not None
    assert exposure_warning("tcp://0.0.0.0:5555", curve=True) is None


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_zmq_channel_drops_a_message_over_budget_frame_by_frame() -> None:
    """A real ROUTER: a 40-frame message from a peer with a 2-frame budget comes out as
    ``Truncated``; the same peer's next message is whole."""
    ctx = zmq.asyncio.Context()
    budget = MessageBudget(1 << 20, 2, "before HELLO", ErrorCode.HELLO_REQUIRED)
    ch = ZmqServerChannel("tcp://127.0.0.1:0", context=ctx, budget=lambda identity: budget)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(ch.address)
    try:
        with anyio.fail_after(10):
            await dealer.send_multipart([bytes((MsgType.HELLO,)), b"\x80", *[b"z" * 65536] * 38])
            hb = codec.encode(Heartbeat(1.0, 0))
            await dealer.send_multipart(hb)
            _, first = await ch.recv()
            assert isinstance(first, Truncated) and first.nframes == 40 and len(first) == 2
            _, second = await ch.recv()
            assert not isinstance(second, Truncated) and isinstance(codec.decode(second), Heartbeat)
    finally:
        dealer.close(linger=0)
        await ch.aclose()
        ctx.term()
