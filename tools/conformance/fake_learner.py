"""The suite's side of ``--role rollout-server``: a scripted learner on a ROUTER socket.

It answers nothing on its own except heartbeats (a pump, switched off when a check wants silence);
every other reply is a check's decision. A reader task decodes everything that arrives and keeps
the books that must hold at all times, whichever check is running: per session (one ROUTER
identity, opened by our WELCOME) the credits granted and the batches received, so a batch beyond
the credits is a violation even if no check was looking; and every batch must decode under the
limits we advertised. Violations are collected and the runner fails the check during which they
happened. Checks wait on the inbox with deadlines (``next``/``collect``) and fail naming what came.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.asyncio

from protocol import codec
from protocol.errors import ErrorCode
from protocol.messages import (
    Ack,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Message,
    MsgType,
    TrajectoryBatch,
    Welcome,
)
from protocol.version import PROTOCOL_VERSION
from protocol.weights import NamedBuffer
from tools.conformance import wire
from tools.conformance.registry import CheckContext, CheckFailed
from tools.conformance.wire import Frames, Received

Pred = Callable[[Received], bool]


@dataclass
class Session:
    """One rollout-server connection (ROUTER identity) from our WELCOME on."""

    identity: bytes
    hello: Hello
    granted: int  # WELCOME.credits + ACK credits sent
    received: int = 0  # TRAJECTORY_BATCH messages from this identity
    batches: dict[int, TrajectoryBatch] = field(default_factory=dict)  # seq -> first copy received
    acked: set[int] = field(default_factory=set)
    closed: bool = False  # we ended it (HELLO_REQUIRED) or it timed out

    @property
    def unacked(self) -> list[int]:
        return sorted(set(self.batches) - self.acked)


class FakeLearner(CheckContext):
    def __init__(
        self,
        zctx: zmq.asyncio.Context,
        target: str,
        *,
        timeout: float,
        wait: float,
        heartbeat_interval_s: float = 0.2,
        heartbeat_timeout_s: float = 3.0,
        weights_from: str | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        self.wait, self.weights_from = wait, weights_from
        self.heartbeat_interval_s, self.heartbeat_timeout_s = (
            heartbeat_interval_s,
            heartbeat_timeout_s,
        )
        self.limits = codec.CodecLimits()  # advertised in WELCOME, enforced on every batch
        self.sock = zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        try:
            self.sock.bind(target)
        except zmq.ZMQError:
            self.sock.close(linger=0)
            raise
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.inbox: asyncio.Queue[Received] = asyncio.Queue()
        self.sessions: dict[bytes, Session] = {}
        self.session: Session | None = None  # the current one
        self.first_hello: Hello | None = None
        self.violations: list[str] = []
        self.invalid_batches: list[str] = []
        self.policy_version = 0
        self.weights: list[NamedBuffer] | None = None  # loaded on first use
        self.pump = False  # heartbeats to the current session
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._pump())]

    async def aclose(self) -> None:
        """BYE to a session still open (the learner is leaving: the server keeps its batches and
        reconnects), then stop the tasks and close the socket."""
        s = self.session
        if s is not None and not s.closed:
            with contextlib.suppress(zmq.ZMQError):
                await self.send(s.identity, codec.encode(Bye("conformance suite finished")))
                await asyncio.sleep(0)  # hand the BYE to ZeroMQ's I/O thread before linger
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.sock.close(linger=200)

    async def _reader(self) -> None:
        while True:
            parts = await self.sock.recv_multipart()
            if len(parts) < 2:
                continue  # an identity without content: nothing to answer
            vocab = self.first_hello.tokenizer.vocab_size if self.first_hello else 0
            limits = codec.CodecLimits(
                self.limits.max_message_bytes,
                self.limits.max_trajectories_per_batch,
                self.limits.max_tokens_per_trajectory,
                vocab_size=vocab,
            )
            rec = wire.decode(parts[1:], limits, identity=parts[0])
            self._book(rec)
            self.inbox.put_nowait(rec)

    def _book(self, rec: Received) -> None:
        if rec.msg is None:
            self.violations.append(f"the rollout server sent an {rec.describe()}")
            if rec.type == MsgType.TRAJECTORY_BATCH:
                self.invalid_batches.append(rec.describe())
        if rec.type != MsgType.TRAJECTORY_BATCH:
            return
        s = self.sessions.get(rec.identity)
        if s is None:
            self.violations.append(
                f"TRAJECTORY_BATCH from a connection that was never sent WELCOME ({rec.describe()})"
            )
            return
        s.received += 1
        if s.received > s.granted:
            self.violations.append(
                f"{rec.describe()} arrived without a credit (granted {s.granted}, "
                f"received {s.received})"
            )
        if isinstance(rec.msg, TrajectoryBatch):
            s.batches.setdefault(rec.msg.seq, rec.msg)
            problem = batch_problem(rec.msg)
            if problem:
                self.violations.append(problem)
                self.invalid_batches.append(problem)

    async def _pump(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            s = self.session
            if self.pump and s is not None and not s.closed:
                await self.send_msg(s.identity, Heartbeat(time.time(), self.policy_version))

    # -- sending -------------------------------------------------------------------------------------
    async def send(self, identity: bytes, frames: Frames) -> None:
        await self.sock.send_multipart([identity, *frames], copy=False)

    async def send_msg(self, identity: bytes, msg: Message) -> None:
        await self.send(identity, codec.encode(msg))

    async def welcome(self, rec: Received, *, credits: int, next_seq: int) -> Session:
        """Open a session on the identity that sent HELLO ``rec``; heartbeats start."""
        assert isinstance(rec.msg, Hello)
        s = Session(rec.identity, rec.msg, credits)
        self.sessions[rec.identity] = self.session = s
        await self.send_msg(
            rec.identity,
            Welcome(
                protocol_version=list(PROTOCOL_VERSION),
                peer_id="conformance-learner",
                session_id=uuid.uuid4().hex,
                credits=credits,
                policy_version=self.policy_version,
                next_seq=next_seq,
                heartbeat_interval_s=self.heartbeat_interval_s,
                heartbeat_timeout_s=self.heartbeat_timeout_s,
                limits=self.limits.announced(),
            ),
        )
        self.pump = True
        return s

    async def ack(self, seqs: list[int], credits: int) -> None:
        s = self.require_session()
        s.granted += credits
        s.acked.update(seqs)
        await self.send_msg(s.identity, Ack(seqs, credits))

    async def error(
        self, identity: bytes, code: ErrorCode, message: str, *, ref: Received | None = None
    ) -> None:
        seq = ref.msg.seq if ref is not None and isinstance(ref.msg, TrajectoryBatch) else 0
        await self.send_msg(
            identity, Error(int(code), message, code.fatal, "", (ref.type or 0) if ref else 0, seq)
        )

    def require_session(self) -> Session:
        if self.session is None or self.session.closed:
            raise CheckFailed(
                "not run: no open session with the rollout server (an earlier check failed)"
            )
        return self.session

    # -- receiving -----------------------------------------------------------------------------------
    async def next(
        self,
        what: str,
        pred: Pred,
        *,
        timeout: float | None = None,
        fail_if: Pred | None = None,
        silence: float | None = None,
    ) -> Received:
        """The next received message matching ``pred``; ``fail_if`` matches fail at once.

        ``silence``: also fail once the current session has sent nothing at all for that long. A
        live rollout server heartbeats every ``heartbeat_interval_s``; one that lost the session
        (it timed us out and reconnected elsewhere) sends nothing more on it, so a long wait for
        an answer need not run its whole ``timeout``."""
        timeout = self.timeout if timeout is None else timeout
        quiet = math.inf if silence is None else silence
        self.waiting_for = what
        start = time.monotonic()
        deadline, heard = start + timeout, start  # heard: the session's last message
        s = self.session
        skipped: list[Received] = []
        while True:
            until = min(deadline, heard + quiet)
            try:
                rec = await asyncio.wait_for(self.inbox.get(), max(0.0, until - time.monotonic()))
            except TimeoutError:
                if until < deadline:
                    raise CheckFailed(
                        f"no {what}: the session went silent (nothing from it for {quiet:.1f} s, "
                        f"{time.monotonic() - start:.1f} s into the wait; received: "
                        f"{wire.describe(skipped)})"
                    ) from None
                raise CheckFailed(
                    f"no {what} within {timeout:.1f} s (received: {wire.describe(skipped)})"
                ) from None
            if s is not None and rec.identity == s.identity:
                heard = max(heard, rec.at)  # a backlog from before this wait counts from its start
            if pred(rec):
                self.waiting_for = ""
                return rec
            if fail_if is not None and fail_if(rec):
                raise CheckFailed(f"expected {what}, got {rec.describe()}")
            skipped.append(rec)

    async def collect(self, duration: float, pred: Pred | None = None) -> list[Received]:
        """Everything (matching ``pred``) received within ``duration``."""
        self.waiting_for = f"the end of a {duration:.1f} s watch for further messages"
        deadline = time.monotonic() + duration
        out = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                rec = await asyncio.wait_for(self.inbox.get(), left)
            except TimeoutError:
                break
            if pred is None or pred(rec):
                out.append(rec)
        self.waiting_for = ""
        return out

    def from_session(self, cls: type) -> Pred:
        s = self.require_session()
        return lambda r: r.identity == s.identity and isinstance(r.msg, cls)


def batch_problem(batch: TrajectoryBatch) -> str:
    """What is wrong with a decoded batch beyond what the codec checks ('' if nothing)."""
    for i, t in enumerate(batch.trajectories):
        mask = np.asarray(t.response_mask).astype(bool)
        lp = np.asarray(t.rollout_logprobs)
        if np.any(lp[~mask] != 0):
            return (
                f"TRAJECTORY_BATCH seq {batch.seq}: trajectories[{i}].rollout_logprobs is not 0 where "
                "response_mask is 0"
            )
    return ""
