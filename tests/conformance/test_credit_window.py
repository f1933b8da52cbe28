"""Replaying a learner's credit window from its replies (the logic behind credit_limit)."""

from __future__ import annotations

from protocol import codec
from protocol.errors import ErrorCode
from protocol.messages import Ack, Error, Heartbeat
from tools.conformance import wire
from tools.conformance.credit_window import replay


def recs(*msgs) -> list[wire.Received]:
    return [wire.decode(codec.encode(m), codec.CodecLimits()) for m in msgs]


def exceeded(seq: int) -> Error:
    return Error(int(ErrorCode.CREDIT_EXCEEDED), "no credit", False, "", 3, seq)


def test_a_strict_learner_rejects_exactly_the_batch_beyond_the_window() -> None:
    r = replay(2, [1, 2, 3], recs(Ack([1], 0), Heartbeat(1.0), Ack([2], 0), exceeded(3)))
    assert (r.problems, r.accepted, r.rejected, r.window) == ([], [1, 2], [3], 0)


def test_credits_granted_in_flight_make_the_excess_legitimate() -> None:
    r = replay(2, [1, 2, 3], recs(Ack([1], 1), Ack([2], 1), Ack([3], 1)))
    assert (r.problems, r.rejected, r.window, r.granted_later) == ([], [], 2, 3)


def test_accepting_beyond_the_window_is_a_violation() -> None:
    r = replay(1, [1, 2], recs(Ack([1], 0), Ack([2], 0)))
    assert r.problems[0].startswith(
        "batch 2 was ACKed although the learner had granted no credit for it"
    )


def test_an_acks_own_credits_do_not_cover_its_batches() -> None:
    assert replay(0, [1], recs(Ack([1], 1))).problems[0].startswith("batch 1 was ACKed although")


def test_rejecting_within_the_window_is_a_violation() -> None:
    r = replay(1, [1, 2], recs(Ack([1], 1), exceeded(2)))
    assert r.problems == [
        "batch 2 was rejected with CREDIT_EXCEEDED although 1 granted credit(s) were unused"
    ]


def test_missing_and_double_verdicts_and_wrong_ref_seq_are_reported() -> None:
    r = replay(1, [1, 2], recs(exceeded(9), Ack([1], 0), exceeded(1)))
    assert r.problems == [
        "CREDIT_EXCEEDED names ref_seq=9, not one of the batches sent [1, 2]",
        "batch 1 got a second verdict (ACK, then CREDIT_EXCEEDED)",
        "no ACK or CREDIT_EXCEEDED for batch(es) [2]",
    ]
