"""ZeroMQ channels for the drivers: ROUTER on the learner, one DEALER per rollout-server session.

asyncio only (pyzmq's ``zmq.asyncio``): the learner and the rollout server run on asyncio because
vLLM does; the sans-IO core and drivers stay backend-neutral. High-water marks are unlimited because
flow control is the protocol's job (credits); ZeroMQ's own HWM would silently drop on a ROUTER.
Payload frames go out with ``copy=False`` so big trajectory columns and tensor slices are not
copied again (pyzmq still copies frames below its copy threshold, where that is cheaper).

Receiving is bounded twice (SPEC §13): libzmq refuses any frame over ``MAXMSGSIZE`` (the largest
frame a valid message has) by dropping the connection before buffering it, and a message is read
frame by frame against the sending peer's ``MessageBudget`` (``protocol.budget``): past it, the
rest of the frames are read and let go at once, never kept, and the receiver gets a ``Truncated``
list that the codec answers with a typed ERROR. libzmq hands a message over only once all of it
has arrived, so the budget bounds what is kept and decoded, not what libzmq buffered meanwhile:
given an ``allowance``, a server bounds that per connection from outside libzmq, and cuts a
connection past it (``protocol.hold_ledger``, ``protocol.zmq_hold_watch``).
Where peers split frames at the channel's frame bound (SPEC §2), the budget counts the pieces and
the channel joins them as it reads them, one copy per split frame (``codec.Joined``).

That is why the learner authenticates peers in ZeroMQ's own handshake, before any message: a peer
refused there never gets one queued (SPEC §13). How (CURVE certificates, or the token's derived
CURVE keys, and the ZAP authenticator) is ``protocol.zmq_auth``. A refusal is reported to the
channel's ``on_refused(address, code, reason)``. Every server socket gives a peer
``HANDSHAKE_DEADLINE_MS`` to finish the handshake (libzmq's default is 30 s), and caps the
connections in it (``HandshakeGuard``), since what a peer still handshaking makes libzmq hold is
bounded only per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import struct
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import zmq
import zmq.asyncio

from protocol.budget import MessageBudget, MessageReader
from protocol.codec import Joined
from protocol.hold_ledger import HoldLedger
from protocol.sender import Frames
from protocol.zmq_auth import (
    CurveClientKeys,
    CurveServerKeys,
    Refused,
    drop_zap_domain,
    load_allow_list,
    load_key,
    require_curve,
    serve_token,
    use_token,
    zap_domain,
)
from protocol.zmq_hold_watch import HoldWatch, connection_to

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # as ``CodecLimits``: what a channel accepts unless told
FRAME_SLACK_BYTES = 1 << 20  # MAXMSGSIZE = the largest valid frame + this
# Where peers split frames at the bound: MAXMSGSIZE = the bound + this, for CURVE's MESSAGE envelope
# (33 bytes: libzmq checks the size of the frame on the wire, encrypted).
ENVELOPE_BYTES = 1 << 10
# frames of one message to a rollout server (a weights chunk: one per part)
CLIENT_MAX_FRAMES = 1 << 16
_DRAIN_YIELD_FRAMES = 4096  # while letting a long message go, give the event loop a turn this often
HANDSHAKE_DEADLINE_MS = 5000  # a server drops a peer that has not finished ZMTP's handshake by then
# Connections a server lets be in the handshake at once (SPEC §13): from one source address, and in
# all, the last HANDSHAKES_RESERVED of them only for a source's first. Each may make libzmq hold one
# frame bound (plus ~16 KiB of its own) until the deadline.
HANDSHAKES_PER_SOURCE = 64
HANDSHAKES_TOTAL = 768
HANDSHAKES_RESERVED = 128
# What the hold bound (protocol.hold_ledger) allows besides two frame bounds: the ZMTP greeting and
# the handshake's small commands, which stay counted as held.
HOLD_SLACK_BYTES = 16 << 10


def _tune(sock: zmq.Socket, max_frame_bytes: int | None, slack: int = FRAME_SLACK_BYTES) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_DEADLINE_MS)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if max_frame_bytes:
        # libzmq checks this against each frame's announced size, before allocating it, and drops
        # the connection over it: the only bound it puts on memory a peer makes us hold, also
        # before authentication. It is per frame, never per message (libzmq has no frame-count
        # limit), see SPEC §13. The slack lets a frame a little over the limit through to be
        # answered with a typed TOO_LARGE instead (only CURVE's envelope where peers split frames).
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + slack)


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (a server holds one
    descriptor per connection, also per connection still in the handshake); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class HandshakeGuard:
    """How many connections may be in ZMTP's handshake at once, per source address and in all.

    libzmq reports no per-connection end of the handshake, so a connection counts as handshaking
    for ``window_s`` after it was accepted (the handshake deadline: libzmq drops it by then) or
    until it closes. Over either cap, the newest connection is refused (the caller shuts it down).
    One source can take at most ``per_source``, and sources that already have one in the handshake
    at most ``total - reserved`` together: the first connection of any other source (a valid peer's
    host) still gets in while a few hosts flood. Pure: the caller passes the clock."""

    def __init__(self, per_source: int, total: int, window_s: float, reserved: int = 0) -> None:
        self.per_source, self.total, self.window_s = per_source, total, window_s
        self.reserved = reserved
        self._young: dict[int, tuple[str, float]] = {}  # fd -> (source, accepted at)
        self._order: deque[tuple[float, int]] = deque()  # (accepted at, fd), oldest first
        self._by_source: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._young)

    def admit(self, fd: int, source: str, now: float) -> bool:
        """A connection accepted on descriptor ``fd`` from ``source``: whether it may stay."""
        self._expire(now)
        self.closed(fd)  # a reused descriptor: its earlier connection is gone
        mine = self._by_source[source]
        room = self.total - (self.reserved if mine else 0)
        if mine >= self.per_source or len(self._young) >= room:
            return False
        self._young[fd] = (source, now)
        self._order.append((now, fd))
        self._by_source[source] += 1
        return True

    def closed(self, fd: int) -> None:
        entry = self._young.pop(fd, None)
        if entry is not None:
            self._by_source[entry[0]] -= 1
            if not self._by_source[entry[0]]:
                del self._by_source[entry[0]]

    def _expire(self, now: float) -> None:
        while self._order and now - self._order[0][0] >= self.window_s:
            at, fd = self._order.popleft()
            if (entry := self._young.get(fd)) is not None and entry[1] == at:
                self.closed(fd)


async def _read_rest(
    sync: zmq.Socket, more: bool, reader: MessageReader, sizes: list[int] | None = None
) -> list[Any]:
    """The rest of the message being read (``more``: its last frame read had the MORE flag), fed
    to ``reader``; its frames, or ``Truncated`` when over the budget. The rest of a message is in
    libzmq once its first frame is readable (delivery is atomic), so it is read without waiting,
    through ``sync`` (a blocking shadow of the asyncio socket). ``sizes`` gets each frame's size."""
    n = 0
    while more:
        frame = sync.recv(zmq.NOBLOCK, copy=False)
        more = frame.more
        if sizes is not None:
            sizes.append(len(frame))
        reader.add(frame.buffer)
        del frame  # a frame over the budget is released here, not when the message ends
        n += 1
        if reader.over and n % _DRAIN_YIELD_FRAMES == 0:
            await asyncio.sleep(0)
    return reader.result()


