"""ZeroMQ's authentication for the channels (SPEC §13): CURVE certificates, the token's derived
CURVE key pairs, and the ZAP authenticator that decides which client keys get in.

Both ways are CURVE, so both ends authenticate each other and traffic is encrypted:
- certificates: the learner holds a secret key and an allow-list directory of client public keys;
  clients hold their own key pair and the learner's public key (ZeroMQ certificate files made by
  ``bin/make-curve-keys``).
- a shared token (the default): both key pairs are derived from the run's token (``token_keys``),
  the server's and the clients' under different labels. A server allows only the derived client
  key, a client pins the derived server key. The token never crosses the wire.
libzmq allows one ZAP handler per context and the default context is shared, so the server
channels of one context share one authenticator, each under its own ZAP domain with its own
allow-list (``zap_domain``, ``drop_zap_domain``); a refusal is reported to the domain's
``on_refused(address, code, reason)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85


@dataclass(frozen=True)
class CurveServerKeys:
    secret_key_file: Path  # the learner's certificate (with secret key)
    allowed_keys_dir: Path  # public certificates of the rollout servers allowed in


@dataclass(frozen=True)
class CurveClientKeys:
    secret_key_file: Path  # this rollout server's certificate (with secret key)
    server_public_key_file: Path  # the learner's public certificate


def load_key(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if not Path(path).is_file():
        raise FileNotFoundError(f"CURVE key file not found: {path}")
    public, secret_key = zmq.auth.load_certificate(str(path))
    if secret and not secret_key:
        raise ValueError(f"CURVE key file {path} holds no secret key (use the .key_secret file)")
    return public, secret_key


ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP RFC (27): one authenticator per context

# The labels token keys are derived under (SPEC §13): changing one is a wire change.
TOKEN_SERVER_LABEL = b"agentrl token-curve server v1"
TOKEN_CLIENT_LABEL = b"agentrl token-curve client v1"


@dataclass(frozen=True)
class TokenKeys:
    """The CURVE key pairs of token auth, all Z85-encoded (40 bytes each)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def require_curve() -> None:
    """Raise with what to do when this libzmq was built without CURVE (every auth mode but
    ``none`` needs it)."""
    if not zmq.has("curve"):
        raise RuntimeError(
            f"libzmq {zmq.zmq_version()} was built without CURVE (libsodium), which "
            "transport.auth token and curve need: install pyzmq's wheel (it bundles a libzmq with "
            "CURVE) or a libzmq built with libsodium; transport.auth none works without it"
        )


