"""Weights file hand-over (1.2): a peer on the learner's machine offering "weights_file" gets only a
manifest naming the file; others get chunks, planned only once one needs them; a peer that cannot
use the file is answered with chunks from then on; a server without the capability refuses it."""

from __future__ import annotations

from protocol_testkit import Net, learner, on_wire, rollout, tensors

from protocol import codec
from protocol.events import PeerWeightsApplied, WeightsFailed, WeightsReceived
from protocol.messages import (
    VALIDATION_CAPABILITY,
    WEIGHTS_FILE_CAPABILITY,
    MsgType,
    WeightsAnnounce,
)
from protocol.sender import SenderState

FILE = "/dev/shm/agentrl-weights-x/v3/model.safetensors"


def _net(*peers: tuple[bytes, str, list[str]]) -> Net:
    net = Net(learner(host="machine-a"))
    for ident, host, caps in peers:
        net.add(ident, rollout(ident.decode(), capabilities=caps, host=host))
    net.pump()
    assert all(c.state is SenderState.READY for c in net.conns.values())
    return net


def _announces(net: Net, ident: bytes) -> list[WeightsAnnounce]:
    return [r.decoded() for r in net.sent("down", MsgType.WEIGHTS_ANNOUNCE, ident)]


def test_local_file_peer_gets_the_file_others_get_chunks() -> None:
    net = _net((b"local", "machine-a", [WEIGHTS_FILE_CAPABILITY]),
               (b"remote", "machine-b", [WEIGHTS_FILE_CAPABILITY]),
               (b"old", "machine-a", [VALIDATION_CAPABILITY]))
    ts = tensors([16, 8])
    net.learner.publish_weights(3, ts, chunk_bytes=32, file=FILE)
    net.pump()
    (a,) = _announces(net, b"local")
    assert (a.file, a.num_chunks, a.version) == (FILE, 0, 3)
    assert [(s.name, s.dtype, s.shape, s.nbytes) for s in a.tensors] == [
        ("layer0.weight", "float32", [16], 64), ("layer1.weight", "float32", [8], 32)]
    assert not net.sent("down", MsgType.WEIGHTS_CHUNK, b"local")
    (got,) = net.events(b"local", WeightsReceived)
    assert got.weights.file == FILE and got.weights.tensors == [] and got.weights.version == 3
    for ident in (b"remote", b"old"):
        assert _announces(net, ident)[0].file == ""
        (ev,) = net.events(ident, WeightsReceived)
        assert len(ev.weights.tensors) == 2 and not ev.weights.file
    assert net.learner.chunks_planned


def test_chunks_are_planned_only_when_a_peer_needs_them() -> None:
    net = _net((b"local", "machine-a", [WEIGHTS_FILE_CAPABILITY]))
    net.learner.publish_weights(1, tensors([4]), file=FILE)
    net.pump()
    assert not net.learner.chunks_planned
    assert net.learner.file_peers_oldest_version() == 0
    conn = net.conns[b"local"]
    (ev,) = net.events(b"local", WeightsReceived)
    conn.weights_applied(1, ev.weights.transfer_id, ok=True, apply_time_s=0.1)
    net.pump()
    assert net.learner.file_peers_oldest_version() == 1
    net.add(b"joiner", rollout("joiner", host="machine-c"), request_weights=True)
    net.pump()
    assert net.learner.chunks_planned and net.events(b"joiner", WeightsReceived)


def test_a_peer_that_cannot_use_the_file_gets_chunks_from_then_on() -> None:
    net = _net((b"local", "machine-a", [WEIGHTS_FILE_CAPABILITY]))
    net.learner.publish_weights(2, tensors([4]), file=FILE)
    net.pump()
    (ev,) = net.events(b"local", WeightsReceived)
    net.conns[b"local"].weights_applied(2, ev.weights.transfer_id, ok=False, error="no such file")
    net.pump()
    assert [e.applied.ok for e in net.learner_events_of(PeerWeightsApplied)] == [False]
    second = net.events(b"local", WeightsReceived)[-1]
    assert second.weights.version == 2 and len(second.weights.tensors) == 1 and not second.weights.file
    net.learner.publish_weights(3, tensors([4], seed=1), file=FILE)
    net.pump()
    assert _announces(net, b"local")[-1].file == ""  # remembered for later versions too
    assert net.learner.file_peers_oldest_version() is None


def test_a_server_without_the_capability_refuses_a_file_announce() -> None:
    net = _net((b"r0", "machine-a", []))
    conn = net.conns[b"r0"]
    ann = WeightsAnnounce(4, "t", [], 0, file=FILE)
    events = conn.receive(on_wire(codec.encode(ann)), net.clock.now)
    (failed,) = [e for e in events if isinstance(e, WeightsFailed)]
    assert "weights_file" in failed.reason


def test_file_announce_with_chunks_is_refused() -> None:
    net = _net((b"r0", "machine-a", [WEIGHTS_FILE_CAPABILITY]))
    bad = WeightsAnnounce(4, "t", [], 2, file=FILE)
    events = net.conns[b"r0"].receive(on_wire(codec.encode(bad)), net.clock.now)
    (failed,) = [e for e in events if isinstance(e, WeightsFailed)]
    assert "no chunks" in failed.reason