async def _read_joined(
    sync: zmq.Socket,
    more: bool,
    reader: MessageReader,
    piece_bytes: int,
    sizes: list[int] | None = None,
) -> list[Any]:
    """``_read_rest`` where peers split frames at ``piece_bytes`` (SPEC §2): the budget counts the
    pieces as they arrive, and a split frame's pieces, held as libzmq received them, are joined
    with one copy once its last, shorter piece is read. The frames come back as ``Joined``, so
    the codec does not walk them again; ``Truncated`` when over the budget."""
    joined = Joined()
    run: list[memoryview] = []
    n = 0
    while more:
        frame = sync.recv(zmq.NOBLOCK, copy=False)
        more, size = frame.more, len(frame)
        if sizes is not None:
            sizes.append(size)
        if reader.nframes < 2:  # the type frame and the header: what a refusal keeps
            reader.add(frame.buffer)
        else:
            reader.count(size)
        if reader.over:  # what was kept is let go at once, and nothing more is
            run.clear()
            joined.clear()
        elif size == piece_bytes:
            run.append(frame.buffer)
        elif run:
            run.append(frame.buffer)
            joined.append(b"".join(run))
            run = []
        else:
            joined.append(frame.buffer)
        del frame  # a frame over the budget is released here, not when the message ends
        n += 1
        if reader.over and n % _DRAIN_YIELD_FRAMES == 0:
            await asyncio.sleep(0)
    if reader.over:
        return reader.result()
    joined.unended = bool(run)
    return joined


