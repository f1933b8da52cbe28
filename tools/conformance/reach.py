"""Before the learner-role checks: can the target be reached at all, and does it accept us?

Design: one DEALER socket with a socket monitor connects to the target (with the token, if given)
and watches libzmq's connection events for a few seconds. A completed ZMTP handshake means the
learner is there and took our credentials, and the checks run. Otherwise the events name the
likely cause at once: nothing listening (the connection is refused and retried), credentials
refused (ZAP said no, the security mechanisms differ, or the handshake is dropped because the
learner holds another token's key), or something at that address that does
not speak ZMTP. A connection whose handshake is still pending is left to the checks (a busy
learner answers its authentication late). Without this, each check waited its whole timeout for a WELCOME that could not come,
and the report said only "received: nothing", once per check.
"""

from __future__ import annotations

import asyncio
import struct
import time

import zmq
import zmq.asyncio

from protocol.zmq_auth import use_token

PROBE_S = 5.0
"""Longest look: a learner that answers at all completes its handshake far sooner."""

_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH


def _credentials_hint(token: str | None) -> str:
    if token is None:
        return "pass --token-file RUN_DIR/learner.token (the learner's transport.auth is on)"
    return "check that --token-file is this learner's RUN_DIR/learner.token"


async def diagnose(
    zctx: zmq.asyncio.Context, target: str, token: str | None, within_s: float = PROBE_S
) -> str | None:
    """Why the learner at `target` cannot be tested (None: it completed a handshake with us)."""
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if token is not None:
        use_token(sock, token)
    monitor = sock.get_monitor_socket()
    connected = retried = disconnected = 0
    try:
        sock.connect(target)
        end = time.monotonic() + within_s
        while (left := end - time.monotonic()) > 0:
            try:
                frames = await asyncio.wait_for(monitor.recv_multipart(), left)
            except TimeoutError:
                break
            event, value = struct.unpack("=Hi", frames[0])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return None
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return f"the learner at {target} refused our credentials (ZAP status {value}): " + (
                    _credentials_hint(token)
                )
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value & 0xFFFFFFFF == _MISMATCH:
                side = "expects credentials" if token is None else "expects none, or a CURVE key"
                return (
                    f"the learner at {target} {side} (ZMTP security mechanism mismatch): "
                    + _credentials_hint(token)
                )
            connected += event == zmq.EVENT_CONNECTED
            retried += event == zmq.EVENT_CONNECT_RETRIED
            disconnected += event == zmq.EVENT_DISCONNECTED
            if disconnected >= 2:  # dropped twice before a handshake completed: not by chance
                break
        if not connected and retried:
            return f"nothing is listening at {target} (connection refused)"
        if not connected:
            return f"no answer from {target} within {within_s:g} s (host unreachable or filtered)"
        if disconnected and token is not None:
            # A token's keys sealed for another server key are dropped without a word (the
            # learner cannot read our HELLO), just as anything else that is not our learner.
            return (
                f"the learner at {target} closed the handshake with this token's keys (it holds "
                "another token, or it is not a learner): " + _credentials_hint(token)
            )
        if disconnected:
            return (
                f"something at {target} accepts connections but closes them without a ZMTP "
                "handshake (not a learner, or it refused us without saying why)"
            )
        return None  # connected, handshake pending: a busy learner's ZAP; the checks will say
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
