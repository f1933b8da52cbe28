"""Async drivers: run the sans-IO state machines over any frame channel (anyio; asyncio or trio).

A driver owns two tasks in one task group: a reader that feeds received frames to the state machine
and a flusher that sends whatever the machine has to send, runs its timers (heartbeats, timeouts)
and sleeps until the next deadline or until poked. Only the flusher writes to the channel, so frame
order is the machine's order. Events go to the application through a bounded memory stream; the
reader blocks when the application falls behind, which is back-pressure, not loss.

The learner driver can store every new batch before it is acknowledged (``persist``): the
protocol holds the batch (``LearnerProtocol.hold_batches``) and queues no ACK for it until the
reader has run the hook, in a worker thread so that the fsync does not stall heartbeats. The reader
reads nothing else meanwhile, so batches are stored one at a time and in arrival order. A hook that
raises gets the batch refused (ERROR INTERNAL: the sender keeps it and sends it again), and the
reader pauses ``persist_retry_delay_s`` so a failing disk is not retried at network speed.

The rollout driver reconnects by itself: when the machine drops to IDLE (learner silent, or it
forgot us) the channel is closed and a fresh one is opened, so nothing queued in the old socket can
arrive late, and the unacknowledged batches are resent after the new WELCOME.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from protocol.batch import Trajectories
from protocol.events import BatchReceived, BatchRefused, Event
from protocol.messages import ValidateResult
from protocol.receiver import LearnerProtocol
from protocol.sender import Frames, RolloutConnection, SenderState, encode_batch
from protocol.trajectory import Trajectory
from protocol.weights import NamedBuffer


class ClientChannel(Protocol):
    async def send(self, frames: Frames) -> None: ...
    async def recv(self) -> Frames: ...
    async def aclose(self) -> None: ...


class ServerChannel(Protocol):
    async def send(self, identity: bytes, frames: Frames) -> None: ...
    async def recv(self) -> tuple[bytes, Frames]: ...
    async def aclose(self) -> None: ...


class _Waker:
    """Level-triggered wake-up for the flusher (an anyio.Event re-armed before each flush)."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def rearm(self) -> anyio.Event:
        self._event = anyio.Event()
        return self._event

    def poke(self) -> None:
        self._event.set()


async def _sleep_until(event: anyio.Event, deadline: float, clock: Callable[[], float]) -> None:
    delay = deadline - clock()
    if delay > 0:
        with anyio.move_on_after(min(delay, 3600.0)):
            await event.wait()


async def _emit(stream: MemoryObjectSendStream[Event], events: Sequence[Event]) -> None:
    """Hand the machine's events to the application, without a checkpoint while the buffer has room.

    ``send`` checkpoints before it delivers, and the flusher cancels the reader as soon as the state
    machine leaves its session: the event that said why (HELLO_REQUIRED, BYE) was then lost though
    its state change had happened. Only a full buffer (an application that stopped reading) waits."""
    for ev in events:
        try:
            stream.send_nowait(ev)
        except anyio.WouldBlock:
            await stream.send(ev)


