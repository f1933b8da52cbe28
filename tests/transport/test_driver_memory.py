"""The anyio drivers over in-memory channels, under asyncio and trio (the ``anyio_backend`` fixture).

No sockets: ``protocol.memory_transport`` plays the network, so these tests pin the drivers' own
behaviour (handshake, credit pacing, reconnect and resend, weights, BYE) on both event loops.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from transport_testkit import (
    ClientHandle,
    client_running,
    learner_running,
    make_batch,
    submit_all,
)

from protocol.errors import ErrorCode
from protocol.events import (
    Connected,
    PeerClosed,
    PeerJoined,
    PeerTimedOut,
    PeerWeightsApplied,
    ProtocolViolation,
    WeightsReceived,
)
from protocol.memory_transport import MemoryClientChannel, MemoryHub
from protocol.sender import Frames, SenderState
from protocol.weights import NamedBuffer

pytestmark = pytest.mark.anyio


async def test_handshake() -> None:
    hub = MemoryHub()
    async with (
        learner_running(hub.server(), max_credits_per_peer=3) as lh,
        client_running(hub.connect) as ch,
    ):
        await ch.watch.until(lambda: ch.connected() == 1)
        welcome = ch.watch.of(Connected)[0].welcome
        assert welcome.credits == 3 and welcome.next_seq == 1
        assert welcome.session_id == lh.proto.session_id
        await lh.watch.until(lambda: lh.joined() == 1)
        assert lh.watch.of(PeerJoined)[0].peer_id == "rollout-0"
        assert ch.conn.state is SenderState.READY


async def test_credits_pace_the_sender_and_every_batch_arrives_once() -> None:
    hub = MemoryHub()
    async with (
        learner_running(hub.server(), capacity=4, max_credits_per_peer=2, consume=False) as lh,
        client_running(hub.connect) as ch,
    ):
        seqs = await submit_all(ch.client, [make_batch(3, tag=f"b{i}") for i in range(30)])
        # Nothing consumed: the learner has room for 4 batches but promises at most 2 per peer.
        await lh.watch.until(lambda: len(lh.received) == 4 * 3)
        await ch.watch.until(lambda: len(ch.acked()) == 4)
        with anyio.move_on_after(0.3):  # nothing more may come while the room is full
            await lh.watch.until(lambda: len(lh.received) > 12)
        assert len(lh.received) == 12 and lh.proto.buffered == 4 and ch.conn.pending == 26
        lh.consume = True
        lh.server.batch_consumed(4)
        await ch.watch.until(lambda: ch.acked() == set(seqs))
        await lh.watch.until(lambda: len(lh.received) == 90)
        assert len(set(lh.received_ids)) == 90
        assert not lh.watch.of(ProtocolViolation), "a credit was exceeded or a frame was invalid"
        assert not ch.peer_errors()


async def test_one_way_outage_reconnects_and_resends_without_duplicates() -> None:
    hub = MemoryHub()
    conn_kw = {"heartbeat_timeout_s": 1.0}
    async with (
        learner_running(hub.server(), heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0) as lh,
        client_running(hub.connect, conn_kw=conn_kw) as ch,
    ):
        await ch.watch.until(lambda: ch.connected() == 1)
        hub.drop_to_clients = True  # batches still reach the learner; its ACKs are lost
        batches = [make_batch(2, tag=f"o{i}") for i in range(10)]
        seqs = await submit_all(ch.client, batches)
        await ch.watch.until(lambda: len(ch.watch.of(PeerTimedOut)) == 1, timeout=5)
        hub.drop_to_clients = False
        await ch.watch.until(lambda: ch.acked() == set(seqs), timeout=10)
        assert ch.connected() == 2
        # The learner had the batches whose ACKs were lost: the new WELCOME says so (no resend).
        assert ch.watch.of(Connected)[1].welcome.next_seq > 1
        ids = lh.received_ids
        assert sorted(ids) == sorted(t.trajectory_id for b in batches for t in b)
        assert len(ids) == len(set(ids)), "a resent batch was delivered twice"


async def test_learner_restart_client_rehandshakes_and_resends() -> None:
    hub = MemoryHub()
    batches = [make_batch(2, tag=f"r{i}") for i in range(20)]
    async with client_running(hub.connect) as ch:
        async with learner_running(
            hub.server(), capacity=4, max_credits_per_peer=2, consume=False
        ) as first:
            seqs = await submit_all(ch.client, batches)
            await first.watch.until(lambda: len(first.received) == 8)
            first.crash()  # no BYE; its buffered batches are lost with it... but they were ACKed
        got_first = list(first.received_ids)
        async with learner_running(hub.server(), capacity=4, max_credits_per_peer=2) as second:
            await ch.watch.until(lambda: ch.acked() == set(seqs), timeout=10)
            codes = [e.error.code for e in ch.peer_errors()]
            assert codes and set(codes) == {ErrorCode.HELLO_REQUIRED}
            assert ch.connected() == 2
            union = set(got_first) | set(second.received_ids)
            assert union == {t.trajectory_id for b in batches for t in b}
            assert len(second.received_ids) == len(set(second.received_ids))


async def test_weights_reach_the_client_and_are_applied() -> None:
    hub = MemoryHub()
    arrays = {"a": np.arange(50_000, dtype=np.float32), "b": np.ones((3, 7), dtype=np.int64)}
    tensors = [
        NamedBuffer(k, str(v.dtype), v.shape, memoryview(v).cast("B")) for k, v in arrays.items()
    ]
    async with learner_running(hub.server()) as lh, client_running(hub.connect) as ch:
        await lh.watch.until(lambda: lh.joined() == 1)
        lh.server.publish_weights(7, tensors, chunk_bytes=64 << 10)
        await ch.watch.until(lambda: bool(ch.watch.of(WeightsReceived)))
        w = ch.watch.of(WeightsReceived)[0].weights
        assert w.version == 7
        assert {s.name: bytes(b) for s, b in w.tensors} == {
            k: v.tobytes() for k, v in arrays.items()
        }
        ch.client.weights_applied(w.version, w.transfer_id, ok=True)
        await lh.watch.until(lambda: bool(lh.watch.of(PeerWeightsApplied)))
        assert lh.watch.of(PeerWeightsApplied)[0].applied.version == 7
        assert lh.proto.peers and next(iter(lh.proto.peers.values())).policy_version == 7


async def test_client_bye_ends_both_sides_cleanly() -> None:
    hub = MemoryHub()
    async with learner_running(hub.server()) as lh, client_running(hub.connect) as ch:
        seqs = await submit_all(ch.client, [make_batch(1) for _ in range(3)])
        await ch.watch.until(lambda: ch.acked() == set(seqs))
        await ch.close()
        assert ch.conn.state is SenderState.CLOSED
        await lh.watch.until(lambda: bool(lh.watch.of(PeerClosed)))
        assert lh.watch.of(PeerClosed)[0].reason == "test done"
        assert not lh.proto.peers
        assert lh.proto.free_room == lh.proto.capacity  # its credits went back to the pool


async def test_learner_bye_sends_the_client_back_to_reconnect() -> None:
    """A learner BYE (e.g. before a restart) must not end a rollout server: it reconnects."""
    hub = MemoryHub()
    async with learner_running(hub.server()) as lh, client_running(hub.connect) as ch:
        await ch.watch.until(lambda: ch.connected() == 1)
        await lh.close()
        await ch.watch.until(
            lambda: [e.reason for e in ch.watch.of(PeerClosed)] == ["learner shutting down"]
        )
        with anyio.fail_after(5):
            # the driver opened a fresh channel and said HELLO again
            while ch.client.connections < 2:
                await anyio.sleep(0.01)
        assert ch.conn.state is not SenderState.CLOSED


async def test_the_event_that_ends_a_session_reaches_the_application() -> None:
    """The flusher ends the session (and cancels the reader) as soon as the machine leaves it: the
    reader must have handed over the event that said why by then. Here the flusher is made runnable
    at the instant the learner's BYE arrives, the interleaving a loaded machine produced in CI."""
    hub = MemoryHub()
    handles: list[ClientHandle] = []

    class WakingChannel:
        def __init__(self, inner: MemoryClientChannel) -> None:
            self.inner = inner

        async def send(self, frames: Frames) -> None:
            await self.inner.send(frames)

        async def recv(self) -> Frames:
            frames = await self.inner.recv()
            handles[0].client._waker.poke()  # the flusher runs at the reader's next checkpoint
            return frames

        async def aclose(self) -> None:
            await self.inner.aclose()

    async def connect() -> WakingChannel:
        return WakingChannel(await hub.connect())

    async with learner_running(hub.server()) as lh, client_running(connect) as ch:
        handles.append(ch)
        await ch.watch.until(lambda: ch.connected() == 1)
        await lh.close()
        with anyio.fail_after(5):
            while ch.client.connections < 2:
                await anyio.sleep(0.01)
        assert [e.reason for e in ch.watch.of(PeerClosed)] == ["learner shutting down"]
