"""ZeroMQ channels for the drivers: ROUTER on the learner, one DEALER per rollout-server session.

asyncio only (pyzmq's ``zmq.asyncio``): the learner and the rollout server run on asyncio because
vLLM does; the sans-IO core and drivers stay backend-neutral. High-water marks are unlimited because
flow control is the protocol's job (credits); ZeroMQ's own HWM would silently drop on a ROUTER.
Payload frames go out with ``copy=False`` so big trajectory columns and tensor slices are not
copied again (pyzmq still copies frames below its copy threshold, where that is cheaper).

CURVE (optional): the learner holds a secret key and an allow-list directory of client public
keys (ZAP authenticator); clients hold their own key pair and the learner's public key. Keys are
ZeroMQ certificate files made by ``bin/make-curve-keys``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from protocol.sender import Frames


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


def _tune(sock: zmq.Socket, max_message_bytes: int | None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if max_message_bytes:
        # Hard memory guard below the protocol's TOO_LARGE answer: ZeroMQ drops the peer's
        # connection for parts over this size, so they are never buffered.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + (1 << 20))


class ZmqServerChannel:
    """ROUTER socket bound at ``address`` (``tcp://HOST:PORT``, ``ipc://PATH``)."""

    def __init__(self, address: str, *, curve: CurveServerKeys | None = None,
                 max_message_bytes: int | None = None, context: zmq.asyncio.Context | None = None) -> None:
        self.ctx = context or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        _tune(self.sock, max_message_bytes)
        self._auth = None
        if curve is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            public, secret = _load(curve.secret_key_file, secret=True)
            if not Path(curve.allowed_keys_dir).is_dir():
                raise FileNotFoundError(f"CURVE allowed keys directory not found: {curve.allowed_keys_dir}")
            self._auth = AsyncioAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(curve.allowed_keys_dir))
            self.sock.curve_secretkey = secret
            self.sock.curve_publickey = public
            self.sock.curve_server = True
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def send(self, identity: bytes, frames: Frames) -> None:
        await self.sock.send_multipart([identity, *frames], copy=False)

    async def recv(self) -> tuple[bytes, Frames]:
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            if len(parts) >= 2:
                return parts[0].bytes, [p.buffer for p in parts[1:]]
            # an identity with no content cannot be answered meaningfully; skip it

    async def aclose(self) -> None:
        self.sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()


class ZmqClientChannel:
    """DEALER socket connected to the learner; one per session (see driver)."""

    def __init__(self, address: str, *, curve: CurveClientKeys | None = None,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.ctx = context or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        _tune(self.sock, None)
        if curve is not None:
            public, secret = _load(curve.secret_key_file, secret=True)
            server_public, _ = _load(curve.server_public_key_file, secret=False)
            self.sock.curve_secretkey = secret
            self.sock.curve_publickey = public
            self.sock.curve_serverkey = server_public
        self.sock.connect(address)

    async def send(self, frames: Frames) -> None:
        await self.sock.send_multipart(frames, copy=False)

    async def recv(self) -> Frames:
        parts = await self.sock.recv_multipart(copy=False)
        return [p.buffer for p in parts]

    async def aclose(self) -> None:
        self.sock.close(linger=200)  # let a final BYE leave; a dead learner costs at most 0.2 s


def client_factory(address: str, *, curve: CurveClientKeys | None = None):
    """``connect`` callable for ``RolloutClient``: a fresh DEALER per session."""

    async def connect() -> ZmqClientChannel:
        return ZmqClientChannel(address, curve=curve)

    return connect
