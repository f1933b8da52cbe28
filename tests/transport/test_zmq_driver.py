"""The drivers over real ZeroMQ sockets (ROUTER/DEALER), on TCP loopback and on an ipc socket file.

asyncio only: the ZeroMQ channels use ``zmq.asyncio``. Each test owns its ZeroMQ context and checks
at the end that every socket it made was closed (the context terminates at once) and that no task
outlived the drivers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest
from transport_testkit import (
    Blackhole,
    ZmqNet,
    client_running,
    learner_running,
    make_batch,
    submit_all,
)

from protocol.errors import ErrorCode
from protocol.events import (
    Connected,
    PeerClosed,
    PeerTimedOut,
    PeerWeightsApplied,
    ProtocolViolation,
    WeightsReceived,
)
from protocol.sender import SenderState
from protocol.weights import NamedBuffer, checksum

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["tcp", "ipc"])
def address(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the learner binds; tcp picks a free port (channels report the real one)."""
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/learner.sock"


@pytest.fixture
def net() -> Iterator[ZmqNet]:
    n = ZmqNet()
    yield n
    assert not n.open_sockets(), "a channel was not closed"
    n.term()


def _tasks() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def test_handshake_and_many_batches_exactly_once(net: ZmqNet, address: str) -> None:
    server = net.server(address)
    async with (
        learner_running(server, capacity=8, max_credits_per_peer=4) as lh,
        client_running(net.connector(server.address)) as ch,
    ):
        await ch.watch.until(lambda: ch.connected() == 1)
        assert ch.watch.of(Connected)[0].welcome.credits == 4
        batches = [make_batch(4, tag=f"m{i}") for i in range(200)]
        seqs = await submit_all(ch.client, batches)
        await ch.watch.until(lambda: ch.acked() == set(seqs), timeout=20)
        await lh.watch.until(lambda: len(lh.received) == 800)
        # in order, once each
        assert lh.received_ids == [t.trajectory_id for b in batches for t in b]
        assert lh.proto.stats["batches"] == 200 and lh.proto.stats["duplicate_batches"] == 0
        assert not lh.watch.of(ProtocolViolation) and not ch.peer_errors()
        assert ch.conn.pending == 0 and ch.connected() == 1


async def test_learner_restart_client_rehandshakes_and_resends(net: ZmqNet, address: str) -> None:
    """Crash the learner (no BYE), start a new one on the same address: nothing submitted is lost."""
    first_batches = [make_batch(3, tag=f"a{i}") for i in range(10)]
    later_batches = [make_batch(3, tag=f"b{i}") for i in range(10)]
    server = net.server(address)
    bound = server.address  # the real port: the new learner binds exactly there
    async with client_running(net.connector(bound)) as ch:
        async with learner_running(server) as first:
            seqs = await submit_all(ch.client, first_batches)
            await ch.watch.until(lambda: ch.acked() >= set(seqs))
            first.crash()
        # The learner is gone; the client still believes in its session and spends its credits
        # into the void: those batches stay unacknowledged and must be resent to the new learner.
        seqs += await submit_all(ch.client, later_batches)
        assert ch.conn.state is SenderState.READY
        async with learner_running(net.server(bound)) as second:
            await ch.watch.until(lambda: ch.acked() == set(seqs), timeout=20)
            codes = {e.error.code for e in ch.peer_errors()}
            assert codes <= {ErrorCode.HELLO_REQUIRED}
            assert codes or ch.watch.of(PeerTimedOut), "the client never noticed the restart"
            assert ch.connected() == 2
    union = set(first.received_ids) | set(second.received_ids)
    assert union == {t.trajectory_id for b in first_batches + later_batches for t in b}
    assert len(second.received_ids) == len(set(second.received_ids)), (
        "the new learner got a batch twice"
    )
    assert {t.trajectory_id for b in later_batches for t in b} <= set(second.received_ids)


async def test_client_reconnect_to_same_learner_delivers_no_duplicates(
    net: ZmqNet, address: str
) -> None:
    """Cut learner -> client until the client gives up on the session; it reconnects and resends."""
    server = net.server(address)
    hole = Blackhole(net.connector(server.address))
    batches = [make_batch(2, tag=f"o{i}") for i in range(40)]
    async with (
        learner_running(server, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0) as lh,
        client_running(hole.connect, conn_kw={"heartbeat_timeout_s": 1.0}) as ch,
    ):
        seqs = await submit_all(ch.client, batches[:20])
        await ch.watch.until(lambda: ch.acked() == set(seqs))
        hole.drop_incoming = True  # ACKs and heartbeats are lost; batches still arrive
        seqs += await submit_all(ch.client, batches[20:])
        await ch.watch.until(lambda: bool(ch.watch.of(PeerTimedOut)), timeout=5)
        hole.drop_incoming = False
        await ch.watch.until(lambda: ch.acked() == set(seqs), timeout=10)
        assert hole.dropped > 0 and ch.connected() == 2 and len(hole.channels) == 2
        assert lh.received_ids == [t.trajectory_id for b in batches for t in b]
        assert lh.proto.peers and len(lh.proto.peers) == 1  # the old session was replaced, not kept


