"""Endpoints for the conformance tests: reference and deliberately broken, in-process or as processes.

In-process endpoints run in a background thread on their own asyncio loop (an anyio blocking
portal), so the suite under test runs on the main thread exactly as the CLI runs it; leaving the
context manager cancels the endpoint and joins the thread. Broken endpoints subclass the sans-IO
state machines and change one rule each, so a failing check can only come from that rule. Child
processes are always killed in ``finally``.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import numpy as np
from anyio.from_thread import start_blocking_portal

from launcher.plan import free_port as launch_free_port
from protocol import codec, zmq_auth
from protocol.driver import LearnerServer, RolloutClient
from protocol.events import (
    BatchReceived,
    Event,
    PeerJoined,
    PeerTimedOut,
    ValidationRequested,
    WeightsReceived,
)
from protocol.limits import CodecLimits
from protocol.messages import (
    VALIDATION_CAPABILITY,
    Hello,
    MsgType,
    ValidateRequest,
    ValidateResult,
)
from protocol.peers import Peer
from protocol.receiver import LearnerProtocol
from protocol.reference import (
    REFERENCE_MODEL,
    REFERENCE_TOKENIZER,
    reference_weights,
    synthetic_trajectory,
    synthetic_validation,
)
from protocol.sender import Frames, RolloutConnection, SenderState
from protocol.zmq_transport import ZmqServerChannel, client_factory

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "bin" / "conformance"
# Small limits keep the oversize check fast (the defaults would send a 256 MiB message).
SMALL_LIMITS = CodecLimits(max_message_bytes=1 << 20, max_trajectories_per_batch=64)


# -- broken learners: one rule off each ------------------------------------------------------------
class NeverAcks(LearnerProtocol):
    """Takes batches and never answers them."""

    def _on_batch(self, peer: Peer, msg: object) -> list:
        return []


class AcceptsAnyMajor(LearnerProtocol):
    """Welcomes any protocol version, as if it were its own."""

    def _on_hello(self, identity: bytes, msg: Hello, now: float) -> list:
        return super()._on_hello(
            identity, dataclasses.replace(msg, protocol_version=list(self.version)), now
        )


class IgnoresCredits(LearnerProtocol):
    """Accepts batches whether or not it granted a credit for them."""

    def _on_batch(self, peer: Peer, msg: object) -> list:
        peer.credits = max(peer.credits, 1)
        return super()._on_batch(peer, msg)


class AsksEveryone(LearnerProtocol):
    """Sends VALIDATE_REQUEST to every peer, whether its HELLO offered "validation" or not."""

    def request_validation(
        self, request_id: str, policy_version: int, *, timeout_s: float = 0.0
    ) -> list[str]:
        for p in self.peers.values():
            if p.hello is not None and VALIDATION_CAPABILITY not in p.hello.capabilities:
                self._out.append(
                    (p.identity, codec.encode(ValidateRequest(request_id, policy_version)))
                )
        return super().request_validation(request_id, policy_version, timeout_s=timeout_s)


class IgnoresStrayResults(LearnerProtocol):
    """Drops a VALIDATE_RESULT nobody asked for without a word."""

    def _dispatch(self, peer: Peer, msg: object) -> list:
        if isinstance(msg, ValidateResult) and msg.request_id not in peer.validations:
            return []
        return super()._dispatch(peer, msg)


# -- broken rollout senders -------------------------------------------------------------------------
class AnswersTwice(RolloutConnection):
    """Sends every VALIDATE_RESULT twice."""

    def validation_result(self, result: ValidateResult) -> bool:
        if super().validation_result(result):
            self._out.append(codec.encode(result))
            return True
        return False


class LosesSessionOnValidate(RolloutConnection):
    """Times its session out just as a VALIDATE_REQUEST arrives, as a server starved of CPU for
    longer than the heartbeat timeout does, so the request is lost; then reconnects with HELLO."""

    def receive(self, frames: Frames, now: float) -> list[Event]:
        if (
            self.state is SenderState.READY
            and frames
            and bytes(frames[0])[:1] == bytes([MsgType.VALIDATE_REQUEST])
        ):
            self._requeue_unacked()
            self.state = SenderState.IDLE
            return [PeerTimedOut("learner")]
        return super().receive(frames, now)


class FallsSilentOnValidate(RolloutConnection):
    """Sends nothing more, heartbeats included, once asked to validate (a hung server)."""

    muted = False

    def receive(self, frames: Frames, now: float) -> list[Event]:
        events = super().receive(frames, now)
        self.muted = self.muted or any(isinstance(e, ValidationRequested) for e in events)
        return events

    def data_to_send(self, now: float) -> list[Frames]:
        out = super().data_to_send(now)
        return [] if self.muted else out


class IgnoresCreditsSender(RolloutConnection):
    """Sends every queued batch as soon as it is READY, credits or not."""

    def data_to_send(self, now: float) -> list[Frames]:
        if self.state is SenderState.READY:
            self.credits = max(self.credits, len(self._queue))
        return super().data_to_send(now)


# -- serving in a background thread -----------------------------------------------------------------
class _AnyKey(dict):
    """An allow-list that allows every key (pyzmq's authenticator asks it with ``get``)."""

    def get(self, key, default=None):
        return True


async def serve_learner(
    proto: LearnerProtocol,
    bind: str,
    consume: bool = True,
    validate_on_join: bool = True,
    token: str | None = None,
    any_client_key: bool = False,
    *,
    task_status=anyio.TASK_STATUS_IGNORED,
) -> None:
    """ReferenceLearner.serve with a given protocol object (so broken ones can be served).

    ``consume=False``: batches are never consumed, so room only shrinks (a stalled trainer).
    ``validate_on_join``: every peer that offers validation is asked to validate once it joined.
    ``token``: token auth; ``any_client_key``: broken, it holds the token's server key but lets
    any client key in.
    """
    channel = ZmqServerChannel(bind, token=token, max_message_bytes=proto.limits.max_message_bytes)
    if any_client_key:
        auth = zmq_auth._zap[id(channel.ctx)][1]
        assert channel._zap_domain is not None
        auth.certs[channel._zap_domain] = _AnyKey()
    server = LearnerServer(proto, channel)
    server.publish_weights(0, reference_weights(), chunk_bytes=32 << 10)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(server.run)
            task_status.started(channel.address)
            async for ev in server.events:
                if isinstance(ev, BatchReceived) and consume:
                    server.batch_consumed()
                # like ReferenceLearner(validate_on_join)
                elif isinstance(ev, PeerJoined) and validate_on_join:
                    if VALIDATION_CAPABILITY in ev.hello.capabilities:
                        server.request_validation(
                            f"ref-{uuid.uuid4().hex[:8]}", proto.policy_version
                        )
    finally:
        await channel.aclose()


@contextmanager
def learner_in_thread(
    proto_cls: type[LearnerProtocol] = LearnerProtocol,
    *,
    consume: bool = True,
    validate_on_join: bool = True,
    token: str | None = None,
    any_client_key: bool = False,
    **kw,
) -> Iterator[str]:
    """A learner (reference or broken) on a free loopback port; yields its address."""
    kw = {
        "tokenizer": REFERENCE_TOKENIZER,
        "capacity": 8,
        "max_credits_per_peer": 4,
        "limits": SMALL_LIMITS,
        "heartbeat_interval_s": 0.3,
        "heartbeat_timeout_s": 5.0,
        **kw,
    }
    with start_blocking_portal() as portal:
        fut, address = portal.start_task(
            serve_learner,
            proto_cls(**kw),
            "tcp://127.0.0.1:0",
            consume,
            validate_on_join,
            token,
            any_client_key,
        )
        try:
            yield address
        finally:
            fut.cancel()


async def serve_rollout(
    conn: RolloutConnection, address: str, request_weights: bool = False
) -> None:
    """ReferenceRolloutServer.serve with a given connection object; returns when it ends."""
    client = RolloutClient(conn, client_factory(address), request_weights=request_weights)
    rng = np.random.default_rng(0)
    async with anyio.create_task_group() as tg:
        await tg.start(client.run)

        async def produce() -> None:
            while True:
                while conn.pending >= 8:
                    await anyio.sleep(0.01)
                await client.submit(
                    [synthetic_trajectory(rng, server=conn.peer_id) for _ in range(2)]
                )

        tg.start_soon(produce)
        async for ev in client.events:
            if isinstance(ev, WeightsReceived):
                client.weights_applied(ev.weights.version, ev.weights.transfer_id, ok=True)
            elif isinstance(ev, ValidationRequested):
                client.validation_result(synthetic_validation(ev.request, conn.policy_version))
        tg.cancel_scope.cancel()


class RolloutInThread:
    """Starts a rollout server (reference or broken) once the suite's ROUTER is bound."""

    def __init__(
        self,
        portal,
        conn_cls: type[RolloutConnection] = RolloutConnection,
        *,
        request_weights: bool = False,
        capabilities: tuple[str, ...] = (VALIDATION_CAPABILITY,),
    ) -> None:
        self.portal, self.conn_cls, self.request_weights = portal, conn_cls, request_weights
        self.capabilities = capabilities
        self.conn: RolloutConnection | None = None
        self.future = None

    def __call__(self, address: str) -> None:  # the runner's on_listening callback
        self.conn = self.conn_cls(
            peer_id=f"test-rollout-{uuid.uuid4().hex[:6]}",
            epoch=uuid.uuid4().hex,
            model=REFERENCE_MODEL,
            tokenizer=REFERENCE_TOKENIZER,
            capabilities=list(self.capabilities),
        )
        self.future = self.portal.start_task_soon(
            serve_rollout, self.conn, address, self.request_weights
        )

    def stopped(self, timeout: float = 5.0) -> SenderState:
        """Wait for the server to end by itself (a fatal error ends it; a BYE does not); its state."""
        assert self.future is not None and self.conn is not None
        self.future.result(timeout=timeout)
        return self.conn.state

    def stop(self) -> None:
        """Cancel a server that is still running (it would reconnect forever)."""
        if self.future is not None and not self.future.done():
            self.future.cancel()

    def __enter__(self) -> RolloutInThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()  # before the portal closes: it would wait for the server forever


# -- processes -------------------------------------------------------------------------------------
def free_port() -> int:
    return launch_free_port("127.0.0.1")  # the one bin/train uses


@contextmanager
def child(*args: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


@contextmanager
def reference_learner_process() -> Iterator[str]:
    """``python -m protocol.reference learner`` on a free port; yields the address it printed."""
    with child(
        "-m", "protocol.reference", "learner", "--bind", "tcp://127.0.0.1:0", "--validate-on-join"
    ) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "reference learner listening on tcp://127.0.0.1:PORT"
        m = re.search(r"(tcp://\S+)", line)
        assert m, (
            f"reference learner did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        )
        yield m.group(1)


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CLI), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
