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
has arrived, so the budget bounds what is kept and decoded, not what libzmq buffered meanwhile.

CURVE (optional): the learner holds a secret key and an allow-list directory of client public
keys (ZAP authenticator); clients hold their own key pair and the learner's public key. Keys are
ZeroMQ certificate files made by ``bin/make-curve-keys``. libzmq allows one ZAP handler per context
and the default context is shared, so CURVE server channels of one context share one authenticator,
each under its own ZAP domain with its own allow-list (two learners, or a restarted one, can coexist).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from protocol.budget import MessageBudget, MessageReader
from protocol.sender import Frames

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # as ``CodecLimits``: what a channel accepts unless told
FRAME_SLACK_BYTES = 1 << 20  # MAXMSGSIZE = the largest valid frame + this
CLIENT_MAX_FRAMES = (
    1 << 16
)  # frames of one message to a rollout server (a weights chunk: one per part)
_DRAIN_YIELD_FRAMES = 4096  # while letting a long message go, give the event loop a turn this often


@dataclass(frozen=True)
class CurveServerKeys:
    secret_key_file: Path  # the learner's certificate (with secret key)
    allowed_keys_dir: Path  # public certificates of the rollout servers allowed in


@dataclass(frozen=True)
class CurveClientKeys:
    secret_key_file: Path  # this rollout server's certificate (with secret key)
    server_public_key_file: Path  # the learner's public certificate


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if not Path(path).is_file():
        raise FileNotFoundError(f"CURVE key file not found: {path}")
    public, secret_key = zmq.auth.load_certificate(str(path))
    if secret and not secret_key:
        raise ValueError(f"CURVE key file {path} holds no secret key (use the .key_secret file)")
    return public, secret_key


# id(context) -> (context, authenticator, ZAP domains using it); the context is held so ids stay unique
_zap: dict[int, tuple[zmq.Context, Any, set[str]]] = {}


def _allow_list(ctx: zmq.Context, allowed_keys_dir: Path) -> str:
    """Register an allow-list with the context's authenticator (started on first use); its domain."""
    import zmq.auth
    from zmq.auth.asyncio import AsyncioAuthenticator

    try:
        keys = zmq.auth.load_certificates(str(allowed_keys_dir))
    except Exception as e:  # pyzmq's authenticator would only log this and then deny everyone
        raise ValueError(f"CURVE allowed keys directory {allowed_keys_dir}: {e}") from e
    if not keys:
        raise ValueError(
            f"CURVE allowed keys directory {allowed_keys_dir} holds no public keys (*.key): "
            "no rollout server could connect"
        )
    entry = _zap.get(id(ctx))
    if entry is None:
        auth = AsyncioAuthenticator(ctx)
        auth.start()
        entry = _zap[id(ctx)] = (ctx, auth, set())
    domain = f"learner-{uuid.uuid4().hex}"
    entry[1].certs[domain] = keys  # what configure_curve(domain, dir) stores, minus its re-read
    entry[2].add(domain)
    return domain


def _drop_allow_list(ctx: zmq.Context, domain: str) -> None:
    entry = _zap.get(id(ctx))
    if entry is None or domain not in entry[2]:
        return
    _, auth, domains = entry
    domains.discard(domain)
    auth.certs.pop(domain, None)
    if not domains:
        del _zap[id(ctx)]
        auth.stop()


def _tune(sock: zmq.Socket, max_frame_bytes: int | None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if max_frame_bytes:
        # libzmq checks this against each frame's announced size, before allocating it, and drops
        # the connection over it: the only bound it puts on memory a peer makes us hold. It is per
        # frame, never per message (libzmq has no frame-count limit), see SPEC §13. The slack lets a
        # frame a little over the limit through to be answered with a typed TOO_LARGE instead.
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + FRAME_SLACK_BYTES)


async def _read_rest(sync: zmq.Socket, more: bool, reader: MessageReader) -> list[Any]:
    """The rest of the message being read (``more``: its last frame read had the MORE flag), fed
    to ``reader``; its frames, or ``Truncated`` when over the budget. The rest of a message is in
    libzmq once its first frame is readable (delivery is atomic), so it is read without waiting,
    through ``sync`` (a blocking shadow of the asyncio socket)."""
    n = 0
    while more:
        frame = sync.recv(zmq.NOBLOCK, copy=False)
        more = frame.more
        reader.add(frame.buffer)
        del frame  # a frame over the budget is released here, not when the message ends
        n += 1
        if reader.over and n % _DRAIN_YIELD_FRAMES == 0:
            await asyncio.sleep(0)
    return reader.result()


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


