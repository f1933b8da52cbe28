"""The learner link's narrow parts on their own, with a fake protocol server (no socket): the weight
announcer, the admission part, the peer logs, and the link's dispatch table."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from common.logging import get_logger
from common.timeline import TimelineWriter
from learner.announcer import WeightAnnouncer
from learner.buffer import GroupBuffer
from learner.granting import Granting
from learner.link import LearnerLink
from learner.peer_logs import PeerLogs
from protocol.errors import ErrorCode, ProtocolError
from protocol.events import (
    BatchReceived,
    BatchRefused,
    PeerClosed,
    PeerError,
    PeerJoined,
    PeerTimedOut,
    PeerWeightsApplied,
    ProtocolViolation,
    ValidationAbandoned,
    ValidationReceived,
)
from protocol.messages import Error, WeightsApplied

if str(Path(__file__).resolve().parent) not in sys.path:  # test_intake's config (importlib mode)
    sys.path.append(str(Path(__file__).resolve().parent))
from test_intake import make_config

LOG = get_logger("test.link_parts")


class FakeServer:
    """What the parts call on ``protocol.driver.LearnerServer``, recorded."""

    def __init__(self) -> None:
        self.proto = SimpleNamespace(
            routing=SimpleNamespace(chunks_planned=False, file_peers_oldest_version=lambda: None),
            policy_version=0,
            admission=False,
            capacity=4,
            admission_peers=lambda: self.admission_peers,
        )
        self.admission_peers: list[str] = []
        self.published: list[tuple[int, str]] = []
        self.admitted: list[tuple[str, int, int]] = []

    def publish_weights(self, version: int, tensors: Any, *, chunk_bytes: int, file: str) -> None:
        self.proto.policy_version = version
        self.published.append((version, file))

    def admit(self, peer: str, n: int, min_version: int) -> bool:
        self.admitted.append((peer, n, min_version))
        return True


def joined(peer: str, version: int, slots: int = 0) -> PeerJoined:
    return PeerJoined(peer, SimpleNamespace(policy_version=version, slots=slots, epoch="e"))  # type: ignore[arg-type]


def applied(
    peer: str, version: int, ok: bool = True, apply_time_s: float = 0.5
) -> PeerWeightsApplied:
    return PeerWeightsApplied(peer, WeightsApplied(version, "t", ok, apply_time_s=apply_time_s))


def test_a_version_counts_as_applied_once_no_server_runs_an_older_one() -> None:
    server, announced = FakeServer(), []
    w = WeightAnnouncer(
        server,  # type: ignore[arg-type]
        chunk_bytes=1 << 20,
        timeline=TimelineWriter.off(),
        log=LOG,
        on_announced=announced.append,
    )
    w.on_joined(joined("a", 0))
    w.on_joined(joined("b", -1))  # asked for the current weights: no version until it applied
    assert w.peer_versions == {"a": 0}
    assert w.announce(1, [], file="/dev/shm/x") is False
    assert server.published == [(1, "/dev/shm/x")] and announced == [1]
    w.on_applied(applied("a", 1, apply_time_s=0.25))
    w.on_applied(applied("b", 0, ok=False))  # a failure changes nothing
    assert w.peer_versions == {"a": 1}
    m = w.metrics()
    assert (
        m["weights/version"] == 1 and m["weights/apply_s"] == 0.25 and m["weights/applied_s"] >= 0
    )
    assert w.metrics() == {}  # reported once
    w.announce(2, [])
    w.on_joined(joined("c", 1))
    w.on_applied(applied("a", 2))
    assert w.metrics() == {}  # c still runs 1
    w.on_left(PeerClosed("c", "bye"))
    w.on_applied(applied("b", 2, apply_time_s=0.75))
    assert w.metrics()["weights/apply_s"] == 0.75 and w.policy_version == 2


def test_without_configure_admission_is_a_no_op_and_every_step_may_go() -> None:
    server = FakeServer()
    g = Granting(server, GroupBuffer(), timeline=TimelineWriter.off(), log=LOG)  # type: ignore[arg-type]
    g.on_joined(joined("a", 0))
    g.trained(4)
    assert server.admitted == [] and g.generating == -1 and not g.idle()
    assert g.can_take([0, 0, 0], 5) and not g.on_left(PeerTimedOut("a"))


def test_admission_grants_on_join_and_takes_grants_away_with_a_leaver() -> None:
    server = FakeServer()
    g = Granting(server, GroupBuffer(), timeline=TimelineWriter.off(), log=LOG)  # type: ignore[arg-type]
    g.configure(batch_groups=2, max_staleness=1, remaining_groups=100)
    assert server.proto.admission and server.proto.capacity == 8  # room for 2 windows of 4
    server.admission_peers = ["a"]
    g.on_joined(joined("a", 0, slots=3))
    assert server.admitted == [("a", 3, 0)] and g.generating == 3
    # A server that takes no grants: nothing for it, and a waiting step must not count on it.
    g.on_joined(joined("b", 0))
    assert server.admitted == [("a", 3, 0)]
    assert not g.can_take([], 0)  # 3 groups generating, due at 1: one step of 2 left for them
    assert g.on_left(PeerClosed("a", "gone")) and g.generating == 0 and g.idle()
    g.closed = True
    server.admission_peers = ["c"]
    g.on_joined(joined("c", 0))
    assert server.admitted == [("a", 3, 0)]  # closed: no more grants


def test_peer_logs_count_everything_and_name_each_code() -> None:
    logs = PeerLogs(LOG, "token")
    err = ProtocolError(ErrorCode.INVALID_FIELD, "bad", field="x")
    for _ in range(3):
        logs.on_violation(ProtocolViolation("p", err))
    logs.on_error(PeerError("p", Error(1, "you sent junk")))
    logs.refused("tcp://1.2.3.4:5", "auth", "wrong token")
    m = logs.metrics()
    assert m["intake/violations"] == 3 and m["intake/violations/INVALID_FIELD"] == 3
    assert m["intake/refused_connections"] == 1
    st = logs.stats()
    assert st["violations"] == 3 and st["violations_invalid_field"] == 3
    logs.flush(all_windows=True)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # zmq.asyncio
async def test_the_link_routes_every_learner_event_kind_to_its_parts(
    tmp_path: Path, tiny_model: Path
) -> None:
    link = LearnerLink(make_config(tiny_model), tmp_path)
    try:
        assert set(link._routes) == {
            BatchReceived,
            BatchRefused,
            PeerJoined,
            PeerClosed,
            PeerTimedOut,
            PeerWeightsApplied,
            ValidationReceived,
            ValidationAbandoned,
            ProtocolViolation,
            PeerError,
        }
        # A join is heard by validation first (a round waiting for a server goes on), admission
        # last (its grants go out once the server's version is known).
        joined_by = link._routes[PeerJoined]
        assert joined_by[0] == link.validation.on_joined
        assert joined_by[-1] == link.admission.on_joined
    finally:
        link.close()
