"""The sans-IO cores of the weight relay tier (``protocol.relay``): the learner's chain and routes,
and a relay's forwarding, de-duplication and checks, without sockets."""

from __future__ import annotations

import numpy as np

from protocol import codec
from protocol.messages import (
    WEIGHT_RELAY_CAPABILITY,
    Bye,
    Hello,
    Identity,
    Limits,
    WeightsApplied,
    WeightsChunk,
    Welcome,
)
from protocol.receiver import LearnerProtocol
from protocol.relay import Completed, RelayNode, RelayTier, Routed
from protocol.weights import NamedBuffer, WeightAssembler, plan_transfer

ID = Identity("t", "", 0)


def relay_hello(name: str, host: str, address: str, version: int = -1) -> Hello:
    return Hello(
        [1, 3], name, "rollout-server", "e", ID, ID, version,
        [WEIGHT_RELAY_CAPABILITY], host=host, relay_address=address,
    )  # fmt: skip


def transfer(version: int = 1) -> tuple[list[list[codec.Frame]], int]:
    data = np.arange(40_000, dtype=np.float32)
    a, chunks = plan_transfer(
        version, [NamedBuffer("w", "float32", data.shape, data.data.cast("B"))],
        chunk_bytes=16_000,
    )  # fmt: skip
    return [codec.encode(a), *(codec.encode(c) for c in chunks)], a.num_chunks


def node(name: str = "r") -> RelayNode:
    return RelayNode(
        peer_id=name, host="h", address="tcp://x:1", assembler=WeightAssembler(),
        model=ID, tokenizer=ID, epoch="e",
    )  # fmt: skip


def test_chain_order_and_reroute_when_a_relay_leaves() -> None:
    tier = RelayTier()
    assert tier.join(b"a", relay_hello("a", "A", "tcp://a")) == [(b"a", "")]
    assert tier.join(b"b", relay_hello("b", "B", "tcp://b")) == [(b"b", "tcp://a")]
    assert tier.join(b"c", relay_hello("c", "C", "tcp://c")) == [(b"c", "tcp://b")]
    assert tier.leave(b"b") == [(b"c", "tcp://a")]  # the chain closes over the gap
    assert tier.leave(b"a") == [(b"c", "")]  # the new head takes weights from the learner
    assert tier.fed_by_learner(b"c") and tier.serves("C") and not tier.serves("A")


def test_learner_welcomes_relays_without_credits_and_routes_them() -> None:
    proto = LearnerProtocol(tokenizer=Identity("tok", "ab" * 32, 0), capacity=8)
    proto.receive(b"a", codec.encode(relay_hello("a", "A", "tcp://a")), 0.0)
    proto.receive(b"b", codec.encode(relay_hello("b", "B", "tcp://b")), 0.0)
    out = {ident: codec.decode(frames) for ident, frames in proto.data_to_send(0.0)}
    wa, wb = out[b"a"], out[b"b"]
    assert isinstance(wa, Welcome) and isinstance(wb, Welcome)
    assert WEIGHT_RELAY_CAPABILITY in wa.capabilities and wa.credits == 0 and wb.credits == 0
    assert (wa.relay_upstream, wb.relay_upstream) == ("", "tcp://a")
    assert proto.free_room == 8  # relays hold no room
    _, n = transfer()
    data = np.arange(40_000, dtype=np.float32)
    buf = NamedBuffer("w", "float32", data.shape, data.data.cast("B"))
    proto.publish_weights(1, [buf], chunk_bytes=16_000)
    sent = proto.data_to_send(0.1)
    assert {ident for ident, _ in sent} == {b"a"} and len(sent) == n + 1  # once, to the head
    proto.receive(b"a", codec.encode(Bye("gone")), 0.2)
    routed = [codec.decode(f) for ident, f in proto.data_to_send(0.3) if ident == b"b"]
    assert isinstance(routed[0], Welcome) and routed[0].relay_upstream == ""
    assert len(routed) == 1 + n + 1  # re-routed to the learner, and sent the version it lacks


