"""The durable intake against real rollout senders: ZeroMQ on loopback, the protocol's RolloutClient.

Covers the protocol's held-batch mode sans-IO first (no ACK before the batch is stored, refusal,
dedup state export), then ``LearnerLink`` end to end: groups to the trainer, credits bounded by the
buffer, deduplication, staleness drops, the ACK-after-persist order, a failing disk, and a learner
that dies without closing and is restarted from a checkpointed state. asyncio only (zmq.asyncio).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgpack
import numpy as np
import pytest

from common.config import load_config
from common.identity import wire_identities
from learner.group_filter import FilterGroupsExhausted
from learner.intake import IntakeClosed, IntakeStarved
from learner.link import LearnerLink
from protocol import codec
from protocol.driver import RolloutClient
from protocol.errors import ErrorCode
from protocol.events import BatchAcked, BatchRefused, Connected, Event, PeerError, WeightsReceived
from protocol.messages import Ack, Error, Identity, MsgType
from protocol.receiver import LearnerProtocol
from protocol.sender import RolloutConnection, encode_batch
from protocol.trajectory import Trajectory
from protocol.weights import NamedBuffer

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def make_config(
    model: Path,
    address: str = "tcp://127.0.0.1:0",
    *,
    buffer_batches: int = 8,
    credits: int = 4,
    extra: tuple[str, ...] = (),
) -> Any:
    return load_config(
        None,
        [
            f"actor_rollout_ref.model.path={model}",
            "data.train_files=unused.jsonl",
            f"learner.bind_address={address}",
            f"learner.buffer_batches={buffer_batches}",
            f"transport.initial_credits={credits}",
            "transport.heartbeat_interval_s=0.2",
            "transport.heartbeat_timeout_s=3.0",
            *extra,
        ],
        check_paths=False,
    )


# -- data -------------------------------------------------------------------------------------------
def traj(
    tid: str, group: str, *, version: int = 0, response_len: int = 6, seed: int = 0
) -> Trajectory:
    rng = np.random.default_rng(seed)
    mask = np.ones(response_len, np.uint8)
    mask[2::3] = 0
    versions = np.full(response_len, version, np.int32)
    versions[2::3] = 0  # tool tokens carry an old version that must not count
    return Trajectory(
        tid,
        group,
        rng.integers(0, 500, 5, dtype=np.int32),
        rng.integers(0, 500, response_len, dtype=np.int32),
        mask,
        (-rng.random(response_len, dtype=np.float32) * mask).astype(np.float32),
        versions,
        reward=0.5,
    )


def make_batch(tag: str, sizes: tuple[int, ...] = (2, 1), *, version: int = 0) -> list[Trajectory]:
    """One group per entry of ``sizes`` (its number of trajectories); ids are ``tag-gN-i``."""
    return [
        traj(f"{tag}-g{g}-{i}", f"{tag}-g{g}", version=version, seed=g * 10 + i)
        for g, n in enumerate(sizes)
        for i in range(n)
    ]


def ids(trajs: list[Trajectory]) -> list[str]:
    return [t.trajectory_id for t in trajs]


def tiny_weights() -> list[NamedBuffer]:
    arr = np.arange(16, dtype=np.float32)
    return [NamedBuffer("w", "float32", (16,), memoryview(arr).cast("B"))]


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.01)


# -- a rollout sender -------------------------------------------------------------------------------
class Sender:
    def __init__(
        self,
        address: str,
        model: Path,
        *,
        token: str | None,
        peer_id: str = "rs-0",
        epoch: str | None = None,
    ) -> None:
        model_id, tok_id = wire_identities(model)
        self.conn = RolloutConnection(
            peer_id=peer_id,
            epoch=epoch or uuid.uuid4().hex,
            model=model_id,
            tokenizer=tok_id,
            heartbeat_interval_s=0.2,
            heartbeat_timeout_s=3.0,
        )
        self.client = RolloutClient(self.conn, _connect(address, token), reconnect_delay_s=0.05)
        self.events: list[Event] = []

    async def drain(self) -> None:
        async for ev in self.client.events:
            self.events.append(ev)
            if isinstance(ev, WeightsReceived):
                self.client.weights_applied(ev.weights.version, ev.weights.transfer_id, ok=True)

    @property
    def acked(self) -> set[int]:
        return {s for e in self.events if isinstance(e, BatchAcked) for s in e.seqs}

    @property
    def duplicates(self) -> set[int]:
        return {s for e in self.events if isinstance(e, BatchAcked) for s in e.duplicates}

    def errors(self) -> list[Error]:
        return [e.error for e in self.events if isinstance(e, PeerError)]


def _connect(address: str, token: str | None) -> Any:
    from protocol.zmq_transport import client_factory

    return client_factory(address, token=token)


@asynccontextmanager
async def sending(address: str, model: Path, **kw: Any) -> AsyncIterator[Sender]:
    s = Sender(address, model, **kw)
    async with anyio.create_task_group() as tg:
        await tg.start(s.client.run)
        tg.start_soon(s.drain)
        try:
            yield s
        finally:
            tg.cancel_scope.cancel()


@asynccontextmanager
async def serving(link: LearnerLink) -> AsyncIterator[str]:
    async with anyio.create_task_group() as tg:
        address = await tg.start(link.run)
        try:
            yield address
        finally:
            link.close()  # run() returns once the BYEs are out


# -- the protocol's held-batch mode, sans-IO --------------------------------------------------------
TOK = Identity("tok", "", 0)


def on_wire(frames: list[Any]) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) for f in frames]


def pump(learner: LearnerProtocol, conn: RolloutConnection, ident: bytes = b"r0") -> list[Event]:
    events: list[Event] = []
    for _ in range(50):
        up, down = conn.data_to_send(0.0), learner.data_to_send(0.0)
        for f in up:
            events += learner.receive(ident, on_wire(f), 0.0)
        for _, f in down:
            conn.receive(on_wire(f), 0.0)
        if not up and not down:
            break
    return events


def sent_types(learner: LearnerProtocol) -> list[MsgType]:
    return [codec.peek_type(f) for _, f in learner._out]


def test_held_batch_is_not_acknowledged_until_accepted() -> None:
    learner = LearnerProtocol(tokenizer=TOK, capacity=4, max_credits_per_peer=2, hold_batches=True)
    conn = RolloutConnection(peer_id="rs", epoch="e1", model=TOK, tokenizer=TOK)
    conn.start(0.0)
    pump(learner, conn)
    conn.submit(make_batch("a"))
    assert pump(learner, conn) == []  # nothing handed over, nothing acknowledged
    held = learner.held_batch
    assert (
        held is not None
        and held.epoch == "e1"
        and ids(list(held.trajectories)) == ids(make_batch("a"))
    )
    assert learner.buffered == 1 and conn.pending == 1  # its room counts while it is held
    with pytest.raises(RuntimeError, match="held batch"):
        learner.receive(b"r0", on_wire(codec.encode(Ack([], 0))), 0.0)
    (ev,) = learner.accept_batch(receipt=(7, 100))
    assert ev.persisted == (7, 100) and learner.held_batch is None and learner.buffered == 1
    assert sent_types(learner) == [MsgType.ACK]
    pump(learner, conn)
    assert conn.pending == 0


def test_refused_batch_gets_internal_error_and_its_credit_back() -> None:
    learner = LearnerProtocol(tokenizer=TOK, capacity=4, max_credits_per_peer=2, hold_batches=True)
    conn = RolloutConnection(peer_id="rs", epoch="e1", model=TOK, tokenizer=TOK)
    conn.start(0.0)
    pump(learner, conn)
    conn.submit(make_batch("a"))
    pump(learner, conn)
    credits = learner.peers[b"r0"].credits
    (ev,) = learner.refuse_batch("disk full")
    assert isinstance(ev, BatchRefused) and ev.seq == 1
    (frames,) = [f for _, f in learner._out]
    err = codec.decode(frames)
    assert isinstance(err, Error) and err.code == ErrorCode.INTERNAL and err.ref_seq == 1
    assert learner.peers[b"r0"].credits == credits + 1 and learner.buffered == 0
    pump(learner, conn)  # the sender keeps the batch and sends it again at once
    assert learner.held_batch is not None and learner.held_batch.seq == 1
    learner.accept_batch()
    pump(learner, conn)
    assert conn.pending == 0 and conn.credits == learner.peers[b"r0"].credits == 2


@pytest.mark.parametrize("outcome", ["accepted", "refused"])
def test_room_of_a_held_batch_is_not_promised_twice(outcome: str) -> None:
    """Room freed while a batch is being stored (training consumed a batch) is granted again; the
    held batch's own room is not part of it."""
    learner = LearnerProtocol(tokenizer=TOK, capacity=4, max_credits_per_peer=2, hold_batches=True)
    a = RolloutConnection(peer_id="a", epoch="e1", model=TOK, tokenizer=TOK)
    b = RolloutConnection(peer_id="b", epoch="e1", model=TOK, tokenizer=TOK)
    a.start(0.0)
    pump(learner, a, b"ra")
    b.start(0.0)
    pump(learner, b, b"rb")  # 2 credits each: the room is all promised
    a.submit(make_batch("x"))
    pump(learner, a, b"ra")
    learner.accept_batch()
    pump(learner, a, b"ra")
    a.submit(make_batch("y"))
    pump(learner, a, b"ra")
    assert learner.held_batch is not None and learner.peers[b"ra"].credits == 0

    def total() -> int:
        return learner.buffered + sum(p.credits for p in learner.peers.values())

    assert total() == 4
    learner.batch_consumed(1)  # batch x trained: one batch of room to hand out, not two
    assert learner.peers[b"ra"].credits == 1 and total() == 4
    learner.accept_batch() if outcome == "accepted" else learner.refuse_batch("disk full")
    assert total() == 4 and learner.buffered == (1 if outcome == "accepted" else 0)


