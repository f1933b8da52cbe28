"""Shipper and recordings against a real learner: ZeroMQ over TCP loopback to ``ReferenceLearner``.

asyncio only (the ZeroMQ channels use ``zmq.asyncio``). A learner that is "down" is an address
nobody listens on: the client's HELLO waits in its socket and nothing is ever acknowledged.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest

from protocol.driver import RolloutClient
from protocol.events import Connected, Event, WeightsReceived
from protocol.reference import (
    REFERENCE_MODEL,
    REFERENCE_TOKENIZER,
    ReferenceLearner,
    synthetic_trajectory,
)
from protocol.sender import RolloutConnection, encode_batch
from protocol.trajectory import Trajectory
from protocol.version import ProtocolVersion
from protocol.zmq_transport import client_factory
from rollout_service.data import PromptSource, Source
from rollout_service.metrics import RolloutStats
from rollout_service.recording import BatchFileError, Recorder, read_recording, write_batch_file
from rollout_service.shipping import Shipper, ShippingError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


_rng = np.random.default_rng(0)


def group(uid: str, n: int = 3) -> list[Trajectory]:
    return [
        dataclasses.replace(
            synthetic_trajectory(_rng, server="rs", prompt_len=8, response_len=12), group_uid=uid
        )
        for _ in range(n)
    ]


def dead_address() -> str:
    with socket.socket() as s:  # a port that was free a moment ago; nobody will listen on it
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def make_client(address: str, **conn_kw: object) -> RolloutClient:
    conn = RolloutConnection(
        peer_id="rs-test",
        epoch=uuid.uuid4().hex,
        model=REFERENCE_MODEL,
        tokenizer=REFERENCE_TOKENIZER,
        **conn_kw,
    )  # type: ignore[arg-type]
    return RolloutClient(conn, client_factory(address), reconnect_delay_s=0.05)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.01)


@asynccontextmanager
async def learner_up() -> AsyncIterator[ReferenceLearner]:
    learner = ReferenceLearner()
    async with anyio.create_task_group() as tg:
        await tg.start(learner.serve)
        yield learner
        tg.cancel_scope.cancel()


@asynccontextmanager
async def shipper_running(
    client: RolloutClient, spool: Path, events: list[Event] | None = None, **kw: object
) -> AsyncIterator[Shipper]:
    """Runs a shipper and reads its events; leaving the block cancels it, like a killed process."""
    shipper = Shipper(client, spool_dir=spool, server_id="rs-test", **kw)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(shipper.run)

        async def read_events() -> None:
            async for ev in shipper.events:
                (events if events is not None else []).append(ev)

        tg.start_soon(read_events)
        yield shipper
        tg.cancel_scope.cancel()


def spool_files(spool: Path) -> list[Path]:
    return sorted(spool.glob("batch-*.msgpack"))


async def test_groups_arrive_once_spool_empties_and_callbacks_run(tmp_path: Path) -> None:
    spool, acked = tmp_path / "spool", []
    stats = RolloutStats(server_id="rs-test")
    groups = [group(f"g{i}") for i in range(7)]
    async with (
        learner_up() as learner,
        shipper_running(
            make_client(learner.address), spool, groups_per_batch=2, stats=stats
        ) as shipper,
    ):
        for i, g in enumerate(groups):
            await shipper.ship_group(g, on_acked=lambda i=i: acked.append(i))
        await shipper.drain()  # the 7th group goes out alone on the flush
        assert shipper.unacked == 0 and spool_files(spool) == []
        sent = [t.trajectory_id for g in groups for t in g]
        await until(lambda: len(learner.received) >= len(sent))
        assert [t.trajectory_id for t in learner.received] == sent  # in order, each exactly once
        assert {t.group_uid for t in learner.received} == {f"g{i}" for i in range(7)}
        assert sorted(acked) == list(range(7))
        c = stats.counters
        assert (c.batches_shipped, c.batches_acked, c.trajectories_shipped) == (4, 4, 21)
        assert (stats.gauges.spool_batches, stats.gauges.unacked_batches) == (0, 0)


async def test_killed_shipper_spools_and_next_one_resends_each_trajectory_once(
    tmp_path: Path,
) -> None:
    spool, acked = tmp_path / "spool", []
    groups = [group(f"g{i}", n=2) for i in range(8)]
    async with shipper_running(make_client(dead_address()), spool, max_unacked_batches=3) as first:
        async with anyio.create_task_group() as tg:
            for i, g in enumerate(groups):  # eight episodes finish at once
                tg.start_soon(
                    lambda i=i, g=g: first.ship_group(g, on_acked=lambda: acked.append(i))
                )
            await until(lambda: len(spool_files(spool)) == 3)
            with anyio.move_on_after(0.3):  # back-pressure: no fourth batch while three are unacked
                await until(lambda: len(spool_files(spool)) > 3)
            assert len(spool_files(spool)) == 3 and first.unacked == 3
            tg.cancel_scope.cancel()  # the process dies with five groups still waiting
    assert acked == [] and len(spool_files(spool)) == 3

    recovered: list[str] = []
    async with (
        learner_up() as learner,
        shipper_running(
            make_client(learner.address), spool, on_recovered_acked=recovered.extend
        ) as second,
    ):
        assert second.recovered_group_uids == {"g0", "g1", "g2"}  # scheduled first
        extra = group("new")
        await second.ship_group(extra)
        await second.drain()
        assert spool_files(spool) == []
        expected = [t.trajectory_id for g in [*groups[:3], extra] for t in g]
        await until(lambda: len(learner.received) >= len(expected))
        assert [t.trajectory_id for t in learner.received] == expected
        assert np.array_equal(learner.received[0].response_ids, groups[0][0].response_ids)
        assert sorted(recovered) == ["g0", "g1", "g2"]
    assert acked == []  # the callbacks died with the first process


async def test_resent_batch_already_delivered_is_deduplicated(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    g = group("dup")
    async with learner_up() as learner:
        async with shipper_running(make_client(learner.address), spool) as first:
            await first.ship_group(g)
            await first.drain()
        # The learner got it but the process died before the ACK reached it: the file is back.
        write_batch_file(
            spool / "batch-0000000007.msgpack",
            encode_batch(7, g),
            server_id="rs-test",
            seq=7,
            durable=True,
        )
        async with shipper_running(make_client(learner.address), spool) as second:
            await second.drain()
            assert spool_files(spool) == []
            await second.ship_group(group("after"))
            await second.drain()
            await until(lambda: len(learner.received) >= 6)
        assert [t.group_uid for t in learner.received] == ["dup"] * 3 + ["after"] * 3


async def test_damaged_spool_file_is_set_aside(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "batch-0000000001.msgpack").write_bytes(b"\x93garbage")
    (spool / ".batch-0000000002.msgpack.tmp-99").write_bytes(b"half")  # a crash mid-write
    async with (
        learner_up() as learner,
        shipper_running(make_client(learner.address), spool) as shipper,
    ):
        assert shipper.unacked == 0
        assert (spool / "corrupt" / "batch-0000000001.msgpack").exists()
        assert not (spool / ".batch-0000000002.msgpack.tmp-99").exists()
        await shipper.ship_group(group("ok"))
        await shipper.drain()
        assert spool_files(spool) == []


async def test_weights_and_connection_events_reach_the_owner(tmp_path: Path) -> None:
    events: list[Event] = []
    async with learner_up() as learner:
        client = make_client(learner.address)
        client.request_weights = True
        async with shipper_running(client, tmp_path / "spool", events) as shipper:
            await until(lambda: any(isinstance(e, WeightsReceived) for e in events))
            assert isinstance(events[0], Connected)
            w = next(e for e in events if isinstance(e, WeightsReceived)).weights
            client.weights_applied(w.version, w.transfer_id, ok=True)
            await shipper.ship_group(group("w"))
            await shipper.drain()


async def test_refused_handshake_stops_the_shipper_with_an_error(tmp_path: Path) -> None:
    async with learner_up() as learner:
        shipper = Shipper(
            make_client(learner.address, version=ProtocolVersion(99, 0)),
            spool_dir=tmp_path / "spool",
            server_id="rs-test",
        )
        with (
            pytest.raises(ShippingError, match=r"learner refused this server: .*protocol 99\.0"),
            anyio.fail_after(10),
        ):
            await shipper.run()  # the few events (the ERROR) fit the buffer unread
        with pytest.raises(ShippingError):
            await shipper.ship_group(group("late"))


async def test_recording_round_trips_through_read_recording(tmp_path: Path) -> None:
    rec_dir, groups = tmp_path / "rec", [group(f"r{i}") for i in range(4)]
    async with (
        learner_up() as learner,
        shipper_running(
            make_client(learner.address),
            tmp_path / "spool",
            groups_per_batch=2,
            recorder=Recorder(rec_dir, "rs-test"),
        ) as shipper,
    ):
        for g in groups:
            await shipper.ship_group(g)
        await shipper.drain()
    batches = list(read_recording(rec_dir))
    assert [(m.seq, m.server_id, m.format) for m, _ in batches] == [
        (1, "rs-test", 2),
        (2, "rs-test", 2),
    ]
    replayed = [t for _, ts in batches for t in ts]
    shipped = [t for g in groups for t in g]
    assert [t.trajectory_id for t in replayed] == [t.trajectory_id for t in shipped]
    for a, b in zip(replayed, shipped, strict=True):
        assert np.array_equal(a.prompt_ids, b.prompt_ids) and np.array_equal(
            a.rollout_logprobs, b.rollout_logprobs
        )
        assert (a.reward, a.group_uid, a.reward_extras) == (
            pytest.approx(b.reward),
            b.group_uid,
            b.reward_extras,
        )
    # A second recorder on the same directory appends after the existing files.
    assert Recorder(rec_dir, "rs-test")._next == 3
    bad = rec_dir / "batch-0000000009.msgpack"
    bad.write_bytes(b"\x81\xa6format\x03")
    with pytest.raises(BatchFileError, match="format 3"):
        list(read_recording(bad))


async def test_server_restart_with_data_cursor_ships_every_prompt_once(tmp_path: Path) -> None:
    """The data cursor and the spool together: prompts whose groups were spooled by the dead
    process are neither rerun nor lost; those in flight (not spooled) are rerun."""
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"q{i}?", "answer": i}) + "\n" for i in range(6))
    )
    state, spool = tmp_path / "state", tmp_path / "spool"

    def source() -> PromptSource:
        return PromptSource([Source((str(data),))], seed=1, state_dir=state, max_epochs=1)

    first_source = source()
    async with shipper_running(make_client(dead_address()), spool, max_unacked_batches=2) as first:
        async with anyio.create_task_group() as tg:
            for item in list(first_source)[:4]:  # four episodes finish; the learner is down
                tg.start_soon(
                    lambda item=item: first.ship_group(
                        group(item.group_uid), on_acked=lambda: first_source.commit(item)
                    )
                )
            await until(lambda: len(spool_files(spool)) == 2)
            tg.cancel_scope.cancel()

    second_source = source()
    assert second_source.cursor == (0, 0)  # nothing was acknowledged
    settled: list[str] = []

    def recovered_acked(uids: list[str]) -> None:
        settled.extend(uids)
        for uid in uids:
            second_source.commit_group(uid)

    async with (
        learner_up() as learner,
        shipper_running(
            make_client(learner.address), spool, on_recovered_acked=recovered_acked
        ) as second,
    ):
        # Their ACKs may already be in: those count as done rather than held.
        assert second_source.hold_groups(second.recovered_group_uids) == 2 - len(settled)
        rest = list(second_source)
        assert len(rest) == 4 and not {it.group_uid for it in rest} & second.recovered_group_uids
        for item in rest:
            await second.ship_group(
                group(item.group_uid), on_acked=lambda item=item: second_source.commit(item)
            )
        await second.drain()
        await until(lambda: len(learner.received) >= 18)
        uids = [t.group_uid for t in learner.received]
        assert sorted(set(uids)) == sorted(f"e0-i{i}" for i in range(6)) and len(uids) == 18
    assert second_source.cursor == (1, 0) and source().cursor == (1, 0)  # persisted: epoch 0 done