def _bind(sock: zmq.Socket, address: str, *, wait_s: float = 0.5) -> None:
    """Bind, giving a just-closed socket of this process the moment libzmq needs to release the
    address (its listener closes asynchronously, in the reaper thread): a learner restarted in the
    same process rebinds at once. Anything else in use is reported after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                if e.errno == zmq.EADDRINUSE:
                    raise zmq.ZMQError(
                        e.errno, f"{address} is in use (another learner running?)"
                    ) from e
                raise
            time.sleep(0.01)  # bounded: at most wait_s, and only when the address is taken


def _ipc_file_identity(address: str) -> tuple[Path, int, int] | None:
    """(path, device, inode) of the socket file an ``ipc://`` bind created, to remove it on close."""
    if not address.startswith("ipc://") or address.startswith("ipc://@"):  # "@": abstract namespace
        return None
    path = Path(address.removeprefix("ipc://"))
    try:
        st = path.stat()
    except OSError:
        return None
    return path, st.st_dev, st.st_ino


def _remove_ipc_file(ident: tuple[Path, int, int] | None) -> None:
    # libzmq leaves the file behind. Only ours is removed: a successor that already bound the same
    # path (a restarted learner) has a new inode and keeps its file.
    if ident is None:
        return
    path, dev, ino = ident
    try:
        st = path.stat()
        if (st.st_dev, st.st_ino) == (dev, ino):
            path.unlink()
    except OSError:
        pass


_LOOPBACK_HOSTS = ("localhost", "[::1]", "::1", "lo")


def is_loopback(address: str) -> bool:
    """``address`` is reachable only from this machine: ipc/inproc, or tcp on a loopback interface."""
    if not address.startswith("tcp://"):
        return address.startswith(("ipc://", "inproc://"))
    host = address.removeprefix("tcp://").rsplit(":", 1)[0]
    host = host.split(";")[-1]  # "tcp://src;dst:port": the interface bound is the last one
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def exposure_warning(address: str, *, curve: bool, token: bool = False) -> str | None:
    """The warning to log for a learner bound at ``address`` with that authentication: only with
    none at all (anywhere: a local user is a peer too); certificates and a token are both CURVE."""
    if curve or token:
        return None
    return (
        "peers are not authenticated (transport.auth: none): any process that can reach "
        f"{address} may connect, and may pose as the learner to rollout servers while it is "
        "down"
    )


_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_PROTOCOL_ERRORS = {
    getattr(zmq, n): n.removeprefix("PROTOCOL_ERROR_")
    for n in dir(zmq)
    if n.startswith("PROTOCOL_ERROR_")
}


def _report(report: Refused | None, host: str, code: str, reason: str) -> None:
    if report is None:
        return
    try:
        report(host, code, reason)
    except Exception:  # a bad report must not end the watch
        logging.getLogger(__name__).exception("on_refused failed")


