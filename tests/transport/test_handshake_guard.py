"""``HandshakeGuard``: connections in ZeroMQ's handshake capped per source and in all, with room kept
for the first connection of any other source (SPEC §13); and a real server channel shutting down
connections over the cap."""

from __future__ import annotations

import asyncio
import socket

from protocol.zmq_transport import HandshakeGuard, ZmqServerChannel


def test_caps_per_source_and_in_all_with_room_for_a_new_source() -> None:
    g = HandshakeGuard(per_source=2, total=5, window_s=5.0, reserved=2)
    assert [g.admit(fd, "a", 0.0) for fd in (1, 2, 3)] == [True, True, False]
    assert g.admit(4, "b", 0.0) is True
    # sources already handshaking share total - reserved = 3: "b" gets no second one
    assert g.admit(5, "b", 0.0) is False
    # the first connection of a new source uses the reserve, up to the total
    assert g.admit(6, "c", 0.0) and g.admit(7, "d", 0.0)
    assert g.admit(8, "e", 0.0) is False and len(g) == 5


def test_closed_and_aged_connections_free_their_room() -> None:
    g = HandshakeGuard(per_source=1, total=10, window_s=5.0)
    assert g.admit(1, "a", 0.0) and not g.admit(2, "a", 1.0)
    g.closed(1)
    assert g.admit(2, "a", 1.0)
    # past the handshake deadline a connection no longer counts (libzmq dropped it, or it is in)
    assert g.admit(3, "a", 6.0) and len(g) == 1
    # a descriptor number reused for a new connection replaces the old one's entry
    assert g.admit(3, "b", 6.5) and len(g) == 1


def _closed(c: socket.socket) -> bool:
    """Whether the server closed ``c`` (what it sent before, its ZMTP greeting, is read away)."""
    c.setblocking(False)
    try:
        while data := c.recv(4096):
            del data
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_connection_over_the_per_source_cap_is_shut_down() -> None:
    async def main() -> list[bool]:
        ch = ZmqServerChannel("tcp://127.0.0.1:0", handshakes_per_source=2)
        port = int(ch.address.rsplit(":", 1)[1])
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            closed: list[bool] = []
            for _ in range(250):
                await asyncio.sleep(0.02)
                closed = [_closed(c) for c in conns]
                if any(closed):
                    break
            assert ch.guard is not None and len(ch.guard) == 2
            return closed
        finally:
            for c in conns:
                c.close()
            ch.close()

    assert asyncio.run(main()) == [False, False, True]
