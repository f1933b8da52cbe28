"""Weights file hand-over (1.2): a peer on the learner's machine offering "weights_file" gets only a
manifest naming the file; others get chunks, planned only once one needs them; a peer that cannot
use the file is answered with chunks from then on; a server without the capability refuses it;
a slot file must resolve to a regular file inside the learner's ``agentrl-weights-*`` directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from protocol_testkit import Net, learner, on_wire, rollout, tensors

from protocol import codec
from protocol.errors import ErrorCode, ProtocolError
from protocol.events import PeerWeightsApplied, WeightsAnnounced, WeightsFailed, WeightsReceived
from protocol.messages import (
    VALIDATION_CAPABILITY,
    WEIGHTS_FILE_CAPABILITY,
    MsgType,
    TensorSpec,
    WeightsAnnounce,
)
from protocol.sender import SenderState
from protocol.weights import WeightAssembler, check_weights_file

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
    net = _net(
        (b"local", "machine-a", [WEIGHTS_FILE_CAPABILITY]),
        (b"remote", "machine-b", [WEIGHTS_FILE_CAPABILITY]),
        (b"old", "machine-a", [VALIDATION_CAPABILITY]),
    )
    ts = tensors([16, 8])
    net.learner.publish_weights(3, ts, chunk_bytes=32, file=FILE)
    net.pump()
    (a,) = _announces(net, b"local")
    assert (a.file, a.num_chunks, a.version) == (FILE, 0, 3)
    assert [(s.name, s.dtype, s.shape, s.nbytes) for s in a.tensors] == [
        ("layer0.weight", "float32", [16], 64),
        ("layer1.weight", "float32", [8], 32),
    ]
    assert not net.sent("down", MsgType.WEIGHTS_CHUNK, b"local")
    (got,) = net.events(b"local", WeightsReceived)
    assert got.weights.file == FILE and got.weights.tensors == [] and got.weights.version == 3
    for ident in (b"remote", b"old"):
        assert _announces(net, ident)[0].file == ""
        (ev,) = net.events(ident, WeightsReceived)
        assert len(ev.weights.tensors) == 2 and not ev.weights.file
    assert net.learner.routing.chunks_planned


def test_chunks_are_planned_only_when_a_peer_needs_them() -> None:
    net = _net((b"local", "machine-a", [WEIGHTS_FILE_CAPABILITY]))
    net.learner.publish_weights(1, tensors([4]), file=FILE)
    net.pump()
    assert not net.learner.routing.chunks_planned
    assert net.learner.routing.file_peers_oldest_version() == 0
    conn = net.conns[b"local"]
    (ev,) = net.events(b"local", WeightsReceived)
    conn.weights_applied(1, ev.weights.transfer_id, ok=True, apply_time_s=0.1)
    net.pump()
    assert net.learner.routing.file_peers_oldest_version() == 1
    net.add(b"joiner", rollout("joiner", host="machine-c"), request_weights=True)
    net.pump()
    assert net.learner.routing.chunks_planned and net.events(b"joiner", WeightsReceived)


def test_a_peer_that_cannot_use_the_file_gets_chunks_from_then_on() -> None:
    net = _net((b"local", "machine-a", [WEIGHTS_FILE_CAPABILITY]))
    net.learner.publish_weights(2, tensors([4]), file=FILE)
    net.pump()
    (ev,) = net.events(b"local", WeightsReceived)
    net.conns[b"local"].weights_applied(2, ev.weights.transfer_id, ok=False, error="no such file")
    net.pump()
    assert [e.applied.ok for e in net.learner_events_of(PeerWeightsApplied)] == [False]
    second = net.events(b"local", WeightsReceived)[-1]
    assert (
        second.weights.version == 2 and len(second.weights.tensors) == 1 and not second.weights.file
    )
    net.learner.publish_weights(3, tensors([4], seed=1), file=FILE)
    net.pump()
    assert _announces(net, b"local")[-1].file == ""  # remembered for later versions too
    assert net.learner.routing.file_peers_oldest_version() is None


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


# -- the slot file must lie in the learner's weights directory (SPEC §8) ---------------------------
def _slot(root: Path, name: str = "agentrl-weights-123-abcd", size: int = 64) -> Path:
    path = root / name / "v3" / "model.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(size))
    return path


def test_a_slot_file_inside_the_directory_is_accepted_by_its_real_path(tmp_path: Path) -> None:
    path = _slot(tmp_path / "shm")
    assert check_weights_file(str(path), [str(tmp_path / "shm")], 64) == os.path.realpath(path)
    link = tmp_path / "shm" / "agentrl-weights-123-abcd" / "latest.safetensors"
    link.symlink_to(path)  # a link that stays inside is fine: the real path is handed on
    assert check_weights_file(
        str(link), [str(tmp_path / "elsewhere"), str(tmp_path / "shm")], 1
    ) == str(path)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda root: "/etc/passwd", "is not inside a learner weights directory"),
        (lambda root: "relative/model.safetensors", "is not an absolute path"),
        (
            lambda root: f"{_slot(root).parent}{'/..' * 30}/etc/passwd",
            "(resolves to /etc/passwd) is not inside",
        ),
        # not an agentrl-weights-* folder
        (lambda root: str(_slot(root, "other-dir")), "is not inside"),
        (lambda root: str(root / "agentrl-weights-x"), "is not inside"),  # the folder itself
        (lambda root: str(_slot(root).parent), "is not a regular file"),
        (lambda root: str(root / "agentrl-weights-x" / "nothing"), "No such file or directory"),
        (lambda root: str(_slot(root, size=10)), "holds 10 bytes, the announced tensors need 64"),
    ],
)
def test_a_slot_file_elsewhere_is_refused(tmp_path: Path, make: Any, words: str) -> None:
    root = tmp_path / "shm"
    (root / "agentrl-weights-x").mkdir(parents=True)
    path = make(root)
    with pytest.raises(ProtocolError) as e:
        check_weights_file(path, [str(root)], 64)
    assert (e.value.code, e.value.field) == (ErrorCode.INVALID_FIELD, "file")
    assert words in e.value.message, e.value.message


def test_a_symlink_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    link = root / "agentrl-weights-1-a" / "v1" / "model.safetensors"
    link.parent.mkdir(parents=True)
    link.symlink_to("/etc/passwd")
    with pytest.raises(ProtocolError, match="resolves to /etc/passwd"):
        check_weights_file(str(link), [str(root)], 1)


def test_a_refused_file_announce_is_answered_with_an_error(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    net = Net(learner(host="machine-a"))
    conn = net.add(
        b"r0",
        rollout(
            "r0",
            capabilities=[WEIGHTS_FILE_CAPABILITY],
            host="machine-a",
            weights=WeightAssembler(file_roots=[str(root)]),
        ),
    )
    net.pump()
    spec = TensorSpec("w", "float32", [16], 64, 0)
    events = conn.receive(
        on_wire(codec.encode(WeightsAnnounce(4, "bad", [spec], 0, file="/etc/shadow"))), 0.0
    )
    assert [type(e) for e in events] == [WeightsFailed]
    applied, err = (codec.decode(f) for f in conn.data_to_send(0.0))
    assert (applied.ok, err.code, err.field) == (False, ErrorCode.INVALID_FIELD, "file")
    assert (
        "'/etc/shadow' (resolves to /etc/shadow) is not inside a learner weights directory"
        in err.message
    )
    assert str(root / "agentrl-weights-*") in err.message
    good = _slot(root)
    events = conn.receive(
        on_wire(codec.encode(WeightsAnnounce(5, "good", [spec], 0, file=str(good)))), 0.0
    )
    assert [type(e) for e in events] == [WeightsAnnounced, WeightsReceived]
    assert events[1].weights.file == os.path.realpath(good)
