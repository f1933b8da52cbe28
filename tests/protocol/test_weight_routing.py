"""The learner end's weight routes on their own (``protocol.weight_routing``): a slot file for a
server on this machine, chunks for the others (planned once, only when needed), chunks again after
a failed file hand-over, and the oldest version a file-taking server runs."""

from __future__ import annotations

from protocol import codec
from protocol.messages import WEIGHTS_FILE_CAPABILITY, Hello, MsgType, WeightsApplied, Welcome
from protocol.peers import Peer
from protocol.reference import REFERENCE_MODEL, REFERENCE_TOKENIZER, reference_weights
from protocol.weight_routing import Frames, WeightRouting


def peer(name: str, host: str, *caps: str, version: int = 0) -> Peer:
    ids = (REFERENCE_MODEL, REFERENCE_TOKENIZER)
    hello = Hello([1, 5], name, "rollout-server", "e", *ids, version, list(caps), host=host)
    return Peer(name.encode(), hello, policy_version=version)


def routing(*peers: Peer) -> tuple[WeightRouting, list[tuple[bytes, Frames]]]:
    sent: list[tuple[bytes, Frames]] = []

    def welcome(upstream: str) -> Welcome:
        raise AssertionError("no relay here")

    r = WeightRouting(
        {p.identity: p for p in peers},
        host="here",
        send=lambda ident, frames: sent.append((ident, frames)),
        relay_welcome=welcome,
    )
    return r, sent


def kinds(sent: list[tuple[bytes, Frames]], ident: bytes) -> list[MsgType]:
    return [codec.peek_type(f) for i, f in sent if i == ident]


def test_a_local_file_taker_gets_the_file_and_chunks_are_planned_only_for_others() -> None:
    local = peer("local", "here", WEIGHTS_FILE_CAPABILITY)
    r, sent = routing(local)
    r.publish(
        1, reference_weights(), 32 << 10, "/dev/shm/agentrl-weights-1-ab/v1/model.safetensors"
    )
    assert kinds(sent, b"local") == [MsgType.WEIGHTS_ANNOUNCE]
    assert not r.chunks_planned and r.version == 1
    remote = peer("remote", "elsewhere", WEIGHTS_FILE_CAPABILITY)
    r.send_to(remote)
    assert kinds(sent, b"remote")[0] == MsgType.WEIGHTS_ANNOUNCE and len(kinds(sent, b"remote")) > 1
    assert r.chunks_planned


def test_a_failed_file_hand_over_falls_back_to_chunks() -> None:
    local = peer("local", "here", WEIGHTS_FILE_CAPABILITY)
    r, sent = routing(local)
    r.publish(
        2, reference_weights(), 32 << 10, "/dev/shm/agentrl-weights-1-ab/v2/model.safetensors"
    )
    assert r.file_peers_oldest_version() == 0
    (frames,) = [f for _, f in sent]
    transfer = codec.decode(frames).transfer_id
    sent.clear()
    r.applied(local, WeightsApplied(2, transfer, ok=False, error="no such file"))
    assert local.refused_file and len(kinds(sent, b"local")) > 1  # the chunked transfer
    assert r.file_peers_oldest_version() is None  # it takes no files any more


def test_an_applied_version_is_the_peers_own() -> None:
    local = peer("local", "here", WEIGHTS_FILE_CAPABILITY)
    r, _ = routing(local)
    r.publish(3, reference_weights(), 32 << 10, "")
    r.applied(local, WeightsApplied(3, "t", ok=True))
    assert local.policy_version == 3 and r.file_peers_oldest_version() == 3