async def test_restarted_sender_resending_in_a_new_epoch_is_deduplicated(
    net: ZmqNet, address: str
) -> None:
    """A rollout server that restarts (new epoch) and replays spooled trajectories delivers nothing new."""
    server = net.server(address)
    batches = [make_batch(3, tag=f"s{i}") for i in range(8)]
    async with learner_running(server) as lh:
        async with client_running(net.connector(server.address), epoch="epoch-1") as ch:
            seqs = await submit_all(ch.client, batches)
            await ch.watch.until(lambda: ch.acked() == set(seqs))
        async with client_running(net.connector(server.address), epoch="epoch-2") as ch2:
            seqs2 = await submit_all(ch2.client, batches)  # same trajectories, new sequence numbers
            await ch2.watch.until(lambda: ch2.acked() == set(seqs2))
        assert lh.received_ids == [t.trajectory_id for b in batches for t in b]
        assert lh.proto.stats["duplicate_trajectories"] == 24


async def test_multi_megabyte_weights_over_tcp(net: ZmqNet) -> None:
    rng = np.random.default_rng(1)
    arrays = {
        "embed": rng.standard_normal((2048, 2048), dtype=np.float32),  # 16 MiB
        "proj": rng.standard_normal((1000, 1571), dtype=np.float32),  # odd size: chunk edges move
        "bias": np.arange(1234, dtype=np.int64),
    }
    tensors = [
        NamedBuffer(k, str(v.dtype), v.shape, memoryview(v).cast("B")) for k, v in arrays.items()
    ]
    server = net.server("tcp://127.0.0.1:0")
    async with learner_running(server) as lh, client_running(net.connector(server.address)) as ch:
        await ch.watch.until(lambda: ch.connected() == 1)
        lh.server.publish_weights(3, tensors, chunk_bytes=4 << 20)
        await ch.watch.until(lambda: bool(ch.watch.of(WeightsReceived)), timeout=20)
        # A rollout server joining later asks for the current weights in its HELLO.
        async with client_running(
            net.connector(server.address), peer_id="late", request_weights=True
        ) as late:
            await late.watch.until(lambda: bool(late.watch.of(WeightsReceived)), timeout=20)
            for h in (ch, late):
                w = h.watch.of(WeightsReceived)[0].weights
                assert w.version == 3
                for spec, buf in w.tensors:
                    assert bytes(buf) == arrays[spec.name].tobytes()
                    assert checksum(memoryview(buf)) == spec.checksum
                h.client.weights_applied(w.version, w.transfer_id, ok=True)
            await lh.watch.until(lambda: len(lh.watch.of(PeerWeightsApplied)) == 2)
        assert {e.peer_id for e in lh.watch.of(PeerWeightsApplied)} == {"rollout-0", "late"}


async def test_bye_and_clean_shutdown(net: ZmqNet, address: str) -> None:
    before = _tasks()  # the test runner's own
    server = net.server(address)
    async with learner_running(server) as lh:
        async with (
            client_running(net.connector(server.address), peer_id="leaving") as leaving,
            client_running(net.connector(server.address), peer_id="staying") as staying,
        ):
            seqs = await submit_all(leaving.client, [make_batch(2) for _ in range(5)])
            await leaving.watch.until(lambda: leaving.acked() == set(seqs))
            await staying.watch.until(lambda: staying.connected() == 1)
            await leaving.close()  # BYE; RolloutClient.run returns
            await lh.watch.until(
                lambda: [e.peer_id for e in lh.watch.of(PeerClosed)] == ["leaving"]
            )
            assert lh.proto.ready_peers() == ["staying"]
            await lh.close()  # BYE to the remaining peer; LearnerServer.run returns
            # The learner's BYE sends the client back to reconnect (a restart must not end it);
            # closing it ourselves ends it.
            await staying.watch.until(
                lambda: (
                    [e.reason for e in staying.watch.of(PeerClosed)] == ["learner shutting down"]
                )
            )
            await staying.close()
            with anyio.fail_after(5):
                await staying.done.wait()
            assert staying.conn.state is SenderState.CLOSED
    assert not net.open_sockets()
    assert not _tasks() - before, "a driver task outlived its owner"
    if address.startswith("ipc://"):
        assert not Path(address.removeprefix("ipc://")).exists(), (
            "the ipc socket file was left behind"
        )
