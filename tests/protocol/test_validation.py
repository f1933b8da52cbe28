"""Validation messages (1.1): VALIDATE_REQUEST / VALIDATE_RESULT on the wire, their field checks,
the capability rule, both state machines (who may send what when, abandonment when a peer leaves)
and the metric helpers both sides share (``protocol.validation``)."""

from __future__ import annotations

import math

import msgpack
import pytest
from protocol_testkit import (
    Net,
    header,
    learner,
    on_wire,
    rollout,
    sample_messages,
    source_metrics,
    with_header,
)

from protocol import codec
from protocol.errors import ErrorCode, ProtocolError
from protocol.events import (
    PeerClosed,
    PeerJoined,
    PeerTimedOut,
    ProtocolViolation,
    ValidationAbandoned,
    ValidationReceived,
    ValidationRequested,
)
from protocol.messages import (
    VALIDATION_CAPABILITY,
    MsgType,
    SourceMetrics,
    ValidateRequest,
    ValidateResult,
)
from protocol.sender import SenderState
from protocol.validation import EpisodeOutcome, merge, summarize, total
from protocol.version import PROTOCOL_VERSION, ProtocolVersion

SAMPLES = sample_messages()
CAP = [VALIDATION_CAPABILITY]


# -- wire ------------------------------------------------------------------------------------------
def test_new_types_are_appended_and_the_version_is_1_1() -> None:
    assert [(t.name, t.value) for t in MsgType][10:12] == [
        ("VALIDATE_REQUEST", 11),
        ("VALIDATE_RESULT", 12),
    ]
    assert PROTOCOL_VERSION >= ProtocolVersion(1, 1)


@pytest.mark.parametrize(
    "t", [MsgType.VALIDATE_REQUEST, MsgType.VALIDATE_RESULT], ids=lambda t: t.name
)
def test_round_trip_with_every_field(t: MsgType) -> None:
    msg = SAMPLES[t]
    frames = on_wire(codec.encode(msg))
    assert len(frames) == 2 and frames[0] == bytes((t,))
    assert codec.decode(frames) == msg
    assert on_wire(codec.encode(codec.decode(frames))) == frames


def test_result_layout_and_defaults() -> None:
    frames = on_wire(codec.encode(SAMPLES[MsgType.VALIDATE_RESULT]))
    h = header(frames)
    assert list(h) == [
        "request_id",
        "policy_version",
        "ok",
        "error",
        "sources",
        "shard_index",
        "shard_count",
        "prompts",
        "duration_s",
    ]
    assert list(h["sources"][0]) == [
        "data_source",
        "count",
        "reward_sum",
        "reward_mean",
        "response_length_mean",
        "turns_mean",
        "terminations",
        "extras_mean",
        "extras_count",
    ]
    minimal = with_header(frames, {"request_id": "r", "policy_version": 0})
    back = codec.decode(minimal)
    assert back == ValidateResult("r", 0) and back.ok and back.sources == [] and back.count == 0
    req = codec.decode(
        [
            bytes((MsgType.VALIDATE_REQUEST,)),
            msgpack.packb({"request_id": "r", "policy_version": 3}),
        ]
    )
    assert req == ValidateRequest("r", 3, 0.0)


def _sources(h: dict, i: int = 0, **changes: object) -> dict:
    h["sources"][i].update(changes)
    return h


