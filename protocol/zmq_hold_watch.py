"""The thread that cuts a connection holding more than its peer may send (``protocol.hold_ledger``).

Every ``interval_s`` it reads each recorded connection's kernel counts: ``TCP_INFO``'s bytes
received and ``FIONREAD``'s bytes not yet read (Linux). A connection over its bound is shut down
(``shutdown(SHUT_RDWR)`` on a duplicate of its descriptor): libzmq then drops it and frees every
frame it held of it, as for a connection over the handshake caps. A thread, not a task of the
channel's event loop: the loop may be busy decoding a batch for tens of milliseconds, while a peer
on loopback sends a gigabyte a second; Python's switch interval gives the thread its turn within
a few milliseconds. The descriptor numbers come from the socket monitor, so one may by now name
another socket: only a connection to this listener from the recorded peer is ever cut, and a
reading that fails is skipped. Refusals are reported on the channel's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import struct
import termios
import threading
from collections.abc import Callable, Iterator

from protocol.hold_ledger import HoldLedger, Over

Report = Callable[[str, str, str], None]
INTERVAL_S = 0.01
_TCP_INFO_BYTES = 136  # struct tcp_info up to tcpi_bytes_received (Linux 4.1+)
_BYTES_RECEIVED_AT = 128


def tcp_counts(fd: int) -> tuple[int, int]:
    """(bytes received, bytes not yet read) of the TCP connection on ``fd``; OSError when it is not
    one (any more), ValueError when the kernel's ``tcp_info`` is too old to count bytes."""
    sock = socket.socket(fileno=fd)
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    finally:
        sock.detach()  # the descriptor stays libzmq's
    if len(info) < _TCP_INFO_BYTES:
        raise ValueError("this kernel's tcp_info has no byte counts")
    unread = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, unread)
    return struct.unpack_from("Q", info, _BYTES_RECEIVED_AT)[0], struct.unpack("i", unread)[0]


@contextlib.contextmanager
def connection_to(fd: int, port: int) -> Iterator[tuple[socket.socket, tuple[str, int]] | None]:
    """A duplicate of ``fd`` and its peer's (address, port), if ``fd`` still is a TCP connection to
    this listener's ``port`` (a number from the socket monitor may name another descriptor by
    now); else None. The duplicate is closed on exit."""
    try:
        conn = socket.socket(fileno=os.dup(fd))
    except OSError:  # already closed
        yield None
        return
    with conn:
        try:
            if conn.type != socket.SOCK_STREAM or conn.getsockname()[1] != port:
                peer = None
            else:
                address = conn.getpeername()
                peer = (str(address[0]), int(address[1]))
        except OSError:
            peer = None
        yield None if peer is None else (conn, peer)


def cut(fd: int, port: int, peer: tuple[str, int]) -> bool:
    """Shut down the connection on ``fd`` if it still is the one from ``peer`` to ``port``."""
    with connection_to(fd, port) as found:
        if found is None or found[1] != peer:
            return False
        try:
            found[0].shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


class HoldWatch:
    """Owns the watch thread of one server channel: ``start`` with the channel's loop, ``stop``
    joins it."""

    def __init__(
        self, ledger: HoldLedger, port: int, report: Report | None, interval_s: float = INTERVAL_S
    ) -> None:
        self.ledger, self.port, self.report, self.interval_s = ledger, port, report, interval_s
        self.cuts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._thread is None:
            self._loop = loop
            self._thread = threading.Thread(target=self._run, name="zmq-hold-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep()
            except Exception:  # the bound must outlive a bad allowance or report
                logging.getLogger(__name__).exception("hold watch sweep failed")

    def sweep(self) -> list[Over]:
        """One pass over the recorded connections; those cut."""
        cuts = []
        for fd in self.ledger.fds():
            try:
                received, unread = tcp_counts(fd)
            except (OSError, ValueError):
                continue
            over = self.ledger.check(fd, received, unread)
            if over is None:
                continue
            # Forgotten either way: cut, or (not cut) the number names another connection by now.
            self.ledger.closed(fd)
            if cut(fd, self.port, over.peer):
                self.cuts += 1
                cuts.append(over)
                self._report(over)
        return cuts

    def _report(self, over: Over) -> None:
        if self.report is None or self._loop is None:
            return
        reason = (
            f"held {over.held} bytes of messages not yet read, over the {over.limit} its credits "
            "allow (a message of too many frames?): connection cut"
        )
        with contextlib.suppress(RuntimeError):  # the loop already closed
            self._loop.call_soon_threadsafe(self.report, over.peer[0], "TOO_LARGE", reason)