def exposure_warning(address: str, *, curve: bool) -> str | None:
    """The warning to log when ``address`` is bound without CURVE and reachable from other hosts."""
    if curve or is_loopback(address):
        return None
    return (
        "binding a non-loopback address without CURVE: any host that can reach it may connect "
        "unauthenticated, and libzmq buffers a whole message before it can be refused (SPEC §13)"
    )


class ZmqServerChannel:
    """ROUTER socket bound at ``address`` (``tcp://HOST:PORT``, ``ipc://PATH``)."""

    def __init__(
        self,
        address: str,
        *,
        curve: CurveServerKeys | None = None,
        max_message_bytes: int | None = None,
        max_frame_bytes: int | None = None,
        budget: Callable[[bytes], MessageBudget] | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        """``budget(identity)``: the budget of the next message from that peer (default: the same
        ``max_message_bytes`` for every peer); ``max_frame_bytes``: libzmq's per-frame bound
        (default ``max_message_bytes``)."""
        keys = None
        max_message_bytes = max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
        default = MessageBudget(max_message_bytes, CLIENT_MAX_FRAMES)
        self.budget: Callable[[bytes], MessageBudget] = budget or (lambda identity: default)
        if curve is not None:  # check the key files before any socket or thread exists
            keys = _load(curve.secret_key_file, secret=True)
            if not Path(curve.allowed_keys_dir).is_dir():
                raise FileNotFoundError(
                    f"CURVE allowed keys directory not found: {curve.allowed_keys_dir}"
                )
        self.ctx = context or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self._zap_domain: str | None = None
        self._sync = zmq.Socket.shadow(self.sock.underlying)
        try:
            _tune(self.sock, min(max_frame_bytes or max_message_bytes, max_message_bytes))
            if curve is not None and keys is not None:
                self._zap_domain = _allow_list(self.ctx, Path(curve.allowed_keys_dir))
                self.sock.zap_domain = self._zap_domain.encode()
                self.sock.curve_publickey, self.sock.curve_secretkey = keys
                self.sock.curve_server = True
            _bind(self.sock, address)
        except BaseException:  # e.g. address in use: leave no socket or allow-list behind
            self._release()
            raise
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc_file = _ipc_file_identity(self.address)

    async def send(self, identity: bytes, frames: Frames) -> None:
        await self.sock.send_multipart([identity, *frames], copy=False)

    async def recv(self) -> tuple[bytes, Frames]:
        while True:
            first = await self.sock.recv(
                copy=False
            )  # the routing id: the peer is known before its frames
            identity = first.bytes
            frames = await _read_rest(self._sync, first.more, MessageReader(self.budget(identity)))
            if frames:
                return identity, frames
            # an identity with no content cannot be answered meaningfully; skip it

    async def aclose(self) -> None:
        # A short linger lets the last ACKs and the BYE of LearnerServer.close() leave; a peer that is
        # gone costs at most 0.2 s (at context termination), as on the client side.
        self._release(linger=200)
        _remove_ipc_file(self._ipc_file)

    def _release(self, linger: int = 0) -> None:
        self.sock.close(linger=linger)
        if self._zap_domain is not None:
            _drop_allow_list(self.ctx, self._zap_domain)
            self._zap_domain = None


class ZmqClientChannel:
    """DEALER socket connected to the learner; one per session (see driver)."""

    def __init__(
        self,
        address: str,
        *,
        curve: CurveClientKeys | None = None,
        max_message_bytes: int | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        keys = None
        if curve is not None:  # check the key files before the socket exists
            public, secret = _load(curve.secret_key_file, secret=True)
            server_public, _ = _load(curve.server_public_key_file, secret=False)
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
    address: str, *, curve: CurveClientKeys | None = None, max_message_bytes: int | None = None
):
    """``connect`` callable for ``RolloutClient``: a fresh DEALER per session."""

    async def connect() -> ZmqClientChannel:
        return ZmqClientChannel(address, curve=curve, max_message_bytes=max_message_bytes)

    return connect