BAD = [
    (MsgType.VALIDATE_REQUEST, lambda h: h.update(request_id=""), "VALIDATE_REQUEST.request_id"),
    (
        MsgType.VALIDATE_REQUEST,
        lambda h: h.update(request_id="x" * 129),
        "VALIDATE_REQUEST.request_id",
    ),
    (MsgType.VALIDATE_REQUEST, lambda h: h.update(request_id=7), "VALIDATE_REQUEST.request_id"),
    (
        MsgType.VALIDATE_REQUEST,
        lambda h: h.update(policy_version=-1),
        "VALIDATE_REQUEST.policy_version",
    ),
    (
        MsgType.VALIDATE_REQUEST,
        lambda h: h.update(policy_version=True),
        "VALIDATE_REQUEST.policy_version",
    ),
    (MsgType.VALIDATE_REQUEST, lambda h: h.update(timeout_s=-1.0), "VALIDATE_REQUEST.timeout_s"),
    (
        MsgType.VALIDATE_REQUEST,
        lambda h: h.update(timeout_s=math.nan),
        "VALIDATE_REQUEST.timeout_s",
    ),
    (
        MsgType.VALIDATE_REQUEST,
        lambda h: h.pop("policy_version"),
        "VALIDATE_REQUEST.policy_version",
    ),
    (MsgType.VALIDATE_RESULT, lambda h: h.pop("request_id"), "VALIDATE_RESULT.request_id"),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: h.update(policy_version=-2),
        "VALIDATE_RESULT.policy_version",
    ),
    (MsgType.VALIDATE_RESULT, lambda h: h.update(ok=1), "VALIDATE_RESULT.ok"),
    (MsgType.VALIDATE_RESULT, lambda h: h.update(sources={"math": {}}), "VALIDATE_RESULT.sources"),
    (MsgType.VALIDATE_RESULT, lambda h: h.update(shard_index=2), "VALIDATE_RESULT.shard_index"),
    (MsgType.VALIDATE_RESULT, lambda h: h.update(shard_count=0), "VALIDATE_RESULT.shard_index"),
    (MsgType.VALIDATE_RESULT, lambda h: h.update(prompts=-1), "VALIDATE_RESULT.prompts"),
    (MsgType.VALIDATE_RESULT, lambda h: _sources(h, count=-1), "VALIDATE_RESULT.sources[0].count"),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, 1, reward_sum=1.0),
        "VALIDATE_RESULT.sources[1].reward_sum",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, reward_mean=0.9),
        "VALIDATE_RESULT.sources[0].reward_mean",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, reward_sum=math.inf),
        "VALIDATE_RESULT.sources[0].reward_sum",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, turns_mean=-1.0),
        "VALIDATE_RESULT.sources[0].turns_mean",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, terminations={"answered": "4"}),
        "VALIDATE_RESULT.sources[0].terminations.answered",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, terminations={"answered": -1}),
        "VALIDATE_RESULT.sources[0].terminations.answered",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, terminations={"answered": 3, "length": 2}),
        "VALIDATE_RESULT.sources[0].terminations",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, extras_count={"acc": 5}),
        "VALIDATE_RESULT.sources[0].extras_count.acc",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, extras_count={}),
        "VALIDATE_RESULT.sources[0].extras_count.acc",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, extras_mean={"acc": "high"}),
        "VALIDATE_RESULT.sources[0].extras_mean.acc",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: _sources(h, 1, data_source="math"),
        "VALIDATE_RESULT.sources[1].data_source",
    ),
    (
        MsgType.VALIDATE_RESULT,
        lambda h: h["sources"][0].pop("data_source"),
        "VALIDATE_RESULT.sources[0].data_source",
    ),
]


@pytest.mark.parametrize(
    ("t", "edit", "field"), BAD, ids=[f"{t.name}-{i}" for i, (t, _, _) in enumerate(BAD)]
)
def test_invalid_fields_are_named(t: MsgType, edit, field: str) -> None:
    frames = on_wire(codec.encode(SAMPLES[t]))
    h = header(frames)
    edit(h)
    with pytest.raises(ProtocolError) as info:
        codec.decode(with_header(frames, h))
    e = info.value
    assert e.code is ErrorCode.INVALID_FIELD and e.field == field, (e.field, e.message)
    assert e.ref_type == t and field in e.message


def test_payload_frames_on_validation_messages_are_malformed() -> None:
    for t in (MsgType.VALIDATE_REQUEST, MsgType.VALIDATE_RESULT):
        with pytest.raises(ProtocolError) as info:
            codec.decode([*on_wire(codec.encode(SAMPLES[t])), b"extra"])
        assert info.value.code is ErrorCode.MALFORMED


def test_local_construction_checks_the_same_rules() -> None:
    with pytest.raises(ValueError, match="request_id"):
        ValidateRequest("", 0)
    with pytest.raises(ValueError, match="reward_mean"):
        SourceMetrics("s", 2, 1.0, 0.75)


# -- state machines ----------------------------------------------------------------------------------
def net_with(*capabilities: list[str]) -> Net:
    """A learner and one rollout connection per capability list (identities r0, r1, ...)."""
    net = Net(learner(capacity=16, max_credits_per_peer=4))
    for i, caps in enumerate(capabilities):
        net.add(f"r{i}".encode(), rollout(f"rollout-{i}", capabilities=caps))
    net.pump()
    assert all(c.state is SenderState.READY for c in net.conns.values())
    return net