def test_exported_state_makes_a_new_learner_recognise_old_batches() -> None:
    old = LearnerProtocol(tokenizer=TOK, capacity=8, max_credits_per_peer=4)
    conn = RolloutConnection(peer_id="rs", epoch="e1", model=TOK, tokenizer=TOK)
    conn.start(0.0)
    pump(old, conn)
    for i in range(3):
        conn.submit(make_batch(f"b{i}"))
    pump(old, conn)
    old.publish_weights(5, tiny_weights())
    state = msgpack.unpackb(msgpack.packb(old.export_state()), raw=False)
    new = LearnerProtocol(tokenizer=TOK, capacity=8, max_credits_per_peer=4)
    new.restore_state(state)
    new.replay_batch("rs", "e1", 5, ["x-1"])  # stored by the old learner after its export
    assert new.policy_version == 5 and new.buffered == 1
    again = RolloutConnection(peer_id="rs", epoch="e1", model=TOK, tokenizer=TOK)
    again.start(0.0)
    pump(new, again)
    assert again.welcome is not None and again.welcome.next_seq == 4
    restarted = RolloutConnection(peer_id="rs", epoch="e2", model=TOK, tokenizer=TOK)  # new epoch
    restarted.start(0.0)
    pump(new, restarted, b"r1")
    restarted.submit([*make_batch("b1"), traj("x-1", "x")])  # all seen before: nothing delivered
    assert pump(new, restarted, b"r1") == [] and new.stats["duplicate_trajectories"] == 4


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("in_thread", [True, False], ids=["thread", "inline"])
async def test_driver_acknowledges_only_stored_batches(in_thread: bool) -> None:
    """LearnerServer(persist=...) over in-memory channels, on both event loops: every ACK follows
    its store, a failed store is refused and the resend stored, receipts reach the events."""
    from protocol.driver import LearnerServer
    from protocol.events import BatchReceived
    from protocol.memory_transport import MemoryHub

    hub = MemoryHub()
    proto = LearnerProtocol(tokenizer=TOK, capacity=8, max_credits_per_peer=4)
    conn = RolloutConnection(peer_id="rs", epoch="e", model=TOK, tokenizer=TOK)
    client = RolloutClient(conn, hub.connect, reconnect_delay_s=0.05)
    acked: set[int] = set()
    stored: list[int] = []
    acked_when_stored: list[bool] = []
    failed_once: set[int] = set()

    def persist(ev: BatchReceived) -> str:
        if ev.seq == 2 and 2 not in failed_once:
            failed_once.add(2)
            raise OSError("disk full")
        if in_thread:
            time.sleep(0.02)  # the loop runs on meanwhile
        acked_when_stored.append(ev.seq in acked)
        stored.append(ev.seq)
        return f"record-{ev.seq}"

    server = LearnerServer(
        proto,
        hub.server(),
        persist=persist,
        persist_in_thread=in_thread,
        persist_retry_delay_s=0.01,
    )
    learner_events: list[Event] = []
    async with anyio.create_task_group() as tg:
        await tg.start(server.run)

        async def drain_learner() -> None:
            async for ev in server.events:
                learner_events.append(ev)

        async def drain_client() -> None:
            async for ev in client.events:
                if isinstance(ev, BatchAcked):
                    acked.update(ev.seqs)

        tg.start_soon(drain_learner)
        await tg.start(client.run)
        tg.start_soon(drain_client)
        for i in range(4):
            await client.submit(make_batch(f"b{i}"))
        await until(lambda: acked == {1, 2, 3, 4})
        tg.cancel_scope.cancel()
    assert sorted(stored) == [1, 2, 3, 4] and acked_when_stored == [False] * 4
    got = {ev.seq: ev.persisted for ev in learner_events if isinstance(ev, BatchReceived)}
    assert got == {s: f"record-{s}" for s in (1, 2, 3, 4)}
    assert [ev.seq for ev in learner_events if isinstance(ev, BatchRefused)] == [2]
    assert proto.stats["refused_batches"] == 1 and proto.buffered == 4


