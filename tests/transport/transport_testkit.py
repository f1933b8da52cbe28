"""Shared pieces of the transport tests: live drivers on real or in-memory channels.

``learner_running`` and ``client_running`` start a ``LearnerServer`` / ``RolloutClient`` in a task
group, drain their event streams into a ``Watch`` (so the drivers never block on an unread event
stream) and stop them on exit: by cancellation, which is what a crash looks like to the peer, unless
the test closed them itself. ``Watch.until`` waits on a condition without sleeping: every recorded
event wakes the waiters.

The module name is distinctive (not ``helpers``) because test folders have no ``__init__.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from protocol.driver import ClientChannel, LearnerServer, RolloutClient, ServerChannel
from protocol.events import BatchAcked, BatchReceived, Connected, Event, PeerError, PeerJoined
from protocol.messages import Identity
from protocol.receiver import LearnerProtocol
from protocol.sender import Frames, RolloutConnection
from protocol.trajectory import Trajectory

TOKENIZER = Identity("transport-test-tokenizer", "ef" * 32, 1000)
MODEL = Identity("transport-test-model", "01" * 32, 1000)
_ids = itertools.count()


def make_batch(
    n: int,
    *,
    prompt_len: int = 5,
    response_len: int = 9,
    tag: str = "t",
    rng: np.random.Generator | None = None,
) -> list[Trajectory]:
    """``n`` valid trajectories with unique ids (a tool span masked out in each response)."""
    rng = rng or np.random.default_rng(0)
    out = []
    for _ in range(n):
        mask = np.ones(response_len, np.uint8)
        mask[response_len // 3 : response_len // 2] = 0
        out.append(
            Trajectory(
                trajectory_id=f"{tag}-{next(_ids)}",
                group_uid="g",
                prompt_ids=rng.integers(0, 1000, prompt_len, dtype=np.int32),
                response_ids=rng.integers(0, 1000, response_len, dtype=np.int32),
                response_mask=mask,
                rollout_logprobs=(-rng.random(response_len, dtype=np.float32) * mask),
                versions=np.zeros(response_len, np.int32),
                reward=1.0,
                source_server="test",
            )
        )
    return out


class Watch:
    """Records events and lets tests wait for a condition on them."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._changed = anyio.Event()

    def record(self, ev: Event) -> None:
        self.events.append(ev)
        self.notify()

    def notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    async def until(self, pred: Callable[[], bool], timeout: float = 10.0) -> None:
        with anyio.fail_after(timeout):
            while not pred():
                await self._changed.wait()


@dataclass
class LearnerHandle:
    server: LearnerServer
    proto: LearnerProtocol
    channel: ServerChannel
    watch: Watch = field(default_factory=Watch)
    received: list[Trajectory] = field(default_factory=list)
    consume: bool = True
    scope: anyio.CancelScope | None = None
    stopped: anyio.Event = field(default_factory=anyio.Event)

    @property
    def received_ids(self) -> list[str]:
        return [t.trajectory_id for t in self.received]

    def joined(self) -> int:
        return len(self.watch.of(PeerJoined))

    async def _drain(self) -> None:
        async for ev in self.server.events:
            if isinstance(ev, BatchReceived):
                self.received.extend(ev.trajectories)
                if self.consume:
                    self.server.batch_consumed()
            self.watch.record(ev)

    async def _run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.CancelScope() as self.scope:
            try:
                await self.server.run(task_status=task_status)
            finally:
                self.stopped.set()

    def crash(self) -> None:
        """Stop without BYE, as a killed process would."""
        assert self.scope is not None
        self.scope.cancel()

    async def close(self, timeout: float = 5.0) -> None:
        """Clean shutdown: BYE to every peer, then the driver returns."""
        self.server.close()
        with anyio.fail_after(timeout):
            await self.stopped.wait()


@asynccontextmanager
async def learner_running(
    channel: ServerChannel, *, consume: bool = True, close_channel: bool = True, **proto_kw: Any
) -> AsyncIterator[LearnerHandle]:
    proto_kw.setdefault("heartbeat_interval_s", 0.2)
    proto_kw.setdefault("heartbeat_timeout_s", 2.0)
    proto = LearnerProtocol(tokenizer=TOKENIZER, **proto_kw)
    h = LearnerHandle(LearnerServer(proto, channel), proto, channel, consume=consume)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(h._run)
            tg.start_soon(h._drain)
            try:
                yield h
            finally:
                h.crash()  # no-op if the test already closed it
    finally:
        if close_channel:
            await channel.aclose()


