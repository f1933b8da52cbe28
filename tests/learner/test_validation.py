"""Validation on the learner side without Ray: when it is due, the ``val/...`` metrics of a round,
and ``Validations.validate`` (the learner link's validation part) against rollout senders over
ZeroMQ (answers merged, a server that leaves mid-validation reported at once, a server without
the capability never asked, nobody connected bounded by the timeout, late answers ignored). asyncio only (zmq.asyncio)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from common.config import load_config
from common.identity import wire_identities
from learner.link import LearnerLink
from learner.validation import ValidationRound, due, validation_metrics
from protocol.driver import RolloutClient
from protocol.events import Event, ValidationRequested
from protocol.messages import VALIDATION_CAPABILITY, ValidateResult
from protocol.sender import RolloutConnection
from protocol.validation import EpisodeOutcome, summarize
from protocol.zmq_transport import client_factory


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def result(
    request_id: str, rewards: list[float], source: str = "math", **kw: Any
) -> ValidateResult:
    outcomes = [EpisodeOutcome(source, r, 10, 1, "answered", {"acc": r > 0}) for r in rewards]
    return ValidateResult(request_id, 2, sources=summarize(outcomes), **kw)


# -- schedule and metrics --------------------------------------------------------------------------------
def test_due() -> None:
    assert [s for s in range(0, 9) if due(s, 2)] == [2, 4, 6, 8]
    assert not any(due(s, f) for s in range(10) for f in (0, -1))
    assert [s for s in range(1, 5) if due(s, 1)] == [1, 2, 3, 4]


def test_metrics_merge_servers_by_counts_and_count_the_missing() -> None:
    rnd = ValidationRound("r", 2, asked=["a", "b", "c", "d"])
    rnd.answered("a", result("r", [1.0, 1.0, 0.0]))
    rnd.answered("b", result("r", [0.0], source="qa"))
    rnd.answered("c", ValidateResult("r", 2, ok=False, error="no weights"))
    rnd.left("d", "timed out")
    rnd.answered("stranger", result("r", [5.0]))  # not asked: ignored
    m = validation_metrics(rnd)
    assert m["val/count"] == 4 and m["val/reward/mean"] == 0.5
    assert (m["val/count/math"], m["val/reward/mean/math"]) == (3, pytest.approx(2 / 3))
    assert (m["val/count/qa"], m["val/reward/mean/qa"]) == (1, 0.0)
    assert m["val/extras/acc/mean/math"] == pytest.approx(2 / 3) and m["val/extras/acc/mean"] == 0.5
    assert m["val/episode/termination/answered"] == 1.0 and m["val/response/length_mean/qa"] == 10.0
    assert (
        m["val/servers_asked"],
        m["val/servers_answered"],
        m["val/servers_failed"],
        m["val/servers_missing"],
    ) == (4, 2, 1, 1)
    assert rnd.outstanding == [] and rnd.failed == {"c": "no weights"}
    empty = validation_metrics(ValidationRound("r", 0))
    assert empty["val/count"] == 0 and "val/reward/mean" not in empty


# -- LearnerLink.validation over ZeroMQ --------------------------------------------------------------
def make_config(model: Path) -> Any:
    return load_config(
        None,
        [
            f"actor_rollout_ref.model.path={model}",
            "data.train_files=unused.jsonl",
            "learner.bind_address=tcp://127.0.0.1:0",
            "transport.heartbeat_interval_s=0.2",
            "transport.heartbeat_timeout_s=3.0",
        ],
        check_paths=False,
    )


class Server:
    """A rollout sender that answers validation requests with ``answer(request)`` (None: stay silent)."""

    def __init__(
        self,
        address: str,
        model: Path,
        peer_id: str,
        *,
        validates: bool = True,
        answer: Callable[[Any], ValidateResult | None] | None = None,
        token: str | None = None,
    ) -> None:
        model_id, tok_id = wire_identities(model)
        self.conn = RolloutConnection(
            peer_id=peer_id,
            epoch=uuid.uuid4().hex,
            model=model_id,
            tokenizer=tok_id,
            capabilities=[VALIDATION_CAPABILITY] if validates else [],
            heartbeat_interval_s=0.2,
            heartbeat_timeout_s=3.0,
        )
        self.client = RolloutClient(
            self.conn, client_factory(address, token=token), reconnect_delay_s=0.05
        )
        self.answer = answer or (lambda req: result(req.request_id, [1.0, 0.0]))
        self.events: list[Event] = []

    async def drain(self) -> None:
        async for ev in self.client.events:
            self.events.append(ev)
            if isinstance(ev, ValidationRequested) and (res := self.answer(ev.request)) is not None:
                self.client.validation_result(res)

    @property
    def requests(self) -> list[str]:
        return [e.request.request_id for e in self.events if isinstance(e, ValidationRequested)]


@asynccontextmanager
async def serving(link: LearnerLink, *servers_args: dict[str, Any]) -> AsyncIterator[list[Server]]:
    async with anyio.create_task_group() as tg:
        address = await tg.start(link.run)
        servers = [Server(address, token=link.token, **kw) for kw in servers_args]
        async with anyio.create_task_group() as clients:
            for s in servers:
                await clients.start(s.client.run)
                clients.start_soon(s.drain)
            with anyio.fail_after(10):
                while len(link._proto.ready_peers()) < len(servers):
                    await anyio.sleep(0.01)
            try:
                yield servers
            finally:
                clients.cancel_scope.cancel()
                link.close()


@pytest.mark.anyio
async def test_validate_merges_the_answers_of_the_servers_that_offer_it(
    tmp_path: Path, tiny_model: Path
) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path, fresh=True)
    async with serving(
        link,
        {"model": tiny_model, "peer_id": "a"},
        {"model": tiny_model, "peer_id": "b"},
        {"model": tiny_model, "peer_id": "old", "validates": False},
    ) as (a, b, old):
        rnd = await link.validation.validate(3, timeout_s=10.0, request_id="step2-x")
        assert (
            sorted(rnd.asked) == ["a", "b"]
            and sorted(rnd.results) == ["a", "b"]
            and rnd.duration_s < 5
        )
        m = validation_metrics(rnd)
        assert (
            m["val/count"] == 4
            and m["val/reward/mean/math"] == 0.5
            and m["val/servers_missing"] == 0
        )
        assert a.requests == b.requests == ["step2-x"] and old.requests == []
        assert link.stats["batches"] == 0 and link._proto.buffered == 0  # no trajectories, no room


@pytest.mark.anyio
async def test_a_server_that_leaves_mid_validation_does_not_hang_the_learner(
    tmp_path: Path, tiny_model: Path
) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path, fresh=True)
    silent = {"model": tiny_model, "peer_id": "silent", "answer": lambda req: None}
    async with serving(link, {"model": tiny_model, "peer_id": "ok"}, silent) as (_, quitter):

        async def leave_soon() -> None:
            while not quitter.requests:
                await anyio.sleep(0.01)
            await quitter.client.close("going away mid-validation")

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(leave_soon)
            rnd = await link.validation.validate(0, timeout_s=30.0)
        assert time.monotonic() - t0 < 5, "the learner waited for a server that had left"
        assert list(rnd.results) == ["ok"] and rnd.lost == {"silent": "closed"}
        assert validation_metrics(rnd)["val/servers_missing"] == 1


@pytest.mark.anyio
async def test_timeouts_bound_the_wait(tmp_path: Path, tiny_model: Path) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path, fresh=True)
    mute = {"model": tiny_model, "peer_id": "mute", "answer": lambda req: None}
    async with anyio.create_task_group() as tg:
        await tg.start(link.run)
        t0 = time.monotonic()
        # no rollout server connected at all
        nobody = await link.validation.validate(0, timeout_s=0.5)
        assert nobody.asked == [] and 0.4 < time.monotonic() - t0 < 3
        link.close()
    link = LearnerLink(make_config(tiny_model), tmp_path / "2", fresh=True)
    async with serving(link, mute) as (server,):
        rnd = await link.validation.validate(0, timeout_s=0.5)
        assert rnd.asked == ["mute"] and rnd.outstanding == ["mute"] and rnd.results == {}
        server.client.validation_result(result(rnd.request_id, [1.0]))  # late: logged, ignored
        await anyio.sleep(0.3)
        assert rnd.results == {}


@pytest.mark.anyio
async def test_validate_waits_for_the_first_server_to_join(
    tmp_path: Path, tiny_model: Path
) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path, fresh=True)
    async with anyio.create_task_group() as tg:
        address = await tg.start(link.run)
        server = Server(address, tiny_model, "late", token=link.token)

        async def join_later() -> None:
            await anyio.sleep(0.5)
            await tg.start(server.client.run)
            tg.start_soon(server.drain)

        tg.start_soon(join_later)
        rnd = await link.validation.validate(0, timeout_s=20.0)
        assert rnd.asked == ["late"] and rnd.results["late"].count == 2
        tg.cancel_scope.cancel()
        link.close()


@pytest.mark.anyio
async def test_servers_without_the_capability_are_not_waited_for(
    tmp_path: Path, tiny_model: Path
) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path, fresh=True)
    async with serving(link, {"model": tiny_model, "peer_id": "old", "validates": False}) as (old,):
        t0 = time.monotonic()
        rnd = await link.validation.validate(0, timeout_s=30.0)
        assert rnd.asked == [] and time.monotonic() - t0 < 2 and old.requests == []
        assert validation_metrics(rnd)["val/count"] == 0


def test_shards_missing_counts_the_shards_no_ok_answer_covered() -> None:
    rnd = ValidationRound("r", 0, asked=["a", "b"])
    assert rnd.shards_missing == 0  # nothing to judge by
    rnd.answered("a", result("r", [1.0], shard_index=0, shard_count=3))
    assert rnd.shards_missing == 2
    rnd.answered("b", ValidateResult("r", 0, ok=False, error="x", shard_index=1, shard_count=3))
    assert rnd.shards_missing == 2  # a failed answer covers nothing
    rnd.ask_more(["b", "c"])  # b rejoined and was asked again, c joined
    assert rnd.asked == ["a", "b", "c"] and rnd.outstanding == ["b", "c"]
    rnd.answered("b", result("r", [1.0], shard_index=1, shard_count=3))
    rnd.answered("c", result("r", [1.0], shard_index=2, shard_count=3))
    assert rnd.shards_missing == 0 and validation_metrics(rnd)["val/shards_missing"] == 0
    rnd.answered("c", result("r", [1.0], shard_index=0, shard_count=1))  # they disagree: not judged
    assert rnd.shards_missing == 0


def shard(index: int, count: int = 2) -> Callable[[Any], ValidateResult]:
    return lambda req: result(req.request_id, [1.0, 0.0], shard_index=index, shard_count=count)


@pytest.mark.anyio
async def test_a_server_that_joins_mid_round_is_asked_and_its_shard_waited_for(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Before the first step the second server's engine may still be loading when the first one
    answers: the round asks it once it joins and waits (bounded) for its shard."""
    link = LearnerLink(make_config(tiny_model), tmp_path, fresh=True)
    async with serving(link, {"model": tiny_model, "peer_id": "a", "answer": shard(0)}) as (a,):
        async with anyio.create_task_group() as tg:
            late = Server(link.address, tiny_model, "b", answer=shard(1), token=link.token)

            async def join_after_a_answered() -> None:
                while not a.requests:
                    await anyio.sleep(0.01)
                await anyio.sleep(0.5)
                await tg.start(late.client.run)
                tg.start_soon(late.drain)

            tg.start_soon(join_after_a_answered)
            rnd = await link.validation.validate(
                0, timeout_s=30.0, request_id="step0-x", shard_wait_s=20
            )
            assert rnd.asked == ["a", "b"] and sorted(rnd.results) == ["a", "b"]
            assert late.requests == ["step0-x"] and rnd.duration_s < 10
            m = validation_metrics(rnd)
            assert m["val/count"] == 4 and m["val/shards_missing"] == 0
            tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_wait_for_an_uncovered_shard_is_bounded(tmp_path: Path, tiny_model: Path) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path, fresh=True)
    async with serving(link, {"model": tiny_model, "peer_id": "a", "answer": shard(0)}):
        t0 = time.monotonic()
        rnd = await link.validation.validate(0, timeout_s=30.0, shard_wait_s=0.5)
        assert 0.4 < time.monotonic() - t0 < 5 and rnd.shards_missing == 1
        assert validation_metrics(rnd)["val/shards_missing"] == 1
        t0 = time.monotonic()
        rnd = await link.validation.validate(0, timeout_s=30.0)  # shard_wait_s 0: not at all
        assert time.monotonic() - t0 < 2 and list(rnd.results) == ["a"]