# -- the intake end to end --------------------------------------------------------------------------
async def test_groups_flow_to_the_trainer_whole_and_in_order(
    tiny_model: Path, tmp_path: Path
) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path)
    async with serving(link) as address, sending(address, tiny_model, token=link.token) as s:
        b1, b2 = make_batch("a", (3, 1)), make_batch("b", (2,))
        for b in (b1, b2):
            await s.client.submit(b)
        taken = await link.intake.next_batch(3, policy_version=0, max_staleness=0)
        assert taken.group_uids == ["a-g0", "a-g1", "b-g0"] and taken.group_sizes == [3, 1, 2]
        assert ids(taken.trajectories) == ids(b1) + ids(b2)
        assert taken.staleness == [0, 0, 0] and taken.dropped_stale == 0 and taken.wait_s >= 0
        assert np.array_equal(taken.trajectories[0].response_ids, b1[0].response_ids)
        st = link.stats
        assert (st["peers"], st["batches"], st["trajectories"], st["in_flight_groups"]) == (
            1,
            2,
            6,
            3,
        )
        assert (
            st["tokens"] == 6 * (5 + 6) and st["persisted_bytes"] > 0 and st["journal_records"] == 2
        )
        assert st["buffered_batches"] == 2
        link.intake.mark_trained(taken)
        assert link.stats["buffered_batches"] == 0 and link.stats["in_flight_groups"] == 0
        with pytest.raises(ValueError):
            link.intake.mark_trained(taken)  # trained twice