def answer(net: Net, ident: bytes, request: ValidateRequest, **kw: object) -> bool:
    result = ValidateResult(
        request.request_id, request.policy_version, sources=[source_metrics()], **kw
    )
    return net.conns[ident].validation_result(result)


def test_request_goes_only_to_peers_that_offer_validation_and_the_result_comes_back() -> None:
    net = net_with(CAP, [], ["other", VALIDATION_CAPABILITY])
    assert net.learner.validation_peers() == ["rollout-0", "rollout-2"]
    assert net.learner.request_validation("val-1", 3, timeout_s=60.0) == ["rollout-0", "rollout-2"]
    net.pump()
    assert {r.identity for r in net.sent("down", MsgType.VALIDATE_REQUEST)} == {b"r0", b"r2"}
    (ev,) = net.events(b"r0", ValidationRequested)
    assert ev.request == ValidateRequest("val-1", 3, 60.0)
    assert net.conns[b"r0"].validations_pending == {"val-1"}
    assert not net.events(b"r1", ValidationRequested)
    assert answer(net, b"r0", ev.request)
    net.pump()
    (got,) = net.learner_events_of(ValidationReceived)
    assert got.peer_id == "rollout-0" and got.result.request_id == "val-1" and got.result.count == 4
    assert net.conns[b"r0"].validations_pending == set()
    assert not answer(net, b"r0", ev.request), "a request is answered once"
    assert not net.learner_events_of(ProtocolViolation)


def test_the_same_request_is_sent_to_a_peer_once() -> None:
    net = net_with(CAP)
    assert net.learner.request_validation("val-1", 0) == ["rollout-0"]
    assert net.learner.request_validation("val-1", 0) == []
    net.pump()
    assert len(net.sent("down", MsgType.VALIDATE_REQUEST)) == 1


def test_unsolicited_or_repeated_result_is_unexpected_and_the_session_goes_on() -> None:
    net = net_with(CAP)
    result = on_wire(codec.encode(ValidateResult("never-asked", 0)))
    (ev,) = net.learner.receive(b"r0", result, net.clock.now)
    assert isinstance(ev, ProtocolViolation) and ev.error.code is ErrorCode.UNEXPECTED
    assert "never-asked" in ev.error.message
    (frames,) = [f for i, f in net.learner.data_to_send(net.clock.now) if i == b"r0"]
    err = codec.decode(frames)
    assert err.code == ErrorCode.UNEXPECTED and err.ref_type == MsgType.VALIDATE_RESULT
    net.learner.request_validation("val-2", 0)
    net.pump()
    assert answer(net, b"r0", net.events(b"r0", ValidationRequested)[0].request)
    net.pump()
    assert len(net.learner_events_of(ValidationReceived)) == 1
    again = on_wire(codec.encode(ValidateResult("val-2", 0)))
    (ev,) = net.learner.receive(b"r0", again, net.clock.now)
    assert isinstance(ev, ProtocolViolation) and ev.error.code is ErrorCode.UNEXPECTED
    assert net.learner.ready_peers() == ["rollout-0"]


def test_a_server_without_the_capability_refuses_the_request() -> None:
    net = net_with([])
    conn = net.conns[b"r0"]
    events = conn.receive(on_wire(codec.encode(ValidateRequest("v", 0))), net.clock.now)
    assert [type(e) for e in events] == [ProtocolViolation] and events[
        0
    ].error.code is ErrorCode.UNEXPECTED
    (frames,) = conn.data_to_send(net.clock.now)
    assert codec.decode(frames).code == ErrorCode.UNEXPECTED
    assert conn.state is SenderState.READY


def test_a_result_for_a_session_that_ended_is_dropped() -> None:
    net = net_with(CAP)
    net.learner.request_validation("val-1", 0)
    net.pump()
    conn = net.conns[b"r0"]
    (ev,) = net.events(b"r0", ValidationRequested)
    net.drop = lambda d, i, f: True  # silence both ways: both sides time out
    net.run_for(11.0)
    assert conn.state is SenderState.IDLE
    assert [type(e) for e in net.learner_events[-2:]] == [PeerTimedOut, ValidationAbandoned]
    net.drop = None
    net.reconnect_idle()
    net.pump()
    assert conn.state is SenderState.READY
    assert not answer(net, b"r0", ev.request)  # the new session never asked
    net.pump()
    assert not net.sent("up", MsgType.VALIDATE_RESULT)


