"""Weight transfer: manifest + zero-copy chunks, xxh3_64 checksums, never half-applied, a newer
announce supersedes an older one, joiners asking with policy_version -1 (or older) get the latest."""

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
from protocol.weights import NamedBuffer, WeightAssembler, checksum, plan_transfer


def _bytes_of(bufs: list[NamedBuffer]) -> dict[str, bytes]:
    return {b.name: bytes(memoryview(b.data).cast("B")) for b in bufs}


# -- planning ---------------------------------------------------------------------------------------
def test_plan_splits_tensors_across_chunks() -> None:
    ts = tensors([10, 7])  # 40 + 28 bytes
    announce, chunks = plan_transfer(3, ts, chunk_bytes=16, transfer_id="tx")
    assert (announce.version, announce.transfer_id, announce.num_chunks, announce.checksum_algo) == (3, "tx", 5, "xxh3_64")
    assert announce.tensors == [TensorSpec("layer0.weight", "float32", [10], 40, checksum(ts[0].data)),
                                TensorSpec("layer1.weight", "float32", [7], 28, checksum(ts[1].data))]
    assert [c.index for c in chunks] == [0, 1, 2, 3, 4]
    assert [[(p.tensor, p.offset, p.nbytes) for p in c.parts] for c in chunks] == [
        [(0, 0, 16)], [(0, 16, 16)], [(0, 32, 8), (1, 0, 8)], [(1, 8, 16)], [(1, 24, 4)]]
    assert all(sum(p.nbytes for p in c.parts) <= 16 for c in chunks)


def test_checksums_are_xxh3_64_of_the_raw_bytes() -> None:
    ts = tensors([5])
    announce, _ = plan_transfer(1, ts)
    assert announce.tensors[0].checksum == xxhash.xxh3_64_intdigest(bytes(memoryview(ts[0].data).cast("B")))


def test_chunk_frames_are_views_of_the_tensors() -> None:
    arr = np.arange(32, dtype=np.float32)
    _, chunks = plan_transfer(1, [NamedBuffer("w", "float32", (32,), memoryview(arr))], chunk_bytes=48)
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
        assert conn.policy_version == 0  # generation only switches once the application applied them
        conn.weights_applied(w.version, w.transfer_id, ok=True, apply_time_s=0.5)
    net.pump()
    assert [(e.peer_id, e.applied.version, e.applied.ok) for e in net.learner_events_of(PeerWeightsApplied)] == [
        ("rollout-0", 5, True), ("rollout-1", 5, True)]
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
    assert net.conns[b"r0"].state is SenderState.READY and net.conns[b"r0"].assembler.in_progress is None


def test_duplicate_chunk_is_ignored() -> None:
    net = connected()
    net.learner.publish_weights(1, tensors([25]), chunk_bytes=50)  # 100 bytes: 2 chunks
    out = net.learner.data_to_send(net.clock.now)
    frames = [on_wire(f) for _, f in out]
    assert [codec.peek_type(f) for f in frames] == [MsgType.WEIGHTS_ANNOUNCE, *[MsgType.WEIGHTS_CHUNK] * 2]
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
    seq = [a1, c1[0], a2, c1[1], c2[0], c2[1], c1[0]]  # old chunks still in flight after the new announce
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


def test_missing_chunk_never_completes() -> None:
    net = connected()
    net.mutate = None
    net.drop = lambda d, i, f: codec.peek_type(f) is MsgType.WEIGHTS_CHUNK and codec.decode(f).index == 2
    net.learner.publish_weights(1, tensors([64]), chunk_bytes=64)
    net.pump()
    assert net.events(b"r0", WeightsAnnounced) and not net.events(b"r0", WeightsReceived)
    assert net.conns[b"r0"].assembler.in_progress is not None


# -- the assembler's checks --------------------------------------------------------------------------
def _announce(**kw) -> WeightsAnnounce:
    spec = TensorSpec("w", "float32", [2, 2], 16, 0)
    return WeightsAnnounce(**{"version": 1, "transfer_id": "t", "tensors": [spec], "num_chunks": 1, **kw})


@pytest.mark.parametrize(
    ("announce", "code"),
    [(_announce(checksum_algo="crc32"), ErrorCode.INVALID_FIELD),
     (_announce(tensors=[TensorSpec("w", "float32", [2, 2], 15, 0)]), ErrorCode.INVALID_FIELD),
     (_announce(tensors=[TensorSpec("w", "complex64", [2], 16, 0)]), ErrorCode.INVALID_FIELD),
     (_announce(tensors=[TensorSpec("w", "uint8", [-1, -4], 4, 0)]), ErrorCode.INVALID_FIELD),
     (_announce(tensors=[TensorSpec("w", "uint8", [1 << 20], 1 << 20, 0)]), ErrorCode.TOO_LARGE)],
)
def test_bad_announce_is_refused(announce: WeightsAnnounce, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as e:
        WeightAssembler(max_total_bytes=1 << 16).announce(announce)
    assert e.value.code is code


def test_bad_announce_over_the_wire_reports_weights_applied_false() -> None:
    conn = connected().conns[b"r0"]
    events = conn.receive(on_wire(codec.encode(_announce(checksum_algo="sha1"))), 0.0)
    assert [type(e) for e in events] == [WeightsAnnounced, WeightsFailed]
    (frames,) = conn.data_to_send(0.0)
    applied = codec.decode(frames)
    assert (applied.version, applied.ok) == (1, False) and "checksum_algo" in applied.error


@pytest.mark.parametrize(
    ("chunk", "code"),
    [(WeightsChunk("t", 1, 1, [], ()), ErrorCode.INVALID_FIELD),
     (WeightsChunk("t", 1, 0, [ChunkPart(1, 0, 4)], (b"abcd",)), ErrorCode.INVALID_FIELD),
     (WeightsChunk("t", 1, 0, [ChunkPart(0, 14, 4)], (b"abcd",)), ErrorCode.INVALID_FIELD),
     (WeightsChunk("other", 1, 0, [], ()), ErrorCode.UNEXPECTED)],
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