async def test_credits_never_exceed_the_buffer_room(tiny_model: Path, tmp_path: Path) -> None:
    link = LearnerLink(make_config(tiny_model, buffer_batches=3, credits=3), tmp_path)
    proto = link._proto

    def room_ok() -> bool:
        return proto.buffered + sum(p.credits for p in proto.peers.values()) <= proto.capacity

    async with serving(link) as address, sending(address, tiny_model, token=link.token) as s:
        for i in range(8):
            await s.client.submit(make_batch(f"b{i}", (1,)))
        await until(lambda: link.stats["batches"] == 3)
        await anyio.sleep(0.3)  # nothing more may come while the room holds 3 untrained batches
        assert link.stats["batches"] == 3 and s.conn.pending == 5 and room_ok()
        taken = await link.intake.next_batch(2, 0, 0)
        await anyio.sleep(0.3)  # taken is not trained: still no room
        assert link.stats["batches"] == 3 and room_ok()
        link.intake.mark_trained(taken)
        await until(lambda: link.stats["batches"] == 5)
        await anyio.sleep(0.2)
        assert link.stats["batches"] == 5 and room_ok()
        got = ids(taken.trajectories)
        while len(got) < 8:
            t = await link.intake.next_batch(1, 0, 0)
            link.intake.mark_trained(t)
            got += ids(t.trajectories)
            assert room_ok()
        assert got == [f"b{i}-g0-0" for i in range(8)]
        assert link.stats["violations"] == 0


