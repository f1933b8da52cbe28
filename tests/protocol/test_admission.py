"""Admission (1.3): ADMIT grants and HEARTBEAT dropped_tokens, sans-IO.

A learner with ``admission`` says so in WELCOME only to peers whose HELLO offers "admission";
``admit`` reaches only such peers; a grant becomes ``GroupsAdmitted`` on the rollout side while its
session lasts; an ADMIT to a server that did not ask for grants is UNEXPECTED; field checks name
the field; dropped-token counts add up over sender epochs.
"""

from __future__ import annotations

from protocol_testkit import Net, learner, rollout

from protocol import codec
from protocol.errors import ErrorCode
from protocol.events import Connected, GroupsAdmitted, ProtocolViolation
from protocol.messages import ADMISSION_CAPABILITY, Admit, Heartbeat, MsgType
from protocol.sender import SenderState

CAP = [ADMISSION_CAPABILITY]


def net(*, admission: bool = True, caps: list[str] = CAP) -> Net:
    n = Net(learner(admission=admission))
    n.add(b"r0", rollout("rs0", capabilities=list(caps)))
    n.pump()
    return n


def welcome_caps(n: Net) -> list[str]:
    (c,) = n.events(b"r0", Connected)
    return c.welcome.capabilities


def test_welcome_says_admission_only_when_both_sides_take_it() -> None:
    assert welcome_caps(net()) == [ADMISSION_CAPABILITY]
    assert welcome_caps(net(admission=False)) == []
    assert welcome_caps(net(caps=[])) == []
    assert net().learner.admission_peers() == ["rs0"]
    assert net(caps=[]).learner.admission_peers() == []


def test_grants_reach_peers_that_take_them_and_only_those() -> None:
    n = net()
    assert n.learner.admit("rs0", 3, 0) and n.learner.admit("rs0", 2, 1)
    n.pump()
    assert [(e.groups, e.min_version) for e in n.events(b"r0", GroupsAdmitted)] == [(3, 0), (2, 1)]
    assert not n.learner.admit("nobody", 1, 0)
    plain = net(caps=[])
    assert not plain.learner.admit("rs0", 1, 0)
    plain.pump()
    assert not plain.sent("down", MsgType.ADMIT)


def test_admit_to_a_server_that_did_not_offer_it_is_unexpected() -> None:
    conn = rollout("rs0")
    conn.start(0.0)
    conn.state = SenderState.READY
    events = conn.receive(codec.encode(Admit(1, 0)), 1.0)
    assert isinstance(events[0], ProtocolViolation) and events[0].error.code is ErrorCode.UNEXPECTED


def test_a_grant_outside_a_session_is_ignored() -> None:
    conn = rollout("rs0", capabilities=CAP)
    conn.start(0.0)  # HELLO sent, no WELCOME yet
    assert conn.receive(codec.encode(Admit(4, 0)), 1.0) == []


def test_admit_fields_are_checked_by_name() -> None:
    frames = codec.encode(Admit(1, 0))
    import msgpack

    for field, value in (("groups", 0), ("min_version", -1)):
        hdr = msgpack.unpackb(bytes(frames[1]))
        hdr[field] = value
        try:
            codec.decode([frames[0], msgpack.packb(hdr)], codec.CodecLimits())
        except Exception as e:  # ProtocolError
            assert (
                f"ADMIT.{field}" in str(e) and getattr(e, "code", None) is ErrorCode.INVALID_FIELD
            )
        else:
            raise AssertionError(f"ADMIT.{field}={value} was accepted")


def test_dropped_tokens_add_up_over_epochs_and_never_go_back() -> None:
    n = Net(learner())
    n.add(b"r0", rollout("rs0", epoch="e1"))
    n.pump()
    for count in (5, 12, 7):  # heartbeats are cumulative: a lower one (reordered) changes nothing
        n.learner_events += n.learner.receive(b"r0", codec.encode(Heartbeat(1.0, 0, count)), 1.0)
    assert n.learner.dropped_tokens == 12
    n.add(b"r1", rollout("rs0", epoch="e2"))  # restarted: a new epoch counts from zero
    n.pump()
    n.learner_events += n.learner.receive(b"r1", codec.encode(Heartbeat(2.0, 0, 3)), 2.0)
    assert n.learner.dropped_tokens == 15
    own = net()
    conn = own.conns[b"r0"]
    conn.dropped_tokens = 40  # the sender's own heartbeats carry its count
    own.run_for(3.0)
    assert own.learner.dropped_tokens == 40


def test_heartbeat_without_drops_encodes_as_before() -> None:
    assert codec.encode(Heartbeat(1.0, 2))[1] == codec.encode(Heartbeat(1.0, 2, 0))[1]
    assert b"dropped_tokens" not in bytes(codec.encode(Heartbeat(1.0, 2))[1])
