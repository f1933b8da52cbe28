"""A server channel whose peers split frames (SPEC §2) joins the pieces as it reads them: the frames
come back whole as ``codec.Joined``, budgets still count pieces, and a message that ends inside a
split frame is refused by the codec as it would be unjoined."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from protocol import codec
from protocol.budget import MessageBudget, Truncated
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import MsgType
from protocol.zmq_transport import ZmqServerChannel

PIECE = 4096


async def _receive(
    messages: list[list[bytes]], budget: MessageBudget, peers_split: bool = True
) -> list[list[Any]]:
    ctx = zmq.asyncio.Context()
    ch = ZmqServerChannel(
        "tcp://127.0.0.1:0",
        context=ctx,
        max_frame_bytes=PIECE,
        budget=lambda identity: budget,
        peers_split=peers_split,
    )
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(ch.address)
    try:
        for frames in messages:
            await dealer.send_multipart(frames)
        return [(await asyncio.wait_for(ch.recv(), 10))[1] for _ in messages]
    finally:
        dealer.close(linger=0)
        await ch.aclose()
        ctx.term()


def _pieces(frames: list[bytes]) -> list[bytes]:
    return [codec.view(f).tobytes() for f in codec.split_frames(frames, PIECE)]


@pytest.mark.parametrize("n", [PIECE - 1, PIECE, 3 * PIECE, 3 * PIECE + 7])
def test_pieces_come_back_joined(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    frames = [bytes((MsgType.TRAJECTORY_BATCH,)), b"header", data, b"", data[:PIECE], b"tail"]
    budget = MessageBudget(1 << 20, 64)
    [got] = asyncio.run(_receive([_pieces(frames)], budget))
    assert isinstance(got, codec.Joined) and not got.unended
    assert [codec.view(f).tobytes() for f in got] == frames


def test_the_budget_counts_pieces_and_the_next_message_is_whole() -> None:
    big = bytes(10 * PIECE)  # 11 pieces: over a budget of 8 frames, though 3 frames whole
    budget = MessageBudget(1 << 20, 8, "before HELLO", ErrorCode.HELLO_REQUIRED)
    hb = [bytes((MsgType.HEARTBEAT,)), b"\x80"]
    over, after = asyncio.run(
        _receive([_pieces([bytes((MsgType.HELLO,)), b"\x80", big]), hb], budget)
    )
    assert isinstance(over, Truncated) and over.nframes == 13 and len(over) == 2
    assert isinstance(after, codec.Joined) and [bytes(f) for f in after] == hb


def test_a_message_ending_inside_a_split_frame_is_malformed() -> None:
    frames = [bytes((MsgType.HEARTBEAT,)), b"\x80", bytes(PIECE)]
    [got] = asyncio.run(_receive([frames], MessageBudget(1 << 20, 8)))
    assert isinstance(got, codec.Joined) and got.unended
    with pytest.raises(ProtocolError) as e:
        codec.decode(got, piece_bytes=PIECE)
    assert e.value.code is ErrorCode.MALFORMED and e.value.ref_type == MsgType.HEARTBEAT


def test_a_channel_whose_peers_do_not_split_passes_frames_through() -> None:
    """A relay's downstream channel: a frame of exactly the bound is a frame, not a piece."""
    frames = [bytes((MsgType.HEARTBEAT,)), b"\x80", bytes(PIECE), b"x"]
    [got] = asyncio.run(_receive([frames], MessageBudget(1 << 20, 8), peers_split=False))
    assert not isinstance(got, codec.Joined)
    assert [bytes(f) for f in got] == frames