async def test_resent_batches_and_trajectories_are_deduplicated(
    tiny_model: Path, tmp_path: Path
) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path)
    async with serving(link) as address:
        b1, b2 = make_batch("a"), make_batch("b")
        async with sending(address, tiny_model, token=link.token, peer_id="rs-0", epoch="e1") as s:
            seq = await s.client.submit(b1)
            await s.client.submit(b2)
            await until(lambda: s.acked == {1, 2})
            s.conn.enqueue(seq, encode_batch(seq, b1))  # the same batch again (a lost ACK, say)
            await s.client.submit(make_batch("c"))
            await until(lambda: len(s.acked) == 3 and 1 in s.duplicates)
        # A restarted rollout server (new epoch) resends spooled trajectories, plus one new one.
        async with sending(address, tiny_model, token=link.token, peer_id="rs-0", epoch="e2") as s2:
            await s2.client.submit(b2)
            await s2.client.submit([*b1[:1], traj("new-1", "a-g0")])
            await until(lambda: s2.acked == {1, 2})
        st = link.stats
        assert st["duplicate_batches"] == 1 and st["duplicate_trajectories"] == 3 + 1
        # 4: 3 + the one with a new trajectory
        assert st["batches"] == 4 and st["journal_records"] == 4
        taken = await link.intake.next_batch(st["buffered_groups"], 0, 0)
        got = ids(taken.trajectories)
        assert sorted(got) == sorted(ids(b1) + ids(b2) + ids(make_batch("c")) + ["new-1"])
        assert len(got) == len(set(got))


async def test_stale_groups_are_dropped_and_free_their_room(
    tiny_model: Path, tmp_path: Path
) -> None:
    link = LearnerLink(make_config(tiny_model, buffer_batches=2, credits=2), tmp_path)
    async with serving(link) as address, sending(address, tiny_model, token=link.token) as s:
        link.weights.announce(5, tiny_weights())
        # WEIGHTS_APPLIED(ok) recorded
        await until(lambda: link.weights.peer_versions == {"rs-0": 5})
        await s.client.submit(make_batch("old", (1, 1), version=3))  # staleness 2
        await s.client.submit(
            make_batch("mixed", (1,), version=3) + make_batch("ok", (2,), version=4)
        )
        await until(lambda: link.stats["batches"] == 2)
        # The room is full of batches. A request drops the stale groups; the freed room lets more in.
        waiting = anyio.Event()
        result: list[Any] = []

        async def trainer() -> None:
            waiting.set()
            result.append(await link.intake.next_batch(2, policy_version=5, max_staleness=1))

        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            await waiting.wait()
            await until(lambda: link.stats["dropped_stale_groups"] == 3)
            await s.client.submit(make_batch("late-stale", (1,), version=1))
            await s.client.submit(make_batch("fresh", (1,), version=5))
        (taken,) = result
        assert taken.group_uids == ["ok-g0", "fresh-g0"] and taken.staleness == [1, 0]
        assert taken.dropped_stale == 4 and link.stats["dropped_stale_groups"] == 4
        assert link.stats["buffered_batches"] == 2  # "mixed" (ok-g0 in flight) and "fresh"
        link.intake.mark_trained(taken)
        assert link.stats["buffered_batches"] == 0


async def test_ack_leaves_only_after_the_batch_is_stored(tiny_model: Path, tmp_path: Path) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path)
    real = link._journal.append
    acked_before_stored: list[bool] = []
    sender: list[Sender] = []

    def slow_append(peer_id: str, epoch: str, seq: int, trajs: Any) -> tuple[int, int]:
        # a worker thread: the event loop runs on, an ACK already queued would arrive
        time.sleep(0.15)
        acked_before_stored.append(seq in sender[0].acked)
        return real(peer_id, epoch, seq, trajs)

    link._journal.append = slow_append  # type: ignore[method-assign]
    async with serving(link) as address, sending(address, tiny_model, token=link.token) as s:
        sender.append(s)
        for i in range(3):
            await s.client.submit(make_batch(f"b{i}"))
        await until(lambda: s.acked == {1, 2, 3})
    assert acked_before_stored == [False, False, False]
    assert link._journal.record_ids == [1, 2, 3]