@dataclass
class ClientHandle:
    client: RolloutClient
    conn: RolloutConnection
    watch: Watch = field(default_factory=Watch)
    done: anyio.Event = field(default_factory=anyio.Event)
    scope: anyio.CancelScope | None = None

    def acked(self) -> set[int]:
        return {s for e in self.watch.of(BatchAcked) for s in e.seqs}

    def connected(self) -> int:
        return len(self.watch.of(Connected))

    def peer_errors(self) -> list[PeerError]:
        return self.watch.of(PeerError)

    async def _drain(self) -> None:
        async for ev in self.client.events:
            self.watch.record(ev)

    async def _run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.CancelScope() as self.scope:
            try:
                await self.client.run(task_status=task_status)
            finally:
                self.done.set()
                self.watch.notify()

    async def close(self, timeout: float = 5.0) -> None:
        await self.client.close("test done")
        with anyio.fail_after(timeout):
            await self.done.wait()


def rollout_connection(
    peer_id: str = "rollout-0", epoch: str = "epoch-1", **kw: Any
) -> RolloutConnection:
    kw.setdefault("heartbeat_timeout_s", 2.0)  # handshake timeout until WELCOME sets the learner's
    return RolloutConnection(peer_id=peer_id, epoch=epoch, model=MODEL, tokenizer=TOKENIZER, **kw)


@asynccontextmanager
async def client_running(
    connect: Callable[[], Awaitable[ClientChannel]],
    *,
    peer_id: str = "rollout-0",
    epoch: str = "epoch-1",
    request_weights: bool = False,
    conn_kw: dict[str, Any] | None = None,
) -> AsyncIterator[ClientHandle]:
    conn = rollout_connection(peer_id, epoch, **(conn_kw or {}))
    client = RolloutClient(conn, connect, reconnect_delay_s=0.05, request_weights=request_weights)
    h = ClientHandle(client, conn)
    async with anyio.create_task_group() as tg:
        await tg.start(h._run)
        tg.start_soon(h._drain)
        try:
            yield h
        finally:
            assert h.scope is not None
            h.scope.cancel()


class Blackhole:
    """Wraps client channels so a test can cut the learner -> rollout direction (frames dropped)."""

    def __init__(self, connect: Callable[[], Awaitable[ClientChannel]]) -> None:
        self._connect = connect
        self.drop_incoming = False
        self.dropped = 0
        self.channels: list[ClientChannel] = []

    async def connect(self) -> ClientChannel:
        inner = await self._connect()
        self.channels.append(inner)
        return _Filtered(inner, self)


class _Filtered:
    def __init__(self, inner: ClientChannel, hole: Blackhole) -> None:
        self.inner, self.hole = inner, hole

    async def send(self, frames: Frames) -> None:
        await self.inner.send(frames)

    async def recv(self) -> Frames:
        while True:
            frames = await self.inner.recv()
            if not self.hole.drop_incoming:
                return frames
            self.hole.dropped += 1

    async def aclose(self) -> None:
        await self.inner.aclose()


async def submit_all(client: RolloutClient, batches: list[list[Trajectory]]) -> list[int]:
    return [await client.submit(b) for b in batches]


class ZmqNet:
    """Owns one ZeroMQ context per test and every channel made in it, to check they all get closed."""

    def __init__(self) -> None:
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.servers: list[Any] = []
        self.clients: list[Any] = []

    def server(self, address: str, **kw: Any) -> Any:
        from protocol.zmq_transport import ZmqServerChannel

        ch = ZmqServerChannel(address, context=self.ctx, **kw)
        self.servers.append(ch)
        return ch

    def connector(self, address: str, **kw: Any) -> Callable[[], Awaitable[ClientChannel]]:
        from protocol.zmq_transport import ZmqClientChannel

        async def connect() -> ClientChannel:
            ch = ZmqClientChannel(address, context=self.ctx, **kw)
            self.clients.append(ch)
            return ch

        return connect

    def open_sockets(self) -> list[Any]:
        return [ch.sock for ch in self.servers + self.clients if not ch.sock.closed]

    def term(self, timeout: float = 5.0) -> None:
        """Terminate the context; hangs (and fails) only if a socket was left open."""
        import threading

        t = threading.Thread(target=self.ctx.term, daemon=True)
        t.start()
        t.join(timeout)
        assert not t.is_alive(), "zmq context did not terminate: a socket was left open"
