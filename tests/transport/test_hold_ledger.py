"""What libzmq holds of each connection (``protocol.hold_ledger``), and the server channel cutting a
connection that holds more than its peer may send (``protocol.zmq_hold_watch``, SPEC §13).

The count must not drift over a long connection, or a valid peer would be cut one day: checked
with real CURVE and plain connections, frame sizes at each header boundary."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct

import pytest
import zmq
import zmq.asyncio

from protocol.hold_ledger import HoldLedger, wire_bytes
from protocol.zmq_hold_watch import tcp_counts
from protocol.zmq_transport import ZmqClientChannel, ZmqServerChannel

MiB = 1 << 20


def test_wire_bytes_at_the_frame_header_boundaries() -> None:
    # ZMTP: flags and a 1-byte size up to a 255-byte body, else an 8-byte size
    assert [wire_bytes(n, curve=False) for n in (0, 255, 256)] == [2, 257, 265]
    # CURVE: each frame is a MESSAGE command of the frame plus 33 bytes
    assert [wire_bytes(n, curve=True) for n in (0, 222, 223)] == [35, 257, 265]


def test_a_connection_over_its_peers_allowance() -> None:
    allow = {None: 100, b"p": 1000}
    ledger = HoldLedger(lambda ident: allow.get(ident, 0), slack=10, curve=False)
    ledger.accepted(7, ("10.0.0.1", 4000))
    assert ledger.check(7, received=110, unread=0) is None  # the allowance plus the slack
    over = ledger.check(7, received=200, unread=50)
    assert over is not None and (over.held, over.limit, over.identity) == (150, 110, None)
    ledger.delivered(7, b"p", [100, 300])  # 102 + 309 on the wire; the peer is known now
    assert ledger.held(7, received=1421, unread=0) == 1010
    assert ledger.check(7, received=1421, unread=0) is None
    assert ledger.check(7, received=1422, unread=0) is not None
    ledger.accepted(7, ("10.0.0.1", 4000))  # the monitor's late word of it: the record stays
    assert ledger.held(7, received=1421, unread=0) == 1010
    ledger.accepted(7, ("10.0.0.2", 4001))  # the descriptor reused: a fresh connection
    assert ledger.check(7, received=50, unread=0) is None
    ledger.closed(7)
    assert ledger.check(7, received=10**9, unread=0) is None and len(ledger) == 0


SIZES = (1, 200, 222, 223, 255, 256, 70_000)


@pytest.mark.parametrize("token", ["a-token", None], ids=["curve", "plain"])
def test_the_count_does_not_drift_over_many_messages(token: str | None) -> None:
    """After 2,000 messages, what the ledger says libzmq holds of the connection is what it said
    after the first one: the handshake's bytes, exactly."""

    async def main() -> list[int]:
        ctx = zmq.asyncio.Context()
        ch = ZmqServerChannel(
            "tcp://127.0.0.1:0", token=token, allowance=lambda ident: 10 * MiB, context=ctx
        )
        client = ZmqClientChannel(ch.address, token=token, context=ctx)
        held: list[int] = []
        try:
            for i in range(2000):
                await client.send([bytes(SIZES[i % len(SIZES)]), b"x" * (i % 300)])
                await ch.recv()
                if i in (0, 1999):
                    assert ch.ledger is not None
                    (fd,) = ch.ledger.fds()
                    now = ch.ledger.held(fd, *tcp_counts(fd))
                    assert now is not None
                    held.append(now)
        finally:
            await client.aclose()
            await ch.aclose()
            ctx.term()
        return held

    first, last = asyncio.run(main())
    assert first == last and 0 < first < 2048, (first, last)


def _zmtp_null_dealer(port: int) -> socket.socket:
    """A raw TCP connection that has done ZMTP 3.0's NULL handshake as a DEALER: what it writes
    next is frames, and nothing makes it finish a message (a libzmq sender would hold a message
    until its last frame, and send it whole)."""
    conn = socket.create_connection(("127.0.0.1", port))
    greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)
    props = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    ready = b"\x05READY" + props
    conn.sendall(greeting + bytes((0x04, len(ready))) + ready)
    # frames sent before the server's own READY would be taken for handshake commands
    _, size = _read_exactly(conn, 64 + 2)[-2:]
    assert b"READY" in _read_exactly(conn, size)
    return conn


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        assert chunk, "the server closed the connection in the handshake"
        data += chunk
    return data


def test_an_unfinished_message_of_many_frames_is_cut() -> None:
    """A peer (no authentication at all) streams 64 KiB frames of one message that never ends,
    against an allowance of 1 MiB: the connection is cut and reported once libzmq holds a little
    more than that, and another peer is served."""

    async def main() -> tuple[int, list[tuple[str, str, str]]]:
        ctx = zmq.asyncio.Context()
        refused: list[tuple[str, str, str]] = []
        ch = ZmqServerChannel(
            "tcp://127.0.0.1:0",
            allowance=lambda ident: MiB,
            on_refused=lambda *a: refused.append(a),
            max_frame_bytes=64 << 10,
            context=ctx,
        )
        ch._start_watch()
        conn = _zmtp_null_dealer(int(ch.address.rsplit(":", 1)[1]))
        conn.setblocking(False)
        frame = struct.pack(">BQ", 0x03, 64 << 10) + bytes(64 << 10)  # MORE | LONG, 64 KiB
        sent = 0
        try:
            while sent < 1 << 30 and not refused:
                try:
                    sent += conn.send(frame[sent % len(frame) :])
                except BlockingIOError:
                    await asyncio.sleep(0.001)
                except OSError:  # cut
                    break
            for _ in range(100):
                if refused:
                    break
                await asyncio.sleep(0.02)
            client = ZmqClientChannel(ch.address, context=ctx)
            await client.send([b"valid"])
            _, frames = await asyncio.wait_for(ch.recv(), 10)
            assert bytes(frames[0]) == b"valid"
            await client.aclose()
        finally:
            conn.close()
            await ch.aclose()
            ctx.term()
        return sent, refused

    sent, refused = asyncio.run(main())
    assert refused and refused[0][1] == "TOO_LARGE" and "connection cut" in refused[0][2], refused
    assert sent < 64 * MiB, f"{sent / MiB:.0f} MiB sent before the cut"


def test_a_channel_dropped_unclosed_stops_its_watch_thread() -> None:
    async def main() -> None:
        ch = ZmqServerChannel("tcp://127.0.0.1:0", allowance=lambda ident: MiB)
        ch._start_watch()
        hold = ch._hold
        assert hold is not None and hold._thread is not None and hold._thread.is_alive()
        del ch
        gc.collect()
        assert not hold._thread.is_alive()

    asyncio.run(main())