async def test_a_failing_store_refuses_the_batch_and_its_resend_is_taken(
    tiny_model: Path, tmp_path: Path
) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path)
    link._server.persist_retry_delay_s = 0.05
    real = link._journal.append
    calls = []

    def flaky(*args: Any) -> tuple[int, int]:
        calls.append(args[2])
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(*args)

    link._journal.append = flaky  # type: ignore[method-assign]
    async with serving(link) as address, sending(address, tiny_model, token=link.token) as s:
        for i in range(3):
            await s.client.submit(make_batch(f"b{i}"))
        await until(lambda: s.acked == {1, 2, 3})
        assert [e.code for e in s.errors()] == [ErrorCode.INTERNAL]
        # 1 refused, then resent (after those in flight) and stored
        assert sorted(calls) == [1, 1, 2, 3]
        st = link.stats
        assert (st["persist_failures"], st["batches"], st["violations"], st["journal_records"]) == (
            1,
            3,
            0,
            3,
        )
        taken = await link.intake.next_batch(6, 0, 0)
        assert sorted(ids(taken.trajectories)) == sorted(
            i for b in range(3) for i in ids(make_batch(f"b{b}"))
        )


async def test_restart_from_a_checkpoint_loses_nothing_and_trains_nothing_twice(
    tiny_model: Path, tmp_path: Path
) -> None:
    address = free_address()
    config = make_config(tiny_model, address, buffer_batches=16, credits=8)
    journal = tmp_path / "journal"
    batches = {seq: make_batch(f"s{seq}", (seq % 3 + 1, 2)) for seq in range(1, 8)}
    a = LearnerLink(config, tmp_path, journal_dir=journal)
    async with sending(address, tiny_model, token=a.token, peer_id="rs-0", epoch="e1") as s:
        # -- life A: dies without close() after accepting batch 7 and storing it, before its ACK.
        async with anyio.create_task_group() as life_a:
            await life_a.start(a.run)
            a.weights.announce(2, tiny_weights())
            for seq in range(1, 5):
                await s.client.submit(batches[seq])
            await until(lambda: s.acked == {1, 2, 3, 4})
            before = await a.intake.next_batch(3, 2, 10)
            a.intake.mark_trained(before)  # in the checkpoint
            state = msgpack.unpackb(
                msgpack.packb(a.intake.state_dict(), use_bin_type=True), raw=False
            )
            a.intake.checkpoint_saved(state)
            after = await a.intake.next_batch(2, 2, 10)
            # trained after the checkpoint: the restarted model never saw it
            a.intake.mark_trained(after)
            await a.intake.next_batch(1, 2, 10)  # taken, never trained
            for seq in (5, 6):
                await s.client.submit(batches[seq])
            await until(lambda: s.acked == set(range(1, 7)))
            generated_a = a.intake.waste_metrics()["rollout/generated_tokens"]
            stored, gate = threading.Event(), threading.Event()
            real = a._journal.append

            def store_then_die(*args: Any) -> tuple[int, int]:
                out = real(*args)
                stored.set()
                gate.wait(10)
                return out

            a._journal.append = store_then_die  # type: ignore[method-assign]
            await s.client.submit(batches[7])
            await anyio.to_thread.run_sync(stored.wait, 10)
            life_a.cancel_scope.cancel()  # killed: no BYE, no ACK for 7, no close()
            gate.set()
        assert 7 not in s.acked
        newest = sorted(journal.glob("*.seg"))[-1]
        with newest.open("ab") as f:
            f.write(b"AIJR\x01\x02 a record torn by the kill")
        expected = [
            i for seq in range(1, 8) for i in ids(batches[seq]) if i not in ids(before.trajectories)
        ]

        # -- life B: same address, same journal, the checkpointed state.
        b = LearnerLink(config, tmp_path, state=state, journal_dir=journal)
        # 7 - 1 replayed: batch 1 was fully trained
        assert b.weights.policy_version == 2 and b.stats["replayed_records"] == 7 - 1
        # the waste counts go on from life A's: everything generated, batch 7 (stored as A died)
        # counted once, nothing wasted
        waste = b.intake.waste_metrics()
        sampled_7 = sum(int(np.count_nonzero(t.response_mask)) for t in batches[7])
        assert waste["rollout/generated_tokens"] == generated_a + sampled_7
        assert waste["rollout/waste_frac"] == 0.0 and waste["rollout/wasted_tokens"] == 0
        async with serving(b):
            # the sender reconnected: 7 was already there
            await until(lambda: 7 in s.acked, timeout=15)
            assert 7 in s.duplicates and b.stats["batches"] == 0
            await s.client.submit(make_batch("s8"))
            await until(lambda: 8 in s.acked)
            # The same sender epoch over a new connection resends old seqs: duplicates.
            await s.client.close()
            async with sending(
                address, tiny_model, token=b.token, peer_id="rs-0", epoch="e1"
            ) as again:
                await until(lambda: any(isinstance(e, Connected) for e in again.events))
                for seq in (3, 6):
                    again.conn.enqueue(seq, encode_batch(seq, batches[seq]))
                await again.client.submit(make_batch("s9"))  # its seq is 1 here: also an old one
                await until(lambda: again.acked == {1, 3, 6})
                assert again.duplicates == {1, 3, 6}
            # A restarted rollout server (new epoch) resends trajectories it had spooled.
            async with sending(
                address, tiny_model, token=b.token, peer_id="rs-1", epoch="e2"
            ) as other:
                await other.client.submit(batches[2] + batches[7])
                await until(lambda: other.acked == {1})
            assert b.stats["batches"] == 1 and b.stats["duplicate_trajectories"] == len(
                batches[2] + batches[7]
            )
            n_groups = b.stats["buffered_groups"]
            taken = await b.intake.next_batch(n_groups, 2, 10)
            got = ids(taken.trajectories)
            assert sorted(got) == sorted(expected + ids(make_batch("s8")))  # none lost
            assert len(got) == len(set(got))  # none twice
            by_id = {t.trajectory_id: t for seq in batches for t in batches[seq]}
            assert all(
                np.array_equal(t.response_ids, by_id[t.trajectory_id].response_ids)
                for t in taken.trajectories
                if t.trajectory_id in by_id
            )
            b.intake.mark_trained(taken)
            assert b.stats["buffered_batches"] == 0
            b.intake.checkpoint_saved(b.intake.state_dict())  # nothing pending: the journal can go
            assert b.stats["journal_records"] == 0