def test_a_peer_that_leaves_abandons_its_requests() -> None:
    net = net_with(CAP, CAP)
    net.learner.request_validation("val-a", 1)
    net.learner.request_validation("val-b", 1)
    net.pump()
    net.conns[b"r0"].close("bye")
    net.pump()
    closed = net.learner_events[-3:]
    assert [type(e) for e in closed] == [PeerClosed, ValidationAbandoned, ValidationAbandoned]
    assert [(e.peer_id, e.request_id, e.reason) for e in closed[1:]] == [
        ("rollout-0", "val-a", "closed"),
        ("rollout-0", "val-b", "closed"),
    ]
    # rollout-1 reconnects under a new identity (a new socket): its old session's requests are gone
    net.add(b"r1-new", rollout("rollout-1", capabilities=CAP))
    net.pump()
    joined = [e for e in net.learner_events if isinstance(e, ValidationAbandoned | PeerJoined)][-3:]
    assert [type(e) for e in joined] == [ValidationAbandoned, ValidationAbandoned, PeerJoined]
    assert {e.reason for e in joined[:2]} == {"replaced by a new session"}
    # answered requests are not abandoned
    net.learner.request_validation("val-c", 1)
    net.pump()
    assert answer(net, b"r1-new", net.events(b"r1-new", ValidationRequested)[0].request)
    net.pump()
    net.conns[b"r1-new"].close()
    net.pump()
    assert not [e for e in net.learner_events[-2:] if isinstance(e, ValidationAbandoned)]


def test_a_1_0_server_interoperates_and_is_never_asked() -> None:
    net = Net(learner())
    net.add(b"old", rollout("old-server", version=ProtocolVersion(1, 0)))
    net.pump()
    assert net.conns[b"old"].state is SenderState.READY
    assert net.learner.request_validation("val-1", 0) == []
    net.pump()
    assert not net.sent("down", MsgType.VALIDATE_REQUEST)


def test_failed_result_is_delivered_as_is() -> None:
    net = net_with(CAP)
    net.learner.request_validation("val-1", 5)
    net.pump()
    res = ValidateResult("val-1", 4, ok=False, error="weights version 5 not applied within 1 s")
    assert net.conns[b"r0"].validation_result(res)
    net.pump()
    (got,) = net.learner_events_of(ValidationReceived)
    assert got.result == res and not got.result.ok


# -- metric helpers ------------------------------------------------------------------------------------
def test_summarize_groups_by_source_and_keeps_numeric_extras() -> None:
    outcomes = [
        EpisodeOutcome(
            "math", 1.0, 10, 2, "answered", {"acc": True, "judge": "exact", "bad": math.nan}
        ),
        EpisodeOutcome("math", 0.0, 20, 1, "length", {"acc": False}),
        EpisodeOutcome("qa", 0.5, 4, 1, "answered", {"f1": 0.5}),
    ]
    math_m, qa_m = summarize(outcomes)
    assert math_m == SourceMetrics(
        "math", 2, 1.0, 0.5, 15.0, 1.5, {"answered": 1, "length": 1}, {"acc": 0.5}, {"acc": 2}
    )
    assert (qa_m.data_source, qa_m.count, qa_m.extras_mean) == ("qa", 1, {"f1": 0.5})
    assert summarize([]) == []


def test_merge_weights_by_counts_and_skips_failed_results() -> None:
    a = ValidateResult(
        "v", 1, sources=summarize([EpisodeOutcome("math", 1.0, 10, 1, extras={"acc": 1})] * 3)
    )
    b = ValidateResult(
        "v", 1, sources=summarize([EpisodeOutcome("math", 0.0, 30, 3, "length", {"acc": 0})])
    )
    c = ValidateResult("v", 1, sources=summarize([EpisodeOutcome("qa", 0.25, 2, 1)]))
    failed = ValidateResult(
        "v", 1, ok=False, error="x", sources=summarize([EpisodeOutcome("math", 100.0)])
    )
    merged = merge([a, b, c, failed])
    assert list(merged) == ["math", "qa"]
    m = merged["math"]
    assert (m.count, m.reward_mean, m.response_length_mean, m.turns_mean) == (4, 0.75, 15.0, 1.5)
    assert m.terminations == {"answered": 3, "length": 1} and m.extras_mean == {"acc": 0.75}
    everything = total(merged.values())
    assert (everything.data_source, everything.count, everything.reward_sum) == ("all", 5, 3.25)
    assert merge([]) == {}
