"""The suite's side of ``--role learner``: fake rollout-server sessions on raw DEALER sockets.

``Peer`` is one DEALER socket (one session) that sends whatever frames a check hands it, valid or
not, and receives with deadlines: ``expect`` polls until a matching message arrives and otherwise
fails naming what did arrive. It keeps a sender-side credit count (WELCOME.credits, minus batches
sent, plus ACK credits) so checks can wait for a credit instead of guessing. ``LearnerTarget`` is
the check context: it hands out peers under fresh peer_ids and, after the check, sends BYE on every
open session so the learner frees the room those sessions held before the next check starts.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from protocol import codec
from protocol.messages import Ack, Bye, Heartbeat, Identity, Message, Welcome
from protocol.trajectory import Trajectory
from protocol.zmq_auth import use_token
from tools.conformance import wire
from tools.conformance.registry import CheckContext, CheckFailed
from tools.conformance.wire import Frames, Received

Pred = Callable[[Received], bool]


class Peer:
    def __init__(
        self,
        zctx: zmq.asyncio.Context,
        target: str,
        *,
        peer_id: str,
        epoch: str,
        model: Identity,
        tokenizer: Identity,
        timeout: float,
        token: str | None = None,
        security: Callable[[zmq.Socket], None] | None = None,
    ) -> None:
        """``security(sock)``: set the socket's mechanism and keys instead of ``token``'s (the
        authentication check presents wrong ones on purpose)."""
        self.peer_id, self.epoch, self.timeout = peer_id, epoch, timeout
        self.model, self.tokenizer = model, tokenizer
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if security is not None:
            security(self.sock)
        elif token is not None:
            use_token(self.sock, token)
        self.sock.connect(target)
        self.limits = codec.CodecLimits()  # for decoding what the learner sends us
        self.pending: deque[Received] = deque()  # received, not yet consumed by expect/collect
        self.log: list[Received] = []  # everything received, in order
        self.welcome: Welcome | None = None
        self.welcome_at = 0.0
        self.credits = 0
        self.in_session = False  # a WELCOME was received and no BYE sent: BYE on cleanup
        self.closed = False

    # -- sending -------------------------------------------------------------------------------------
    async def send(self, frames: Frames) -> None:
        """Send one message; split at the learner's frame bound once its WELCOME announced one
        (SPEC §2, since 1.6)."""
        if self.welcome is not None and (piece := self.welcome.limits.max_frame_bytes) > 0:
            frames = codec.split_frames(frames, piece)
        await self.sock.send_multipart(frames, copy=False)

    async def send_msg(self, msg: Message) -> None:
        await self.send(codec.encode(msg))

    async def send_batch(self, frames: Frames) -> None:
        """Send batch frames, spending a credit (the count may go negative: checks do that on purpose)."""
        self.credits -= 1
        await self.send(frames)

    async def hello(
        self,
        *,
        policy_version: int = 0,
        frames: Frames | None = None,
        capabilities: tuple[str, ...] = (),
    ) -> Welcome:
        """HELLO -> WELCOME, or CheckFailed naming what came back instead."""
        if frames is None:
            frames = codec.encode(
                wire.hello(
                    self.peer_id,
                    self.epoch,
                    model=self.model,
                    tokenizer=self.tokenizer,
                    policy_version=policy_version,
                    capabilities=capabilities,
                )
            )
        await self.send(frames)
        try:
            rec = await self.expect(
                "WELCOME", lambda r: r.is_(Welcome), fail_on_error="HELLO refused"
            )
        except CheckFailed as e:
            if "INCOMPATIBLE_MODEL" in e.reason:
                raise CheckFailed(
                    e.reason + " (pass --model-dir with the learner's model)"
                ) from None
            raise
        assert isinstance(rec.msg, Welcome)
        return rec.msg

    async def bye(self, reason: str = "conformance check done") -> None:
        self.in_session = False
        await self.send_msg(Bye(reason))

    def close(self, *, linger_ms: int = 0) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close(linger=linger_ms)

    # -- receiving -----------------------------------------------------------------------------------
    async def _recv(self, deadline: float) -> Received | None:
        if self.pending:
            return self.pending.popleft()
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not await self.sock.poll(max(1, int(remaining * 1000))):
            return None
        rec = wire.decode(await self.sock.recv_multipart(), self.limits)
        self._track(rec)
        return rec

    def _track(self, rec: Received) -> None:
        self.log.append(rec)
        if isinstance(rec.msg, Welcome):
            self.welcome, self.welcome_at = rec.msg, rec.at
            self.credits, self.in_session = rec.msg.credits, True
        elif isinstance(rec.msg, Ack):
            self.credits += rec.msg.credits

    async def expect(
        self,
        what: str,
        pred: Pred,
        *,
        timeout: float | None = None,
        fail_on_error: str | None = None,
        keepalive_s: float | None = None,
        deadline: float | None = None,
    ) -> Received:
        """The first received message matching ``pred``; non-matching ones are skipped.

        ``fail_on_error``: an ERROR that does not match fails at once, the reason prefixed by it.
        ``keepalive_s``: send a HEARTBEAT this often while waiting, so a long wait does not make
        the learner time the session out. ``deadline`` (monotonic) overrides ``timeout``, which
        then only names the window in the failure reason.
        """
        start = time.monotonic()
        if deadline is None:
            deadline = start + (self.timeout if timeout is None else timeout)
        shown = timeout if timeout is not None else deadline - start  # the window named on failure
        skipped: list[Received] = []
        next_keepalive = time.monotonic() + keepalive_s if keepalive_s else float("inf")
        while True:
            rec = await self._recv(min(deadline, next_keepalive))
            if rec is None:
                if time.monotonic() < deadline:  # a keepalive is due
                    await self.send_msg(Heartbeat(time.time()))
                    next_keepalive = time.monotonic() + (keepalive_s or 0.0)
                    continue
                raise CheckFailed(
                    f"no {what} within {shown:.1f} s (received: {wire.describe(skipped)})"
                )
            if pred(rec):
                return rec
            if fail_on_error is not None and rec.error_code() is not None:
                raise CheckFailed(f"{fail_on_error}: expected {what}, got {rec.describe()}")
            if rec.msg is None and fail_on_error is not None:
                raise CheckFailed(f"{fail_on_error}: the learner sent an {rec.describe()}")
            skipped.append(rec)

    async def collect(
        self, duration: float, until: Callable[[list[Received]], bool] | None = None
    ) -> list[Received]:
        """Everything received within ``duration`` (or until ``until(records)`` holds), in order."""
        deadline = time.monotonic() + duration
        out: list[Received] = []
        while not (until and until(out)):
            rec = await self._recv(deadline)
            if rec is None:
                break
            out.append(rec)
        return out

    async def await_credit(self) -> None:
        """Wait until the learner has granted a credit we have not spent."""
        if self.credits > 0:
            return
        await self.expect(
            "ACK granting a credit",
            lambda r: self.credits > 0,
            fail_on_error="while waiting for a credit",
        )


class LearnerTarget(CheckContext):
    """Context of one learner-role check: fresh peers on the target, cleaned up afterwards."""

    def __init__(
        self,
        zctx: zmq.asyncio.Context,
        target: str,
        *,
        timeout: float,
        model: Identity,
        tokenizer: Identity,
        token: str | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        self.zctx, self.target, self.token = zctx, target, token
        self.model, self.tokenizer = model, tokenizer
        # Token ids the learner will accept: its vocabulary if we know it, and small anyway.
        self.vocab = min(100, tokenizer.vocab_size or 100)
        self.peers: list[Peer] = []
        self._ntraj = 0

    def peer(
        self,
        tag: str,
        *,
        peer_id: str | None = None,
        epoch: str | None = None,
        security: Callable[[zmq.Socket], None] | None = None,
    ) -> Peer:
        p = Peer(
            self.zctx,
            self.target,
            peer_id=peer_id or f"conformance-{tag}-{uuid.uuid4().hex[:8]}",
            epoch=epoch or uuid.uuid4().hex,
            model=self.model,
            tokenizer=self.tokenizer,
            timeout=self.timeout,
            token=self.token,
            security=security,
        )
        self.peers.append(p)
        return p

    def trajectories(self, n: int = 1, **kw: Any) -> list[Trajectory]:
        out = []
        for _ in range(n):
            self._ntraj += 1
            out.append(
                wire.tiny_trajectory(
                    f"conformance-{uuid.uuid4().hex[:12]}-{self._ntraj}", vocab=self.vocab, **kw
                )
            )
        return out

    def batch(self, seq: int, n: int = 1) -> Frames:
        return wire.batch_frames(seq, self.trajectories(n))

    async def aclose(self) -> None:
        """BYE on every open session (frees its room in the learner), then close the sockets."""
        for p in self.peers:
            if p.closed:
                continue
            if p.in_session:
                try:
                    await p.bye()
                    p.close(linger_ms=500)  # let the BYE leave before the socket goes
                    continue
                except zmq.ZMQError:
                    pass
            p.close()
