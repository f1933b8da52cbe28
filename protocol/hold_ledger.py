"""What libzmq holds of each connection's unread messages, so that a peer can be cut off past it.

libzmq hands a multipart message over only once all of it has arrived, and bounds frames, never
their count (SPEC §13): a peer can make a receiver hold any number of frames of one unfinished
message. No libzmq option bounds that, but the kernel counts every byte a TCP connection received
(``TCP_INFO``), and the receiver knows which bytes it was handed (each frame names its connection's
descriptor). So, per connection:

    held = bytes received - bytes still unread in the kernel - wire bytes of the frames handed over

is what libzmq holds of it: frames of an unfinished message, complete messages not yet read, and
the few handshake bytes. Each frame's size on the wire is exact (ZMTP's frame header, and CURVE's
MESSAGE command around it), so the count does not drift over a long connection. A connection that
holds more than its peer may send (``allowance(identity)``: what its credits allow, by the
receiver's protocol) plus ``slack`` (the handshake's frames) is over, and its owner cuts it
(``protocol.zmq_hold_watch``). Pure, no I/O, and thread-safe: the channel's event loop records
connections and deliveries, a watch thread reads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

# CURVE wraps each frame in a MESSAGE command: name length and "MESSAGE" (8), short nonce (8),
# Poly1305 tag (16), and the frame's flags (1) (ZMTP 3.0 CurveZMQ, RFC 26).
CURVE_MESSAGE_BYTES = 33
SHORT_FRAME_BYTES = (
    255  # ZMTP: a frame body up to this size has a 1-byte size, larger an 8-byte one
)


def wire_bytes(payload: int, curve: bool) -> int:
    """Bytes one frame of ``payload`` bytes takes on a ZMTP 3 connection (with CURVE or none)."""
    body = payload + (CURVE_MESSAGE_BYTES if curve else 0)
    return body + (2 if body <= SHORT_FRAME_BYTES else 9)


@dataclass
class _Connection:
    peer: tuple[str, int]
    identity: bytes | None = None  # the routing id its messages came with; None before the first
    consumed: int = 0  # wire bytes of the frames handed over


@dataclass(frozen=True)
class Over:
    """A connection that holds more than its peer may send."""

    fd: int
    peer: tuple[str, int]
    identity: bytes | None
    held: int
    limit: int


class HoldLedger:
    """Per accepted connection (by descriptor): what it was handed over, and the bound it is held
    to. ``allowance(identity)``: the most the peer of that routing id may have unread (None: a
    peer not seen yet); ``slack``: bytes besides, the handshake's."""

    def __init__(
        self, allowance: Callable[[bytes | None], int], slack: int, *, curve: bool
    ) -> None:
        self.allowance, self.slack, self.curve = allowance, slack, curve
        self._conns: dict[int, _Connection] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._conns)

    def accepted(self, fd: int, peer: tuple[str, int]) -> None:
        """A connection from ``peer`` on ``fd``. The socket monitor may tell of it after its first
        messages were handed over (they were recorded then): that record stays. Another peer on
        the same descriptor is a new connection, the earlier one gone."""
        with self._lock:
            conn = self._conns.get(fd)
            if conn is None or conn.peer != peer:
                self._conns[fd] = _Connection(peer)

    def knows(self, fd: int) -> bool:
        return fd in self._conns

    def closed(self, fd: int) -> None:
        with self._lock:
            self._conns.pop(fd, None)

    def delivered(self, fd: int, identity: bytes, sizes: list[int]) -> None:
        """A message handed over from ``fd``: its frames' sizes as sent (the routing id excluded)."""
        wire = sum(wire_bytes(n, self.curve) for n in sizes)
        with self._lock:
            conn = self._conns.get(fd)
            if conn is not None:
                conn.identity = identity
                conn.consumed += wire

    def fds(self) -> list[int]:
        with self._lock:
            return list(self._conns)

    def held(self, fd: int, received: int, unread: int) -> int | None:
        """What libzmq holds of ``fd``'s connection, given its kernel counts (bytes received, bytes
        not yet read); None for a connection not recorded."""
        with self._lock:
            conn = self._conns.get(fd)
            return None if conn is None else received - unread - conn.consumed

    def check(self, fd: int, received: int, unread: int) -> Over | None:
        """An ``Over`` when what libzmq holds of ``fd``'s connection is past its bound, else None
        (also for a connection no longer recorded)."""
        with self._lock:
            conn = self._conns.get(fd)
            if conn is None:
                return None
            held = received - unread - conn.consumed
            identity, peer = conn.identity, conn.peer
        limit = self.allowance(identity) + self.slack
        if held <= limit:
            return None
        return Over(fd, peer, identity, held, limit)