def _admit(
    guard: HandshakeGuard, fd: int, port: int, report: Refused | None
) -> tuple[str, int] | None:
    """Count the connection libzmq accepted on ``fd``; shut it down when over the guard's caps
    (libzmq then drops it, freeing what it buffered). Its peer's (address, port) when it stays."""
    with connection_to(fd, port) as found:
        if found is None:
            return None
        conn, peer = found
        if guard.admit(fd, peer[0], time.monotonic()):
            return peer
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
    _report(
        report,
        peer[0],
        "HANDSHAKE_FAILED",
        f"too many connections in the handshake (at most {guard.per_source} from one address, "
        f"{guard.total} in all, within {guard.window_s:g} s of connecting)",
    )
    return None


async def _watch(
    monitor: zmq.asyncio.Socket,
    report: Refused | None,
    guard: HandshakeGuard | None,
    port: int,
    ledger: HoldLedger | None = None,
) -> None:
    """Read the server socket's monitor: count accepted connections against ``guard`` (shutting
    down those over it) and record those that stay in ``ledger``, and report every handshake that
    failed before ZAP was asked (a peer without a token or key fails with MECHANISM_MISMATCH, one
    with another token's keys with CRYPTOGRAPHIC) as ``report(host, code, reason)``, like the
    authenticator."""
    while True:
        frames = await monitor.recv_multipart()
        if len(frames) != 2 or len(frames[0]) != 6:
            continue
        event, value = struct.unpack("=Hi", frames[0])
        if guard is not None:
            if event == zmq.EVENT_ACCEPTED:
                peer = _admit(guard, value, port, report)
                if peer is not None and ledger is not None:
                    ledger.accepted(value, peer)
                continue
            if event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                guard.closed(value)
                if ledger is not None:
                    ledger.closed(value)
                continue
        if not event & _HANDSHAKE_FAILURES:
            continue
        endpoint = frames[1].decode(errors="replace")
        host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0] if "://" in endpoint else endpoint
        code, reason = "HANDSHAKE_FAILED", "connection lost or not ZMTP"
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            error = _PROTOCOL_ERRORS.get(value & 0xFFFFFFFF, hex(value & 0xFFFFFFFF))
            if error == "ZMTP_MECHANISM_MISMATCH":
                code, reason = "NO_CREDENTIALS", "no token or key (security mechanism mismatch)"
            elif error == "ZMTP_CRYPTOGRAPHIC":
                # its HELLO was sealed for another server key: another token, or another learner
                code, reason = "BAD_CREDENTIALS", "a key for another server (a wrong token?)"
            else:
                reason = f"ZMTP protocol error {error}"
        _report(report, host, code, reason)


def _source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection a received frame came on (-1 if libzmq will not say)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError):  # ZMQ_SRCFD is deprecated: gone in some future libzmq
        return -1


def _peer_of(fd: int, port: int) -> tuple[str, int] | None:
    """The peer (address, port) of the connection to ``port`` on ``fd``; None if it is not one."""
    with connection_to(fd, port) as found:
        return None if found is None else found[1]