class RolloutClient:
    """Rollout-server side: submit batches, receive events (weights, acks, errors)."""

    def __init__(
        self,
        conn: RolloutConnection,
        connect: Callable[[], Awaitable[ClientChannel]],
        *,
        clock: Callable[[], float] = time.monotonic,
        event_buffer: int = 1024,
        reconnect_delay_s: float = 0.2,
        request_weights: bool = False,
    ) -> None:
        self.conn, self._connect, self._clock = conn, connect, clock
        self.request_weights = request_weights  # HELLO asks for the learner's current weights
        self._waker = _Waker()
        self._send_events, self.events = anyio.create_memory_object_stream[Event](event_buffer)
        self.reconnect_delay_s = reconnect_delay_s
        self.connections = 0

    async def submit(self, trajectories: Sequence[Trajectory]) -> int:
        """Hand a batch over; it is kept until acknowledged. A list of trajectory objects is
        concatenated in a worker thread; column-wise ``Trajectories`` (``TrajectoryBuilder``) only
        need their header packed, which is cheaper than the thread hop."""
        seq = self.conn.allocate_seq()
        form = self.conn.number_frames
        if isinstance(trajectories, Trajectories):
            frames = encode_batch(seq, trajectories, form)
        else:
            frames = await anyio.to_thread.run_sync(encode_batch, seq, trajectories, form)
        self.conn.enqueue(seq, frames)
        self._waker.poke()
        return seq

    def weights_applied(
        self,
        version: int,
        transfer_id: str,
        *,
        ok: bool,
        error: str = "",
        apply_time_s: float = 0.0,
    ) -> None:
        self.conn.weights_applied(
            version, transfer_id, ok=ok, error=error, apply_time_s=apply_time_s
        )
        self._waker.poke()

    def validation_result(self, result: ValidateResult) -> bool:
        """Answer a ``ValidationRequested``; False when the session that asked is gone (dropped)."""
        queued = self.conn.validation_result(result)
        self._waker.poke()
        return queued

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run until the connection is CLOSED or FAILED (then return), reconnecting as needed."""
        started = False
        try:
            while self.conn.state not in (SenderState.CLOSED, SenderState.FAILED):
                channel = await self._connect()
                self.connections += 1
                try:
                    self.conn.start(self._clock(), request_weights=self.request_weights)
                    if not started:
                        task_status.started()
                        started = True
                    await self._session(channel)
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._flush(channel)  # a BYE from close() still goes out
                        await channel.aclose()
                if self.conn.state is SenderState.IDLE:
                    await anyio.sleep(self.reconnect_delay_s)
        finally:
            self._send_events.close()

    async def close(self, reason: str = "") -> None:
        self.conn.close(reason)
        self._waker.poke()

    async def _session(self, channel: ClientChannel) -> None:
        async with anyio.create_task_group() as tg:

            async def reader() -> None:
                while True:
                    frames = await channel.recv()
                    await _emit(self._send_events, self.conn.receive(frames, self._clock()))
                    self._waker.poke()

            tg.start_soon(reader)
            while self.conn.state in (SenderState.HELLO_SENT, SenderState.READY):
                wake = self._waker.rearm()
                await _emit(self._send_events, self.conn.tick(self._clock()))
                await self._flush(channel)
                if self.conn.state not in (SenderState.HELLO_SENT, SenderState.READY):
                    break
                await _sleep_until(wake, self.conn.next_deadline(), self._clock)
            tg.cancel_scope.cancel()

    async def _flush(self, channel: ClientChannel) -> None:
        for frames in self.conn.data_to_send(self._clock()):
            await channel.send(frames)


class LearnerServer:
    """Learner side: events from all rollout servers; grant room, publish weights."""

    def __init__(
        self,
        proto: LearnerProtocol,
        channel: ServerChannel,
        *,
        clock: Callable[[], float] = time.monotonic,
        event_buffer: int = 1024,
        persist: Callable[[BatchReceived], Any] | None = None,
        persist_in_thread: bool = True,
        persist_retry_delay_s: float = 0.5,
    ) -> None:
        """``persist(batch)`` stores a new batch durably before its ACK can leave; what it returns
        comes back as ``BatchReceived.persisted``. It runs in a worker thread unless
        ``persist_in_thread`` is false, one batch at a time."""
        self.proto, self.channel, self._clock = proto, channel, clock
        self._waker = _Waker()
        self._send_events, self.events = anyio.create_memory_object_stream[Event](event_buffer)
        self._closing = False
        self._persist, self._persist_in_thread = persist, persist_in_thread
        self.persist_retry_delay_s = persist_retry_delay_s
        if persist is not None:
            proto.hold_batches = True

    def batch_consumed(self, n: int = 1) -> None:
        self.proto.batch_consumed(n)
        self._waker.poke()

    def publish_weights(
        self,
        version: int,
        tensors: list[NamedBuffer],
        *,
        chunk_bytes: int = 64 << 20,
        file: str = "",
    ) -> None:
        self.proto.publish_weights(version, tensors, chunk_bytes=chunk_bytes, file=file)
        self._waker.poke()

    def admit(self, peer_id: str, groups: int, min_version: int) -> bool:
        """Grant ``peer_id`` prompt groups (protocol 1.3; see ``LearnerProtocol.admit``)."""
        sent = self.proto.admit(peer_id, groups, min_version)
        self._waker.poke()
        return sent

    def request_validation(
        self, request_id: str, policy_version: int, *, timeout_s: float = 0.0
    ) -> list[str]:
        """Ask every peer that offers validation; returns the peers asked (see ``LearnerProtocol``)."""
        asked = self.proto.request_validation(request_id, policy_version, timeout_s=timeout_s)
        self._waker.poke()
        return asked

    def close(self, reason: str = "learner shutting down") -> None:
        self.proto.close(reason)
        self._closing = True
        self._waker.poke()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``close`` is called (BYE sent to every peer) or the task is cancelled."""
        try:
            async with anyio.create_task_group() as tg:

                async def reader() -> None:
                    while True:
                        identity, frames = await self.channel.recv()
                        events = self.proto.receive(identity, frames, self._clock())
                        if (held := self.proto.held_batch) is not None:
                            events += await self._settle(held)
                        await _emit(self._send_events, events)
                        self._waker.poke()
                        if any(isinstance(ev, BatchRefused) for ev in events):
                            await anyio.sleep(self.persist_retry_delay_s)

                tg.start_soon(reader)
                task_status.started()
                while True:
                    wake = self._waker.rearm()
                    await _emit(self._send_events, self.proto.tick(self._clock()))
                    for identity, frames in self.proto.data_to_send(self._clock()):
                        await self.channel.send(identity, frames)
                    if self._closing:
                        break
                    await _sleep_until(wake, self.proto.next_deadline(), self._clock)
                tg.cancel_scope.cancel()
        finally:
            self._send_events.close()

    async def _settle(self, held: BatchReceived) -> list[Event]:
        """Store the held batch with the persist hook, then let the protocol acknowledge or refuse it."""
        if self._persist is None:
            return self.proto.accept_batch()
        try:
            if self._persist_in_thread:
                receipt = await anyio.to_thread.run_sync(self._persist, held)
            else:
                receipt = self._persist(held)
        except Exception as e:  # a storage failure: the batch is refused, the server goes on
            return self.proto.refuse_batch(f"{type(e).__name__}: {e}")
        return self.proto.accept_batch(receipt)