def _derived_keypair(token: str, label: bytes) -> tuple[bytes, bytes]:
    # Any 32 bytes are a Curve25519 secret key (the scalar is clamped when used).
    secret = z85.encode(hmac.new(token.encode(), label, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def token_keys(token: str) -> TokenKeys:
    """The key pairs of ``token``: the server's (learners, relays) and the one every client of
    the run shares, each ``HMAC-SHA256(token as ASCII, label)`` as the secret key (SPEC §13)."""
    if not token:
        raise ValueError("an empty token would let anyone in")
    require_curve()
    server_public, server_secret = _derived_keypair(token, TOKEN_SERVER_LABEL)
    client_public, client_secret = _derived_keypair(token, TOKEN_CLIENT_LABEL)
    return TokenKeys(server_public, server_secret, client_public, client_secret)


Refused = Callable[[str, str, str], None]
"""``on_refused(peer address, code, reason)``; code: BAD_CREDENTIALS (a wrong token or key: a client
key refused by ZAP, or a HELLO sealed for another server key), NO_CREDENTIALS (none: a security mechanism mismatch) or HANDSHAKE_FAILED (anything else)."""


def _authenticator(ctx: zmq.Context) -> Any:
    """pyzmq's asyncio ZAP authenticator, made to report refusals per domain."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    class Authenticator(AsyncioAuthenticator):
        def __init__(self, context: zmq.Context) -> None:
            super().__init__(context)
            self.loop = asyncio.get_running_loop()  # where its task answers every handshake
            self.on_refused: dict[str, Refused] = {}
            self._request: tuple[str, str] = ("", "")  # (domain, address) being answered

        def stop(self) -> None:
            # Closing a socket frees its inproc endpoint only later, in libzmq's reaper thread: a
            # successor started right after would fail to bind ZAP's fixed endpoint (EADDRINUSE).
            # Unbinding first frees it now.
            if self.zap_socket is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self.zap_socket.unbind(ZAP_ENDPOINT)
            try:
                super().stop()
            except RuntimeError:  # cancelling the task of a closed loop; close what is left
                if self.zap_socket is not None:
                    self.zap_socket.close(linger=0)
                    # pyzmq types it as a Socket, yet its own stop() leaves None there too
                    self.zap_socket = None  # pyright: ignore[reportAttributeAccessIssue]

        async def handle_zap_message(self, msg: list[bytes]) -> None:
            # Requests are handled one at a time by one task: the pair stays the request's own.
            if len(msg) >= 4:
                self._request = (msg[2].decode(errors="replace"), msg[3].decode(errors="replace"))
            await super().handle_zap_message(msg)

        def _send_zap_reply(
            self,
            request_id: bytes,
            status_code: bytes,
            status_text: bytes,
            user_id: str = "anonymous",
        ) -> None:
            super()._send_zap_reply(request_id, status_code, status_text, user_id)
            domain, address = self._request
            if status_code != b"200" and (report := self.on_refused.get(domain)) is not None:
                try:
                    report(address, "BAD_CREDENTIALS", status_text.decode(errors="replace"))
                except Exception:  # the task answering every handshake must outlive a bad report
                    self.log.exception("on_refused failed")

    return Authenticator(ctx)


# id(context) -> (context, authenticator, ZAP domains using it); the context is held so ids stay unique
_zap: dict[int, tuple[zmq.Context, Any, set[str]]] = {}


def load_allow_list(allowed_keys_dir: Path) -> dict[bytes, Any]:
    import zmq.auth

    try:
        keys = zmq.auth.load_certificates(str(allowed_keys_dir))
    except Exception as e:  # pyzmq's authenticator would only log this and then deny everyone
        raise ValueError(f"CURVE allowed keys directory {allowed_keys_dir}: {e}") from e
    if not keys:
        raise ValueError(
            f"CURVE allowed keys directory {allowed_keys_dir} holds no public keys (*.key): "
            "no rollout server could connect"
        )
    return keys


def zap_domain(
    ctx: zmq.Context,
    *,
    curve_keys: dict[bytes, Any],
    on_refused: Refused | None = None,
) -> str:
    """Register an allow-list (Z85 public keys) with the context's authenticator (started on first
    use); its domain."""
    entry = _zap.get(id(ctx))
    if entry is not None and (entry[1].loop.is_closed() or not entry[1].loop.is_running()):
        # Its event loop is gone (a channel of an earlier asyncio.run was never closed): its task
        # would never answer, and every handshake would hang. A new one takes over its domains.
        old, entry = entry[1], None
        old.stop()
    if entry is None:
        auth = _authenticator(ctx)
        auth.start()
        previous = _zap.get(id(ctx))
        entry = _zap[id(ctx)] = (ctx, auth, previous[2] if previous else set())
        if previous is not None:
            auth.certs.update(previous[1].certs)
            auth.on_refused.update(previous[1].on_refused)
    auth = entry[1]
    domain = f"learner-{uuid.uuid4().hex}"
    auth.certs[domain] = curve_keys  # what configure_curve(domain, dir) stores, minus a re-read
    if on_refused is not None:
        auth.on_refused[domain] = on_refused
    entry[2].add(domain)
    return domain


def drop_zap_domain(ctx: zmq.Context, domain: str) -> None:
    entry = _zap.get(id(ctx))
    if entry is None or domain not in entry[2]:
        return
    _, auth, domains = entry
    domains.discard(domain)
    auth.certs.pop(domain, None)
    auth.on_refused.pop(domain, None)
    if not domains:
        del _zap[id(ctx)]
        auth.stop()


def use_token(sock: zmq.Socket, token: str) -> None:
    """Make a client socket (before its ``connect``) a CURVE client of ``token``: its key pair is
    the token's client pair, and it talks only to a server holding the token's server secret. What
    raw-socket tools and tests use instead of ``ZmqClientChannel``."""
    keys = token_keys(token)
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


def serve_token(sock: zmq.Socket, token: str) -> dict[bytes, Any]:
    """Make a socket (before its ``bind``) a CURVE server holding ``token``'s server key pair; the
    allow-list its ZAP domain needs (the token's client key)."""
    keys = token_keys(token)
    sock.curve_publickey, sock.curve_secretkey = keys.server_public, keys.server_secret
    sock.curve_server = True
    return {keys.client_public: True}