async def test_resume_without_the_needed_records_fails_and_fresh_starts_over(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = make_config(tiny_model)
    a = LearnerLink(config, tmp_path)
    async with serving(a) as address, sending(address, tiny_model, token=a.token) as s:
        await s.client.submit(make_batch("a"))
        await until(lambda: s.acked == {1})
    state = a.intake.state_dict()
    assert state["pending"] == [[1, "a-g0"], [1, "a-g1"]] and state["position"] == 1
    # no state: a learner that died before its first checkpoint
    replay = LearnerLink(config, tmp_path)
    assert replay.stats["buffered_groups"] == 2
    replay.close()
    with pytest.raises(ValueError, match="lacks 1 records"):
        LearnerLink(config, tmp_path, state=state, journal_dir=tmp_path / "elsewhere")
    fresh = LearnerLink(config, tmp_path, fresh=True)
    assert fresh.stats["buffered_groups"] == 0 and fresh.stats["journal_records"] == 0
    fresh.close()
    with pytest.raises(ValueError, match="lacks"):
        LearnerLink(config, tmp_path, state=state)


async def test_a_training_batch_bigger_than_the_buffer_fails_fast(
    tiny_model: Path, tmp_path: Path
) -> None:
    link = LearnerLink(make_config(tiny_model, buffer_batches=2, credits=2), tmp_path)
    async with serving(link) as address, sending(address, tiny_model, token=link.token) as s:
        for i in range(3):
            await s.client.submit(make_batch(f"b{i}", (1,)))
        with anyio.fail_after(10), pytest.raises(IntakeStarved, match="buffer_batches=2"):
            await link.intake.next_batch(3, 0, 0)
        taken = await link.intake.next_batch(2, 0, 0)  # a batch that fits is fine
        link.intake.mark_trained(taken)


async def test_close_wakes_a_waiting_trainer(tiny_model: Path, tmp_path: Path) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path)
    async with serving(link):
        async with anyio.create_task_group() as tg:

            async def close_soon() -> None:
                await anyio.sleep(0.1)
                link.close()

            tg.start_soon(close_soon)
            with anyio.fail_after(5), pytest.raises(IntakeClosed):
                await link.intake.next_batch(1, 0, 0)


async def test_serve_alone_consumes_everything_and_writes_its_stats(
    tiny_model: Path, tmp_path: Path
) -> None:
    from common.peer_auth import client_token
    from learner.intake_only import serve

    config = make_config(tiny_model, buffer_batches=2, credits=2)
    async with anyio.create_task_group() as tg:
        address = await tg.start(serve, config, tmp_path)
        async with sending(
            address, tiny_model, token=client_token(config, tmp_path), epoch="e1"
        ) as s:
            seqs = [await s.client.submit(make_batch(f"b{i}")) for i in range(10)]  # 5x the room
            await until(lambda: s.acked == set(seqs))
        tg.cancel_scope.cancel()
    stats = json.loads((tmp_path / "intake_stats.json").read_text())
    assert stats["batches"] == 10 and stats["trajectories"] == 30 and stats["buffered_batches"] == 0