def test_relay_forwards_before_it_checks_and_skips_repeats() -> None:
    frames, n = transfer()
    r = node()
    r.from_downstream(b"d1", r.hello_upstream())
    events = []
    for f in frames[:3]:
        msg = r.weights(f)
        assert msg is not None
        events += r.assemble(msg)
    assert len(r.to_downstream()) == 3
    r.from_downstream(b"d2", node("late").hello_upstream())  # a late downstream: all so far
    assert [i for i, _ in r.to_downstream()] == [b"d2"] * 3
    assert r.weights(frames[0]) is None and r.weights(frames[1]) is None  # re-attached: repeats
    assert r.to_downstream() == []
    for f in frames[3:]:
        msg = r.weights(f)
        assert msg is not None
        assert r.completes(msg) == (f is frames[-1])
        events += r.assemble(msg)
    assert len(r.to_downstream()) == 2 * (n - 2)
    (done,) = events
    assert isinstance(done, Completed) and done.weights.version == 1
    # kept for later relays: the same bytes, now read from the verified buffers
    r.from_downstream(b"d3", node("later").hello_upstream())
    again = [f for _, f in r.to_downstream()]
    assert [bytes(codec.view(x)) for f in again for x in f] == [
        bytes(codec.view(x)) for f in frames for x in f
    ]
    verified = [memoryview(b) for _, b in done.weights.tensors]
    assert any(isinstance(x, memoryview) and x.obj is verified[0].obj for x in again[1][2:])
    r.file_ready(1, done.weights.transfer_id, "/dev/shm/x", 0.1)
    r.in_session = True
    (rep,) = r.to_learner(1.0)
    applied = codec.decode(rep)
    assert isinstance(applied, WeightsApplied) and applied.ok and applied.file == "/dev/shm/x"


def test_a_corrupted_chunk_is_forwarded_and_reported() -> None:
    frames, n = transfer()
    r = node()
    r.from_downstream(b"d", r.hello_upstream())
    bad = codec.decode(frames[1])
    assert isinstance(bad, WeightsChunk)
    flipped = bytearray(bad.frames[0])
    flipped[0] ^= 1
    frames[1] = codec.encode(
        WeightsChunk(bad.transfer_id, bad.version, bad.index, bad.parts, (bytes(flipped),))
    )
    events = []
    for f in frames:
        msg = r.weights(f)
        assert msg is not None
        events += r.assemble(msg)
    assert not any(isinstance(e, Completed) for e in events)
    assert len(r.to_downstream()) == n + 1  # the relays behind it check for themselves
    r.in_session = True
    (rep,) = r.to_learner(1.0)
    applied = codec.decode(rep)
    assert isinstance(applied, WeightsApplied) and not applied.ok and "w" in applied.error


def test_reroute_welcome_becomes_routed() -> None:
    r = node()
    r.start(0.0)
    w = Welcome(
        [1, 3], "learner", "s", 0, 0, 1, 1.0, 5.0, Limits(1 << 20, 10, 10),
        [WEIGHT_RELAY_CAPABILITY], relay_upstream="tcp://up",
    )  # fmt: skip
    assert r.from_learner(codec.encode(w), 0.1) == [Routed("tcp://up")]
    assert r.from_learner(codec.encode(w), 0.2) == []  # the same route again: nothing to do


def test_a_stale_relay_file_refused_is_no_reason_for_chunks() -> None:
    """A server that fails to open an older relay file (gone: the relay keeps its newest few)
    already has the newer one; only a refused newest file sends it to chunks."""
    from protocol.messages import WEIGHTS_FILE_CAPABILITY, MsgType, WeightsAnnounce

    proto = LearnerProtocol(tokenizer=Identity("tok", "", 0), capacity=8)
    proto.receive(b"r", codec.encode(relay_hello("r", "A", "tcp://r")), 0.0)
    server = Hello(
        [1, 3], "s", "rollout-server", "e", ID, ID, 0, [WEIGHTS_FILE_CAPABILITY], host="A"
    )
    proto.receive(b"s", codec.encode(server), 0.0)
    data = np.arange(40_000, dtype=np.float32)
    buf = NamedBuffer("w", "float32", data.shape, data.data.cast("B"))
    handed: dict[int, str] = {}
    for v in (1, 2):
        proto.publish_weights(v, [buf], chunk_bytes=16_000)
        applied = WeightsApplied(v, f"t{v}", True, file=f"/dev/shm/agentrl-weights-1-a/v{v}")
        proto.receive(b"r", codec.encode(applied), 0.1 * v)
        for ident, frames in proto.data_to_send(0.1 * v):
            msg = codec.decode(frames)
            if ident == b"s" and isinstance(msg, WeightsAnnounce):
                assert msg.file and msg.version not in handed
                handed[msg.version] = msg.transfer_id
    assert sorted(handed) == [1, 2]

    def chunks_to_server() -> int:
        sent = proto.data_to_send(1.0)
        return sum(1 for i, f in sent if i == b"s" and codec.peek_type(f) is MsgType.WEIGHTS_CHUNK)

    proto.receive(b"s", codec.encode(WeightsApplied(1, handed[1], False, "gone")), 0.5)
    assert chunks_to_server() == 0  # v1's file was stale: v2's is on its way
    proto.receive(b"s", codec.encode(WeightsApplied(2, handed[2], False, "no such file")), 0.6)
    assert chunks_to_server() > 0  # the newest refused: chunks, directly
