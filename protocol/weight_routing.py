"""Sans-IO weight routing of the learner end: which peer gets the current policy version, and how.

``LearnerProtocol`` (``protocol.receiver``) owns the peers and the sessions; this piece beside it
decides, for each peer, the route of a published version (SPEC §8 and §"Weight relays"):

- A peer on the learner's own machine (same ``host`` key) that offers "weights_file" gets only a
  manifest naming the learner's slot file (``file``), unless it failed such a hand-over before.
- A weight relay (1.4) gets chunks from here only at the head of the relay chain; the others are
  fed by their upstream relay. A relay joining or leaving re-routes the chain: every relay whose
  upstream changed is WELCOMEd again with its new ``relay_upstream``.
- A server on a relay's host that offers "weights_file" is handed that relay's verified file once
  the relay reports it (WEIGHTS_APPLIED ``file``); a host left without a relay gets chunks again.
- Everyone else gets chunks, planned once per version on first use (``chunks_planned``).

Nothing here touches a socket: every method appends ``(identity, frames)`` to the protocol's
outgoing queue through ``send``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from protocol import codec
from protocol.messages import (
    WEIGHTS_FILE_CAPABILITY,
    Hello,
    TensorSpec,
    WeightsAnnounce,
    WeightsApplied,
    Welcome,
)
from protocol.peers import Peer
from protocol.relay import RelayTier
from protocol.weights import NamedBuffer, plan_transfer

Frames = list[codec.Frame]


@dataclass
class _Publication:
    """The latest published weights; chunk frames are planned lazily (``_chunk_frames``)."""

    version: int
    tensors: list[NamedBuffer]
    chunk_bytes: int
    file: str = ""
    file_frames: Frames | None = None
    file_transfer_id: str = ""


class WeightRouting:
    def __init__(
        self,
        peers: dict[bytes, Peer],
        *,
        host: str,
        send: Callable[[bytes, Frames], None],
        relay_welcome: Callable[[str], Welcome],
    ) -> None:
        """``peers``: the protocol's (read, never changed here); ``host``: this machine's key
        (``common.hostkey``): peers with the same may get files; ``send(identity, frames)`` queues
        a message; ``relay_welcome(upstream)``: the WELCOME a relay gets for a place in the chain."""
        self._peers, self.host, self._send, self._relay_welcome = peers, host, send, relay_welcome
        self.relays = RelayTier()  # weight relays (1.4, ``protocol.relay``)
        self.version = 0  # the latest version published (or restored)
        self._chunks: list[Frames] = []  # frames of the latest published version, for joiners
        self._publication: _Publication | None = None

    @property
    def published(self) -> bool:
        return self._publication is not None

    def publish(
        self, version: int, tensors: list[NamedBuffer], chunk_bytes: int, file: str
    ) -> None:
        """Route ``version`` to every peer in session (and later to joiners that ask). With ``file``
        the chunks (and their checksums) are made only once some peer needs them."""
        self.version = version
        self._chunks = []
        self._publication = _Publication(version, tensors, chunk_bytes, file)
        specs = [
            TensorSpec(t.name, t.dtype, list(t.shape), memoryview(t.data).nbytes, 0)
            for t in tensors
        ]
        self.relays.published(version, specs)
        if file:
            announce = WeightsAnnounce(version, uuid.uuid4().hex, specs, 0, file=file)
            self._publication.file_frames = codec.encode(announce)
            self._publication.file_transfer_id = announce.transfer_id
        else:
            self._chunk_frames()
        for p in self._peers.values():
            if p.hello is not None:
                self.send_to(p)

    def send_to(self, peer: Peer) -> None:
        """The current version to ``peer``, by its route."""
        pub = self._publication
        if pub is None:
            return
        if peer.identity in self.relays.relays:  # only the head of the chain gets them from here
            if self.relays.fed_by_learner(peer.identity):
                self._send_all(peer.identity, self._chunk_frames())
            return
        if pub.file_frames is not None and self._takes_files(peer):
            self._send(peer.identity, pub.file_frames)
            return
        if self._takes_relay_files(peer):
            assert peer.hello is not None
            frames = self.relays.file_announce(peer.identity, peer.hello.host, peer.policy_version)
            if frames is not None:
                self._send(peer.identity, frames)
            return  # the rest comes when its host's relay has verified it (``_relay_file_ready``)
        self._send_all(peer.identity, self._chunk_frames())

    def applied(self, peer: Peer, msg: WeightsApplied) -> None:
        """``peer``'s WEIGHTS_APPLIED: its version, a relay's verified file, or a failed file
        hand-over (chunks from now on)."""
        if msg.ok:
            peer.policy_version = msg.version
            if msg.file and (host := self.relays.completed(peer.identity, msg.version, msg.file)):
                self._relay_file_ready(host)
        elif msg.transfer_id in self.relays.transfer_ids:
            # The relay's file could not be used. A file older than the host's newest may just be
            # gone (a relay keeps its newest few; a "drain" server loads late): the newer one is
            # handed already. Otherwise chunks from now on.
            newest = self.relays.newest_file(peer.hello.host if peer.hello else "")
            if newest is None or self.relays.transfer_ids[msg.transfer_id] >= newest.version:
                peer.refused_file = True
                self.send_to(peer)
        elif (pub := self._publication) is not None and msg.transfer_id == pub.file_transfer_id:
            # The peer could not use the file (another /dev/shm, say): chunks from now on.
            peer.refused_file = True
            self.send_to(peer)

    def relay_joined(self, identity: bytes, hello: Hello) -> None:
        """A weight relay joined: it gets a place in the chain (SPEC §"Weight relays")."""
        self._reroute(self.relays.join(identity, hello))

    def left(self, peer: Peer) -> None:
        """``peer`` is gone: as a relay, the chain closes over it, and the servers of a host left
        without a relay get what they miss as chunks; as a server, its hand-over record goes."""
        self.relays.forget(peer.identity)
        if peer.identity not in self.relays.relays:
            return
        host = self.relays.relays[peer.identity].host
        self._reroute(self.relays.leave(peer.identity))
        if not self.relays.serves(host):
            for p in self._peers.values():
                if (
                    p.hello is not None
                    and p.hello.host == host
                    and p.identity not in self.relays.relays
                    and p.policy_version < self.version
                ):
                    self.send_to(p)

    def file_peers_oldest_version(self) -> int | None:
        """The lowest weights version applied by a connected peer that takes weight files (None:
        no such peer): files of older versions will not be read again."""
        versions = [p.policy_version for p in self._peers.values() if self._takes_files(p)]
        return min(versions) if versions else None

    @property
    def chunks_planned(self) -> bool:
        """Chunks of the current publication were planned (some peer needed them)."""
        return bool(self._chunks)

    def _send_all(self, identity: bytes, frames: list[Frames]) -> None:
        for f in frames:
            self._send(identity, f)

    def _takes_files(self, peer: Peer) -> bool:
        h = peer.hello
        return (
            h is not None
            and not peer.refused_file
            and bool(self.host)
            and h.host == self.host
            and WEIGHTS_FILE_CAPABILITY in h.capabilities
        )

    def _takes_relay_files(self, peer: Peer) -> bool:
        h = peer.hello
        return (
            h is not None
            and not peer.refused_file
            and WEIGHTS_FILE_CAPABILITY in h.capabilities
            and self.relays.serves(h.host)
        )

    def _relay_file_ready(self, host: str) -> None:
        """A relay of ``host`` verified a newer version: hand its file to the servers there."""
        for p in self._peers.values():
            if p.hello is not None and p.hello.host == host and self._takes_relay_files(p):
                frames = self.relays.file_announce(p.identity, host, p.policy_version)
                if frames is not None:
                    self._send(p.identity, frames)

    def _reroute(self, routes: list[tuple[bytes, str]]) -> None:
        """WELCOME (again) to every relay whose upstream changed, naming it in ``relay_upstream``;
        one now fed by the learner gets the current version from here if it lacks it."""
        for ident, upstream in routes:
            p = self._peers.get(ident)
            if p is None or p.hello is None:
                continue
            self._send(ident, codec.encode(self._relay_welcome(upstream)))
            if upstream == "" and p.policy_version < self.version:
                self.send_to(p)

    def _chunk_frames(self) -> list[Frames]:
        """The chunked transfer of the current publication, planned on first use."""
        pub = self._publication
        if pub is not None and not self._chunks:
            announce, chunks = plan_transfer(pub.version, pub.tensors, chunk_bytes=pub.chunk_bytes)
            self._chunks = [codec.encode(announce), *(codec.encode(c) for c in chunks)]
        return self._chunks