def _end_monitor(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Stop ``sock``'s monitor, then close its receiving end, in that order. libzmq sends each
    event from its I/O thread with a blocking send: once the receiving end is closed, the next
    event of a socket still monitored (a connection accepted or closed, the listener closing when
    the socket is) blocks that thread for good, and with it every connection of the context."""
    if not sock.closed:
        sock.disable_monitor()
    monitor.close(linger=0)


class ZmqServerChannel:
    """ROUTER socket bound at ``address`` (``tcp://HOST:PORT``, ``ipc://PATH``)."""

    def __init__(
        self,
        address: str,
        *,
        curve: CurveServerKeys | None = None,
        token: str | None = None,
        on_refused: Refused | None = None,
        max_message_bytes: int | None = None,
        max_frame_bytes: int | None = None,
        budget: Callable[[bytes], MessageBudget] | None = None,
        context: zmq.asyncio.Context | None = None,
        handshakes_per_source: int = HANDSHAKES_PER_SOURCE,
        handshakes_total: int = HANDSHAKES_TOTAL,
        handshakes_reserved: int = HANDSHAKES_RESERVED,
        peers_split: bool = True,
        allowance: Callable[[bytes | None], int] | None = None,
    ) -> None:
        """``curve`` or ``token``: only peers with an allowed key, or with the token's client key,
        get through ZeroMQ's handshake (``on_refused(address, code, reason)`` hears of the
        others), and clients can tell this server from an impostor; neither: anyone does.
        ``budget(identity)``: the budget of the next message from that peer (default: the same
        ``max_message_bytes`` for every peer). ``max_frame_bytes``: libzmq's per-frame bound,
        plus CURVE's envelope; default ``max_message_bytes`` plus 1 MiB of slack. With
        ``peers_split``, peers split larger frames into pieces of that size (SPEC §2), and
        ``recv`` joins them (``codec.Joined``). ``handshakes_per_source`` /
        ``handshakes_total`` / ``handshakes_reserved``: connections over these caps in the
        handshake (``HandshakeGuard``, tcp only) are shut down at once. ``allowance(identity)``:
        the most a peer may have sent that is not read yet (None: a peer not seen yet); a tcp
        connection that makes libzmq hold more, e.g. with an unfinished message of many frames, is
        cut (``protocol.hold_ledger``; default: no such bound)."""
        if curve is not None and token is not None:
            raise ValueError("a channel authenticates with CURVE or a token, not both")
        if token is not None and not token:
            raise ValueError("an empty token would let anyone in")
        keys = allowed = None
        max_message_bytes = max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
        default = MessageBudget(max_message_bytes, CLIENT_MAX_FRAMES)
        self.budget: Callable[[bytes], MessageBudget] = budget or (lambda identity: default)
        if curve is not None or token is not None:
            require_curve()
        if curve is not None:  # check the key files before any socket or thread exists
            keys = load_key(curve.secret_key_file, secret=True)
            if not Path(curve.allowed_keys_dir).is_dir():
                raise FileNotFoundError(
                    f"CURVE allowed keys directory not found: {curve.allowed_keys_dir}"
                )
            allowed = load_allow_list(Path(curve.allowed_keys_dir))
        self.ctx = context or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self._zap_domain: str | None = None
        self._watch_args: tuple[Refused | None, HandshakeGuard | None, int, HoldLedger | None] = (
            None,
            None,
            0,
            None,
        )
        self._monitor: zmq.asyncio.Socket | None = None
        self._watch: asyncio.Future[None] | None = None
        self._sync = zmq.Socket.shadow(self.sock.underlying)
        self._piece_bytes = (max_frame_bytes or 0) if peers_split else 0
        guard = None
        if address.startswith("tcp://"):
            guard = HandshakeGuard(
                handshakes_per_source,
                handshakes_total,
                HANDSHAKE_DEADLINE_MS / 1000,
                handshakes_reserved,
            )
        self.guard = guard
        frame_limit = (  # libzmq's MAXMSGSIZE
            min(max_frame_bytes, max_message_bytes) + ENVELOPE_BYTES
            if max_frame_bytes
            else max_message_bytes + FRAME_SLACK_BYTES
        )
        self.ledger: HoldLedger | None = None
        if guard is not None and allowance is not None:
            # the slack: what the handshake's frames (greeting, HELLO, INITIATE) leave counted
            self.ledger = HoldLedger(
                allowance,
                2 * frame_limit + HOLD_SLACK_BYTES,
                curve=curve is not None or bool(token),
            )
        self._hold: HoldWatch | None = None
        try:
            _tune(self.sock, frame_limit, slack=0)
            if keys is not None and allowed is not None:
                self._zap_domain = zap_domain(self.ctx, curve_keys=allowed, on_refused=on_refused)
                self.sock.zap_domain = self._zap_domain.encode()
                self.sock.curve_publickey, self.sock.curve_secretkey = keys
                self.sock.curve_server = True
            elif token is not None:
                allowed = serve_token(self.sock, token)
                self._zap_domain = zap_domain(self.ctx, curve_keys=allowed, on_refused=on_refused)
                self.sock.zap_domain = self._zap_domain.encode()
            events = 0
            if on_refused is not None and self._zap_domain is not None:
                # ZAP hears of wrong keys and tokens; a peer with none at all (or not speaking
                # ZMTP) fails before ZAP is asked, and only the socket monitor sees it.
                events |= _HANDSHAKE_FAILURES
            if guard is not None:
                events |= zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
            if events:  # before the bind, so that no connection goes unseen
                # A unique endpoint: pyzmq's default names it after the socket's descriptor number,
                # which a socket closed just before (its endpoint released later, by libzmq's
                # reaper) may have had.
                monitor = self.sock.get_monitor_socket(
                    events, f"inproc://monitor.{uuid.uuid4().hex}"
                )
                self._monitor = cast(zmq.asyncio.Socket, monitor)
            _bind(self.sock, address)
            self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
            port = int(self.address.rsplit(":", 1)[1]) if guard is not None else 0
            self._watch_args = (
                on_refused if self._zap_domain is not None else None,
                guard,
                port,
                self.ledger,
            )
            if self.ledger is not None:
                self._hold = HoldWatch(self.ledger, port, lambda *a: _report(on_refused, *a))
            with contextlib.suppress(RuntimeError):  # no loop running yet: the first recv starts it
                asyncio.get_running_loop()
                self._start_watch()
        except BaseException:  # e.g. address in use: leave no socket or allow-list behind
            self._release()
            raise
        self.token = token  # the token clients' keys derive from (None: no token auth)
        self._ipc_file = _ipc_file_identity(self.address)

    def _start_watch(self) -> None:
        if self._hold is not None:
            self._hold.start(asyncio.get_running_loop())
        if self._watch is None and self._monitor is not None:
            sock, monitor = self.sock, self._monitor
            self._watch = asyncio.ensure_future(_watch(monitor, *self._watch_args))
            # Ended in the loop that polls it, also when that loop ends with the channel left open
            # (the task cancelled, maybe before it ever ran): collected later under another loop,
            # it would unregister whatever socket then has its descriptor number there. The
            # callback holds the socket, so a channel dropped unclosed cannot have it closed (by
            # the collector) while its monitor still sends.
            self._watch.add_done_callback(lambda _: _end_monitor(sock, monitor))

    def __del__(self) -> None:
        # Dropped unclosed before its watch started: the collector would close the socket and the
        # monitor's receiving end in either order (see _end_monitor). Once started, the watch's
        # own callback ends the monitor.
        monitor = getattr(self, "_monitor", None)  # None too when __init__ failed early
        if monitor is not None and self._watch is None:
            with contextlib.suppress(zmq.ZMQError):  # its context already terminated
                _end_monitor(self.sock, monitor)
            self._monitor = None
        # The hold watch's thread holds no reference to the channel, so it would poll on.
        if (hold := getattr(self, "_hold", None)) is not None:
            hold.stop()

    async def send(self, identity: bytes, frames: Frames) -> None:
        await self.sock.send_multipart([identity, *frames], copy=False)

    async def recv(self) -> tuple[bytes, Frames]:
        self._start_watch()
        while True:
            # the routing id: the peer is known before its frames
            first = await self.sock.recv(copy=False)
            identity = first.bytes
            reader = MessageReader(self.budget(identity))
            sizes: list[int] | None = [] if self.ledger is not None else None
            if self._piece_bytes:
                frames = await _read_joined(
                    self._sync, first.more, reader, self._piece_bytes, sizes
                )
            else:
                frames = await _read_rest(self._sync, first.more, reader, sizes)
            if self.ledger is not None and sizes is not None:
                self._delivered(_source_fd(first), identity, sizes)
            if frames:
                return identity, frames
            # an identity with no content cannot be answered meaningfully; skip it

    def _delivered(self, fd: int, identity: bytes, sizes: list[int]) -> None:
        assert self.ledger is not None
        if not self.ledger.knows(fd):  # its monitor event not read yet: record it now
            if (peer := _peer_of(fd, self._watch_args[2])) is None:
                return
            self.ledger.accepted(fd, peer)
        self.ledger.delivered(fd, identity, sizes)

    async def aclose(self) -> None:
        # A short linger lets the last ACKs and the BYE of LearnerServer.close() leave; a peer that is
        # gone costs at most 0.2 s (at context termination), as on the client side.
        watch = self._watch
        self._release(linger=200)
        _remove_ipc_file(self._ipc_file)
        if watch is not None:  # cancelled by _release: no task of the channel outlives it
            await asyncio.wait([watch])

    def close(self) -> None:
        """Close at once, without the linger of ``aclose`` (a channel that never served)."""
        self._release()
        _remove_ipc_file(self._ipc_file)

    def _release(self, linger: int = 0) -> None:
        if self._hold is not None:
            self._hold.stop()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._monitor is not None:
            _end_monitor(self.sock, self._monitor)
            self._monitor = None
        self.sock.close(linger=linger)
        if self._zap_domain is not None:
            drop_zap_domain(self.ctx, self._zap_domain)
            self._zap_domain = None


class ZmqClientChannel:
    """DEALER socket connected to the learner; one per session (see driver)."""

    def __init__(
        self,
        address: str,
        *,
        curve: CurveClientKeys | None = None,
        token: str | None = None,
        max_message_bytes: int | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        keys = None
        if curve is not None and token is not None:
            raise ValueError("a channel authenticates with CURVE or a token, not both")
        if curve is not None:  # check the key files before the socket exists
            public, secret = load_key(curve.secret_key_file, secret=True)
            server_public, _ = load_key(curve.server_public_key_file, secret=False)
            keys = (public, secret, server_public)
        max_message_bytes = max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
        self.budget = MessageBudget(max_message_bytes, CLIENT_MAX_FRAMES)
        self.ctx = context or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self._sync = zmq.Socket.shadow(self.sock.underlying)
        _tune(self.sock, max_message_bytes)
        if keys is not None:
            public, secret, server_public = keys
            self.sock.curve_secretkey = secret
            self.sock.curve_publickey = public
            self.sock.curve_serverkey = server_public
        elif token is not None:
            use_token(self.sock, token)
        try:
            self.sock.connect(address)
        except BaseException:  # a malformed address: do not leak the socket
            self.sock.close(linger=0)
            raise

    async def send(self, frames: Frames) -> None:
        await self.sock.send_multipart(frames, copy=False)

    async def recv(self) -> Frames:
        first = await self.sock.recv(copy=False)
        reader = MessageReader(self.budget)
        reader.add(first.buffer)
        return await _read_rest(self._sync, first.more, reader)

    async def aclose(self) -> None:
        self.sock.close(linger=200)  # let a final BYE leave; a dead learner costs at most 0.2 s


def client_factory(
    address: str,
    *,
    curve: CurveClientKeys | None = None,
    token: str | Callable[[], Awaitable[str]] | None = None,
    max_message_bytes: int | None = None,
):
    """``connect`` callable for ``RolloutClient``: a fresh DEALER per session. ``token``: the
    learner's token, or an async callable giving it at each connection (a token file re-read, so a
    learner restarted with a new token is followed)."""

    async def connect() -> ZmqClientChannel:
        tok = token if token is None or isinstance(token, str) else await token()
        return ZmqClientChannel(
            address, curve=curve, token=tok, max_message_bytes=max_message_bytes
        )

    return connect
