"""Failure descriptions: what the suite quotes as "received: ..." in its reasons."""

from __future__ import annotations

from protocol import codec
from protocol.errors import ErrorCode
from protocol.messages import Ack, Error, Heartbeat, TrajectoryBatch
from tools.conformance import wire


def recs(*msgs) -> list[wire.Received]:
    return [wire.decode(codec.encode(m), codec.CodecLimits()) for m in msgs]


def test_runs_of_batches_and_repeats_are_folded_in_descriptions() -> None:
    batches = [TrajectoryBatch(s, [wire.tiny_trajectory(f"t{s}")]) for s in (2, 3, 4)]
    text = wire.describe(
        recs(Heartbeat(1.0), Heartbeat(2.0), *batches, Ack([1], 2), TrajectoryBatch(9, []))
    )
    assert text == (
        "HEARTBEAT x2, TRAJECTORY_BATCH(seq=2..4), ACK(seqs=[1], credits=2), "
        "TRAJECTORY_BATCH(seq=9)"
    )
    assert wire.describe([]) == "nothing"


def test_errors_and_undecodable_messages_are_described() -> None:
    err = Error(
        int(ErrorCode.INVALID_FIELD), "bad mask", False, "trajectories[0].response_mask[0]", 3, 7
    )
    assert wire.describe(recs(err)) == (
        "ERROR(INVALID_FIELD, ref_seq=7, field=trajectories[0].response_mask[0]: bad mask)"
    )
    junk = wire.decode([wire.type_byte(8), b"\xc1"], codec.CodecLimits())
    assert junk.describe().startswith(
        "undecodable HEARTBEAT (MALFORMED: header is not valid msgpack"
    )


def test_version_mentions() -> None:
    assert wire.mentions_version("peer speaks protocol 2.0, this learner speaks 1.0", 2)
    assert wire.mentions_version("protocol 2.0 vs 1.0", 1)
    assert not wire.mentions_version("protocol 12.0 vs 1.0", 2)