async def test_token_ids_are_checked_against_the_embedding_rows(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A model with more embedding rows than tokenizer ids (Qwen2.5: 151936 vs 151665; a random model
    samples the extra ids) may send any id below its rows; ids past them are still refused."""
    import shutil

    from common.identity import embedding_rows
    from learner.bind import build_server

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    _, tok = wire_identities(model)
    assert embedding_rows(model) == cfg["vocab_size"]
    cfg["vocab_size"] = tok.vocab_size + 100
    (model / "config.json").write_text(json.dumps(cfg))
    config = make_config(model)
    server, channel = build_server(config, publish_initial=False, run_dir=tmp_path)
    try:
        assert server.proto.limits.vocab_size == tok.vocab_size + 100
    finally:
        channel._release()


def rewarded(tag: str, *groups: tuple[float, ...]) -> list[Trajectory]:
    """One group per entry of ``groups``, one trajectory per reward in it."""
    batch = make_batch(tag, tuple(len(g) for g in groups))
    for t, r in zip(batch, [r for g in groups for r in g], strict=True):
        t.reward = r
    return batch


async def test_filtered_groups_are_never_trained_nor_replayed_into_training(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Dynamic sampling: a group whose episodes all score the same leaves the buffer as it arrives
    (its batch's room with it), is counted apart from waste, and a restart, from a checkpointed
    state or from the whole journal, filters it again and counts it once."""
    config = make_config(tiny_model, extra=("algorithm.filter_groups.enable=true",))
    journal = tmp_path / "journal"
    a = LearnerLink(config, tmp_path, journal_dir=journal)
    async with serving(a) as address, sending(address, tiny_model, token=a.token) as s:
        await s.client.submit(rewarded("b1", (0, 1), (1, 1), (1,)))  # kept, filtered, kept (one)
        await s.client.submit(rewarded("b2", (0, 0, 0), (1, 1)))  # all filtered: no room held
        await until(lambda: s.acked == {1, 2})
        assert a.stats["buffered_groups"] == 2 and a.stats["buffered_batches"] == 1
        state = a.intake.state_dict()
        await s.client.submit(rewarded("b3", (1, 0), (0, 0)))  # after the checkpoint
        await until(lambda: s.acked == {1, 2, 3})
        m = a.intake.filter_metrics()
        assert m["rollout/filtered_groups"] == 4 and m["rollout/filtered_frac"] == 4 / 7
        assert a.intake.waste_metrics()["rollout/waste_frac"] == 0.0
    kept = ["b1-g0-0", "b1-g0-1", "b1-g2-0", "b3-g0-0", "b3-g0-1"]
    for resumed in (
        LearnerLink(config, tmp_path, state=state, journal_dir=journal),
        LearnerLink(config, tmp_path, journal_dir=journal),  # no checkpoint: the whole journal
    ):
        assert resumed.stats["buffered_groups"] == 3
        assert resumed.intake.filter_metrics()["rollout/filtered_groups"] == 4  # none twice
        taken = await resumed.intake.next_batch(3, 0, 10)
        assert sorted(ids(taken.trajectories)) == kept
        resumed.close()


async def test_a_step_short_after_max_num_gen_batches_stops_the_run(
    tiny_model: Path, tmp_path: Path
) -> None:
    """verl's bound: with max_num_gen_batches=1 a step of 2 groups may judge 2; one kept and one
    filtered leave it short, and waiting is refused with the key to change."""
    keys = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1")
    config = make_config(tiny_model, extra=(*keys, "data.train_batch_size=2"))
    link = LearnerLink(config, tmp_path)
    async with serving(link) as address, sending(address, tiny_model, token=link.token) as s:
        await s.client.submit(rewarded("b1", (0, 1), (1, 1)))
        await until(lambda: s.acked == {1})
        with (
            anyio.fail_after(10),
            pytest.raises(FilterGroupsExhausted, match="max_num_gen_batches"),
        ):
            await link.intake.next_batch(2, 0, 10)
