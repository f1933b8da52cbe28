"""Weight transfer: manifest + zero-copy chunks, xxh3_64 checksums, never half-applied, a newer
announce supersedes an older one, joiners asking with policy_version -1 (or older) get the latest.
The receiver's checks before allocating: the manifest against the model, buffers allocated as
chunks arrive, and deadlines that abandon a stuck transfer with an ERROR (SPEC §8)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from protocol_testkit import Net, connected, learner, on_wire, rollout, tensors

from protocol import codec
from protocol.errors import ErrorCode, ProtocolError
from protocol.events import PeerWeightsApplied, WeightsAnnounced, WeightsFailed, WeightsReceived
from protocol.messages import ChunkPart, MsgType, TensorSpec, WeightsAnnounce, WeightsChunk
from protocol.sender import SenderState
from protocol.weights import (
    DTYPE_SIZES,
    ModelManifest,
    NamedBuffer,
    WeightAssembler,
    checksum,
    plan_transfer,
)


def _bytes_of(bufs: list[NamedBuffer]) -> dict[str, bytes]:
    return {b.name: bytes(memoryview(b.data).cast("B")) for b in bufs}


# -- planning ---------------------------------------------------------------------------------------
def test_plan_splits_tensors_across_chunks() -> None:
    ts = tensors([10, 7])  # 40 + 28 bytes
    announce, chunks = plan_transfer(3, ts, chunk_bytes=16, transfer_id="tx")
    assert (
        announce.version,
        announce.transfer_id,
        announce.num_chunks,
        announce.checksum_algo,
    ) == (3, "tx", 5, "xxh3_64")
    assert announce.tensors == [
        TensorSpec("layer0.weight", "float32", [10], 40, checksum(ts[0].data)),
        TensorSpec("layer1.weight", "float32", [7], 28, checksum(ts[1].data)),
    ]
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert [[(p.tensor, p.offset, p.nbytes) for p in c.parts] for c in chunks] == [
        [(0, 0, 16)],
        [(0, 16, 16)],
        [(0, 32, 8), (1, 0, 8)],
        [(1, 8, 16)],
        [(1, 24, 4)],
    ]
    assert all(sum(p.nbytes for p in c.parts) <= 16 for c in chunks)


def test_checksums_are_xxh3_64_of_the_raw_bytes() -> None:
    ts = tensors([5])
    announce, _ = plan_transfer(1, ts)
    assert announce.tensors[0].checksum == xxhash.xxh3_64_intdigest(
        bytes(memoryview(ts[0].data).cast("B"))
    )


def test_chunk_frames_are_views_of_the_tensors() -> None:
    arr = np.arange(32, dtype=np.float32)
    _, chunks = plan_transfer(
        1, [NamedBuffer("w", "float32", (32,), memoryview(arr))], chunk_bytes=48
    )
    for c in chunks:
        for f in c.frames:
            assert np.shares_memory(np.frombuffer(f, np.uint8), arr)
    frames = codec.encode(chunks[1])
    assert frames[2] is chunks[1].frames[0]  # encoding copies nothing either


def test_plan_rejects_inconsistent_tensors() -> None:
    with pytest.raises(ValueError, match="shape and dtype"):
        plan_transfer(1, [NamedBuffer("w", "float32", (3,), memoryview(bytes(8)))])


# -- end to end over the in-memory pump --------------------------------------------------------------
def _applied(net: Net, ident: bytes = b"r0") -> list:
    return [r.decoded() for r in net.sent("up", MsgType.WEIGHTS_APPLIED, ident)]


def test_multi_chunk_transfer_end_to_end() -> None:
    net = connected(n=2)
    ts = tensors([100, 37, 64])
    net.learner.publish_weights(5, ts, chunk_bytes=96)
    net.pump()
    n_chunks = len(net.sent("down", MsgType.WEIGHTS_CHUNK, b"r0"))
    assert n_chunks == -(-(4 * (100 + 37 + 64)) // 96) == 9
    for ident, conn in net.conns.items():
        assert net.events(ident, WeightsAnnounced) == [WeightsAnnounced(5)]
        (received,) = net.events(ident, WeightsReceived)
        w = received.weights
        assert w.version == 5 and {s.name: bytes(b) for s, b in w.tensors} == _bytes_of(ts)
        # generation only switches once the application applied them
        assert conn.policy_version == 0
        conn.weights_applied(w.version, w.transfer_id, ok=True, apply_time_s=0.5)
    net.pump()
    assert [
        (e.peer_id, e.applied.version, e.applied.ok)
        for e in net.learner_events_of(PeerWeightsApplied)
    ] == [("rollout-0", 5, True), ("rollout-1", 5, True)]
    assert all(p.policy_version == 5 for p in net.learner.peers.values())
    assert all(c.policy_version == 5 for c in net.conns.values())


def test_corrupted_chunk_byte_fails_the_transfer() -> None:
    net = connected()

    def corrupt(direction: str, ident: bytes, frames: list) -> list:
        if codec.peek_type(frames) is MsgType.WEIGHTS_CHUNK and codec.decode(frames).index == 1:
            bad = bytearray(frames[2])
            bad[3] ^= 0x01
            return [*frames[:2], bytes(bad), *frames[3:]]
        return frames

    net.mutate = corrupt
    net.learner.publish_weights(2, tensors([40, 40]), chunk_bytes=64)
    net.pump()
    assert not net.events(b"r0", WeightsReceived)  # never half-applied
    (failed,) = net.events(b"r0", WeightsFailed)
    assert failed.version == 2 and "verification" in failed.reason
    (applied,) = _applied(net)
    assert (applied.version, applied.ok) == (2, False) and applied.error == failed.reason
    (ev,) = net.learner_events_of(PeerWeightsApplied)
    assert not ev.applied.ok and net.learner.peers[b"r0"].policy_version == 0
    assert (
        net.conns[b"r0"].state is SenderState.READY
        and net.conns[b"r0"].assembler.in_progress is None
    )


def test_duplicate_chunk_is_ignored() -> None:
    net = connected()
    net.learner.publish_weights(1, tensors([25]), chunk_bytes=50)  # 100 bytes: 2 chunks
    out = net.learner.data_to_send(net.clock.now)
    frames = [on_wire(f) for _, f in out]
    assert [codec.peek_type(f) for f in frames] == [
        MsgType.WEIGHTS_ANNOUNCE,
        *[MsgType.WEIGHTS_CHUNK] * 2,
    ]
    conn = net.conns[b"r0"]
    events = []
    for f in [frames[0], frames[1], frames[1], frames[1]]:  # announce, chunk 0 three times
        events += conn.receive(f, net.clock.now)
    assert events == [WeightsAnnounced(1)]
    assert conn.assembler._current is not None and conn.assembler._current.filled == [50]
    events = conn.receive(frames[2], net.clock.now)
    assert [type(e) for e in events] == [WeightsReceived]
    assert not conn.data_to_send(net.clock.now)[:-1]  # no ERROR, no WEIGHTS_APPLIED(ok=False)


def test_newer_announce_supersedes_older_one() -> None:
    net = connected()
    conn = net.conns[b"r0"]
    old, new = tensors([16], seed=1), tensors([16], seed=2)
    a1, c1 = plan_transfer(1, old, chunk_bytes=32, transfer_id="old")
    a2, c2 = plan_transfer(2, new, chunk_bytes=32, transfer_id="new")
    assert len(c1) == len(c2) == 2
    now = net.clock.now
    # old chunks still in flight after the new announce
    seq = [a1, c1[0], a2, c1[1], c2[0], c2[1], c1[0]]
    events = [e for m in seq for e in conn.receive(on_wire(codec.encode(m)), now)]
    assert [type(e) for e in events] == [WeightsAnnounced, WeightsAnnounced, WeightsReceived]
    (got,) = [e.weights for e in events if isinstance(e, WeightsReceived)]
    assert got.version == 2 and {s.name: bytes(b) for s, b in got.tensors} == _bytes_of(new)
    assert conn.data_to_send(now)[:-1] == []  # stale chunks of the abandoned transfer: no complaint


def test_joiner_asking_with_minus_one_gets_the_latest() -> None:
    net = connected()
    net.learner.publish_weights(1, tensors([8], seed=1), chunk_bytes=16)
    net.learner.publish_weights(2, tensors([8], seed=2), chunk_bytes=16)
    net.pump()
    late = net.add(b"late", rollout("rollout-late"), request_weights=True)
    net.pump()
    assert codec.decode(net.sent("up", MsgType.HELLO, b"late")[0].frames).policy_version == -1
    assert [r.decoded().version for r in net.sent("down", MsgType.WEIGHTS_ANNOUNCE, b"late")] == [2]
    (got,) = net.events(b"late", WeightsReceived)
    assert got.weights.version == 2 and late.state is SenderState.READY
    # WELCOME comes first, so the joiner knows its session before the weights arrive
    kinds = [r.type for r in net.wire if r.direction == "down" and r.identity == b"late"]
    assert kinds[0] is MsgType.WELCOME and kinds[1] is MsgType.WEIGHTS_ANNOUNCE


@pytest.mark.parametrize(("policy_version", "gets"), [(0, True), (1, True), (2, False), (5, False)])
def test_joiner_with_older_policy_gets_the_latest(policy_version: int, gets: bool) -> None:
    net = connected()
    net.learner.publish_weights(2, tensors([8]), chunk_bytes=16)
    net.pump()
    conn = rollout("rollout-late")
    conn.policy_version = policy_version
    net.add(b"late", conn)
    net.pump()
    assert bool(net.events(b"late", WeightsReceived)) is gets


def test_no_weights_published_nothing_sent_to_joiner() -> None:
    net = Net(learner())
    net.add(b"r0", rollout(), request_weights=True)
    net.pump()
    assert not net.sent("down", MsgType.WEIGHTS_ANNOUNCE)


def test_missing_chunk_never_completes_and_times_out_with_an_error() -> None:
    net = connected()
    net.mutate = None
    net.drop = lambda d, i, f: (
        codec.peek_type(f) is MsgType.WEIGHTS_CHUNK and codec.decode(f).index == 2
    )
    net.learner.publish_weights(1, tensors([64]), chunk_bytes=64)
    net.pump()
    conn = net.conns[b"r0"]
    assert net.events(b"r0", WeightsAnnounced) and not net.events(b"r0", WeightsReceived)
    assert conn.assembler.in_progress is not None
    # the driver wakes for the transfer's deadline: no new chunk for timeout_s (60 s by default)
    assert conn.next_deadline() <= net.clock.now + 60
    for _ in range(70):  # heartbeats keep the session alive; only the transfer is stuck
        net.advance(1.0)
    (failed,) = net.events(b"r0", WeightsFailed)
    assert failed.version == 1 and "abandoned" in failed.reason and "3 of 4 chunks" in failed.reason
    assert conn.assembler.in_progress is None and conn.state is SenderState.READY
    (applied,) = _applied(net)
    assert (applied.version, applied.ok) == (1, False)
    (err,) = [r.decoded() for r in net.sent("up", MsgType.ERROR, b"r0")]
    assert (
        err.code == ErrorCode.TIMED_OUT
        and err.ref_type == MsgType.WEIGHTS_ANNOUNCE
        and not err.fatal
    )
    assert "192 of 256 bytes" in err.message


# -- the assembler's checks --------------------------------------------------------------------------
def _announce(**kw) -> WeightsAnnounce:
    spec = TensorSpec("w", "float32", [2, 2], 16, 0)
    return WeightsAnnounce(
        **{"version": 1, "transfer_id": "t", "tensors": [spec], "num_chunks": 1, **kw}
    )


@pytest.mark.parametrize(
    ("announce", "code"),
    [
        (_announce(checksum_algo="crc32"), ErrorCode.INVALID_FIELD),
        (_announce(tensors=[TensorSpec("w", "float32", [2, 2], 15, 0)]), ErrorCode.INVALID_FIELD),
        (_announce(tensors=[TensorSpec("w", "complex64", [2], 16, 0)]), ErrorCode.INVALID_FIELD),
        (_announce(tensors=[TensorSpec("w", "uint8", [-1, -4], 4, 0)]), ErrorCode.INVALID_FIELD),
        (_announce(tensors=[TensorSpec("w", "uint8", [1 << 20], 1 << 20, 0)]), ErrorCode.TOO_LARGE),
    ],
)
def test_bad_announce_is_refused(announce: WeightsAnnounce, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as e:
        WeightAssembler(max_total_bytes=1 << 16).announce(announce)
    assert e.value.code is code


def test_bad_announce_over_the_wire_reports_weights_applied_false_and_an_error() -> None:
    conn = connected().conns[b"r0"]
    events = conn.receive(on_wire(codec.encode(_announce(checksum_algo="sha1"))), 0.0)
    assert [type(e) for e in events] == [WeightsFailed]  # refused: not announced to the application
    applied, err = (codec.decode(f) for f in conn.data_to_send(0.0))
    assert (applied.version, applied.ok) == (1, False) and "checksum_algo" in applied.error
    assert (err.code, err.field, err.ref_type) == (
        ErrorCode.INVALID_FIELD,
        "checksum_algo",
        MsgType.WEIGHTS_ANNOUNCE,
    )


@pytest.mark.parametrize(
    ("chunk", "code"),
    [
        (WeightsChunk("t", 1, 1, [], ()), ErrorCode.INVALID_FIELD),
        (WeightsChunk("t", 1, 0, [ChunkPart(1, 0, 4)], (b"abcd",)), ErrorCode.INVALID_FIELD),
        (WeightsChunk("t", 1, 0, [ChunkPart(0, 14, 4)], (b"abcd",)), ErrorCode.INVALID_FIELD),
        (WeightsChunk("other", 1, 0, [], ()), ErrorCode.UNEXPECTED),
    ],
)
def test_bad_chunk_is_refused(chunk: WeightsChunk, code: ErrorCode) -> None:
    asm = WeightAssembler()
    asm.announce(_announce())
    with pytest.raises(ProtocolError) as e:
        asm.chunk(chunk)
    assert e.value.code is code


def test_short_transfer_fails_verification() -> None:
    """Chunks that do not cover a tensor: all chunks arrived, the bytes did not."""
    asm = WeightAssembler()
    asm.announce(_announce())
    with pytest.raises(ProtocolError) as e:
        asm.chunk(WeightsChunk("t", 1, 0, [ChunkPart(0, 0, 8)], (bytes(8),)))
    assert e.value.code is ErrorCode.CHECKSUM_MISMATCH and "8/16" in e.value.message
    assert asm.in_progress is None


def test_empty_transfer_completes_on_announce() -> None:
    announce, chunks = plan_transfer(4, [], transfer_id="empty")
    assert chunks == [] and announce.num_chunks == 0
    got = WeightAssembler().announce(announce)
    assert got is not None and got.version == 4 and got.tensors == []


# -- checks before allocating (SPEC §8) --------------------------------------------------------------
MODEL = ModelManifest(
    {"embed.weight": ("float32", (8, 4)), "norm.weight": ("float32", (4,))},
    optional={"lm_head.weight": ("float32", (8, 4))},
    name="tiny",
)
GOOD = [("embed.weight", "float32", [8, 4]), ("norm.weight", "float32", [4])]


def _specs(*items: tuple[str, str, list[int]]) -> list[TensorSpec]:
    return [TensorSpec(n, d, s, int(np.prod(s)) * DTYPE_SIZES[d], 0) for n, d, s in items]


def test_manifest_bound_is_the_models_size() -> None:
    assert MODEL.max_bytes == (32 + 4 + 32) * 4
    assert WeightAssembler(manifest=MODEL).max_total_bytes == MODEL.max_bytes  # not 64 GiB


@pytest.mark.parametrize(
    ("specs", "code", "field", "words"),
    [
        (
            [("embed.weight", "float32", [3 << 28])],
            ErrorCode.TOO_LARGE,
            "tensors",
            "exceed the 272 bytes tiny can hold",
        ),
        (
            [*GOOD, ("extra", "float32", [1])],
            ErrorCode.INVALID_FIELD,
            "tensors[2].name",
            "extra is not a tensor of tiny",
        ),
        (
            [("embed.weight", "float32", [4, 8]), GOOD[1]],
            ErrorCode.INVALID_FIELD,
            "tensors[0].shape",
            "embed.weight: shape [4, 8], tiny has [8, 4]",
        ),
        (
            [("embed.weight", "float64", [8, 4]), GOOD[1]],
            ErrorCode.INVALID_FIELD,
            "tensors[0].dtype",
            "dtype float64, tiny stores float32",
        ),
        (
            [("embed.weight", "int32", [8, 4]), GOOD[1]],
            ErrorCode.INVALID_FIELD,
            "tensors[0].dtype",
            "dtype int32",
        ),
        (
            [GOOD[0]],
            ErrorCode.INVALID_FIELD,
            "tensors",
            "1 tensors of tiny missing, e.g. ['norm.weight']",
        ),
        (
            [GOOD[1], GOOD[1], GOOD[0]],
            ErrorCode.INVALID_FIELD,
            "tensors[1].name",
            "announced twice",
        ),
    ],
)
def test_announce_that_does_not_fit_the_model_is_refused(
    specs: list, code: ErrorCode, field: str, words: str
) -> None:
    with pytest.raises(ProtocolError) as e:
        WeightAssembler(manifest=MODEL).announce(_announce(tensors=_specs(*specs)), 0.0)
    assert (e.value.code, e.value.field) == (code, field) and words in e.value.message, (
        e.value.message
    )


def test_announce_that_fits_the_model_is_accepted() -> None:
    asm = WeightAssembler(manifest=MODEL)
    assert asm.announce(_announce(tensors=_specs(*GOOD), num_chunks=2), 0.0) is None
    # narrower floating dtypes are fine, and the tied lm_head may come or not
    half = _specs(
        ("embed.weight", "bfloat16", [8, 4]),
        ("norm.weight", "float16", [4]),
        ("lm_head.weight", "float32", [8, 4]),
    )
    assert asm.announce(_announce(tensors=half, transfer_id="t2", num_chunks=3), 0.0) is None


def test_many_problems_are_listed_with_a_count() -> None:
    many = ModelManifest({f"w{i}": ("float32", (2,)) for i in range(9)}, name="m")
    specs = _specs(*[(f"w{i}", "float32", [1, 2]) for i in range(9)])
    with pytest.raises(ProtocolError) as e:
        WeightAssembler(manifest=many).announce(_announce(tensors=specs), 0.0)
    assert e.value.message.count("shape [1, 2]") == 5 and "(and 4 more)" in e.value.message


def test_more_chunks_than_bytes_is_refused() -> None:
    with pytest.raises(ProtocolError) as e:
        WeightAssembler().announce(_announce(num_chunks=17), 0.0)  # 16 bytes
    assert (e.value.code, e.value.field) == (ErrorCode.INVALID_FIELD, "num_chunks")
    with pytest.raises(ProtocolError):
        WeightAssembler().announce(_announce(num_chunks=0), 0.0)  # bytes, and nothing to carry them


def test_a_refused_announce_leaves_the_transfer_in_progress() -> None:
    asm = WeightAssembler()
    asm.announce(_announce(), 0.0)
    with pytest.raises(ProtocolError):
        asm.announce(_announce(transfer_id="huge", tensors=_specs(("w", "uint8", [1 << 40]))), 0.0)
    assert asm.in_progress is not None and asm.in_progress.transfer_id == "t"


def test_buffers_are_allocated_as_chunks_arrive() -> None:
    ts = tensors([100, 50, 25])
    announce, chunks = plan_transfer(1, ts, chunk_bytes=100, transfer_id="lazy")
    asm = WeightAssembler()
    asm.announce(announce, 0.0)
    cur = asm._current
    assert cur is not None and cur.buffers == [None, None, None]  # nothing allocated for the claim
    asm.chunk(chunks[0], 1.0)
    assert [b is not None for b in cur.buffers] == [True, False, False]
    got = None
    for c in chunks[1:]:
        got = asm.chunk(c, 2.0)
    assert got is not None and {s.name: bytes(b) for s, b in got.tensors} == _bytes_of(ts)


def test_stalled_transfer_expires_after_timeout_without_progress() -> None:
    announce, chunks = plan_transfer(1, tensors([64]), chunk_bytes=64, transfer_id="slow")
    asm = WeightAssembler(timeout_s=10.0, min_bytes_per_s=1.0)  # whole-transfer deadline: 266 s
    asm.announce(announce, 100.0)
    assert asm.deadline == 110.0
    asm.chunk(chunks[0], 105.0)
    assert asm.deadline == 115.0 and asm.expire(114.9) is None
    asm.chunk(chunks[0], 114.0)  # a repeated chunk is no progress
    assert asm.deadline == 115.0
    expired = asm.expire(115.0)
    assert expired is not None
    ann, err = expired
    assert ann.transfer_id == "slow" and err.code is ErrorCode.TIMED_OUT
    assert (
        "no new chunk for 10.0 s" in err.message and "1 of 4 chunks, 64 of 256 bytes" in err.message
    )
    assert asm.in_progress is None and asm.deadline == float("inf") and asm.expire(1e9) is None
    assert asm.chunk(chunks[1], 116.0) is None  # late chunks of the abandoned transfer: ignored


def test_slow_drip_expires_at_the_size_based_deadline() -> None:
    # 64 chunks
    announce, chunks = plan_transfer(1, tensors([64]), chunk_bytes=4, transfer_id="drip")
    asm = WeightAssembler(timeout_s=10.0, min_bytes_per_s=32.0)  # 10 s + 256 B / 32 B/s = 18 s
    asm.announce(announce, 0.0)
    t, expired = 0.0, None
    for c in chunks:  # a new chunk every 5 s: always progress, never fast enough
        t += 5.0
        if (expired := asm.expire(t)) is not None:
            break
        asm.chunk(c, t)
    assert expired is not None and t == 20.0
    assert "not complete 18.0 s after its announce" in expired[1].message


def test_no_clock_no_deadline() -> None:
    asm = WeightAssembler(timeout_s=1.0)
    asm.announce(_announce())
    assert asm.deadline == float("inf") and asm.expire(1e12) is None


def test_version_jumps_are_accepted_and_nothing_stays_pending() -> None:
    """Versions may jump (a learner generation in the version): never refused for that, and an
    announce never followed by its chunks is abandoned once, with an ERROR."""
    net = connected()
    conn = net.conns[b"r0"]
    big = _announce(version=10**9 + 7, tensors=_specs(("w", "float32", [4])), num_chunks=1)
    assert conn.receive(on_wire(codec.encode(big)), net.clock.now) == [WeightsAnnounced(10**9 + 7)]
    for _ in range(3):
        net.advance(30.0)
    assert [e.version for e in net.events(b"r0", WeightsFailed)] == [10**9 + 7]
    (err,) = [r.decoded() for r in net.sent("up", MsgType.ERROR, b"r0")]
    assert err.code == ErrorCode.TIMED_OUT and f"version {10**9 + 7}" in err.message


def test_a_megabyte_name_is_not_quoted_back_whole() -> None:
    long_name = "w" * (1 << 20)
    with pytest.raises(ProtocolError) as e:
        WeightAssembler(manifest=MODEL).announce(
            _announce(tensors=_specs(*GOOD, (long_name, "float32", [1]))), 0.0
        )
    assert len(e.value.message) < 1000 and f"({1 << 20} chars)" in e.value.message
