"""Mutual authentication between rollout servers and a tool server, with no secret on the wire.

Design (sans-IO: bytes and clocks in, headers and verdicts out). Both sides hold
``tool_server.token``. A client signs every request: ``X-Tool-Auth: v1 <unix time> <nonce>
<mac>``, the MAC an HMAC-SHA256 under the token of the method, the path, the time, the nonce and
the SHA-256 of the body, which travels as ``X-Tool-Body-SHA256``. The server checks the MAC before
it reads the body (a client without the token costs it one header), then the body against its
digest. It refuses a time more than ``window_s`` away from its clock and a nonce it has seen, so a
recorded request cannot be played again; the nonces it remembers are bounded (``max_nonces``):
past that it forgets the oldest and refuses anything not newer than the newest it forgot.

The server proves itself in turn: every answer to a signed request carries ``X-Tool-Server-Auth:
v1 <mac>``, an HMAC under the token of the request's nonce, the status and the SHA-256 of the
answer's body. A client accepts nothing, schemas or tool output, from an answer without the right
one: a listener that took the tool server's address while it was down learns no token and cannot
put its own text into an episode.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

REQUEST_HEADER = "x-tool-auth"
BODY_HEADER = "x-tool-body-sha256"
RESPONSE_HEADER = "x-tool-server-auth"
VERSION = "v1"
WINDOW_S = 120.0
MAX_NONCES = 1 << 18


def _mac(token: bytes, *parts: str) -> str:
    return hmac.new(token, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True)
class Signed:
    """A signed request's headers, and the nonce its answer must be signed over."""

    headers: dict[str, str]
    nonce: str


def sign_request(
    token: str, method: str, path: str, body: bytes = b"", now: float | None = None
) -> Signed:
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    digest = body_digest(body)
    mac = _mac(token.encode(), "request", method.upper(), path, ts, nonce, digest)
    return Signed({REQUEST_HEADER: f"{VERSION} {ts} {nonce} {mac}", BODY_HEADER: digest}, nonce)


def sign_response(token: str, nonce: str, status: int, body: bytes) -> str:
    return f"{VERSION} {_mac(token.encode(), 'response', nonce, str(status), body_digest(body))}"


def response_is_genuine(
    token: str, nonce: str, status: int, body: bytes, headers: Mapping[str, str]
) -> bool:
    given = headers.get(RESPONSE_HEADER, "")
    return hmac.compare_digest(given.encode(), sign_response(token, nonce, status, body).encode())


class RequestVerifier:
    """The server's side: ``check`` a request's headers, then ``body_matches`` its body."""

    def __init__(self, token: str, *, window_s: float = WINDOW_S, max_nonces: int = MAX_NONCES):
        self._token = token.encode()
        self.window_s, self.max_nonces = window_s, max_nonces
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> its time, oldest first
        self._floor = -math.inf  # requests at or before this time are refused: nonces forgotten

    def check(
        self, method: str, path: str, headers: Mapping[str, str], now: float | None = None
    ) -> tuple[str | None, str]:
        """``(nonce, "")`` for a genuine, fresh request; ``(None, what is wrong)`` otherwise."""
        now = time.time() if now is None else now
        fields = headers.get(REQUEST_HEADER, "").split(" ")
        if fields == [""]:
            return None, f"no {REQUEST_HEADER} header (a client without tool_server.token?)"
        if len(fields) != 4 or fields[0] != VERSION:
            return None, f"malformed {REQUEST_HEADER} header (want '{VERSION} TIME NONCE MAC')"
        _, ts, nonce, mac = fields
        digest = headers.get(BODY_HEADER, "")
        want = _mac(self._token, "request", method.upper(), path, ts, nonce, digest)
        if not hmac.compare_digest(mac.encode(), want.encode()):
            return None, "wrong MAC (another tool_server.token?)"
        try:
            sent = float(ts)
        except ValueError:
            return None, f"malformed time {ts[:32]!r}"
        if abs(now - sent) > self.window_s:
            return (
                None,
                f"signed {now - sent:+.0f} s from this server's clock (at most {self.window_s:g})",
            )
        if nonce in self._nonces or sent <= self._floor:
            return None, "a request seen before (replayed)"
        self._remember(nonce, sent, now)
        return nonce, ""

    def body_matches(self, headers: Mapping[str, str], body: bytes) -> bool:
        return hmac.compare_digest(
            headers.get(BODY_HEADER, "").encode(), body_digest(body).encode()
        )

    def _remember(self, nonce: str, sent: float, now: float) -> None:
        self._nonces[nonce] = sent
        while self._nonces:  # forget what the time window refuses anyway, and past the bound
            oldest, at = next(iter(self._nonces.items()))
            if len(self._nonces) <= self.max_nonces and now - at <= self.window_s:
                break
            del self._nonces[oldest]
            if len(self._nonces) >= self.max_nonces:
                self._floor = max(self._floor, at)
