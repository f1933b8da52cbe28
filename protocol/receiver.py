"""Sans-IO state machine of the learner end: all rollout-server peers of one listening socket.

Peers are keyed by transport identity (a ZeroMQ routing id) until their HELLO names them; a peer
reconnecting under a new identity replaces its old entry. Credits: the learner has room for
``capacity`` batches; room is either buffered (received, not yet consumed by training) or promised
(credits granted and unused). Credits are handed out only from free room, so a conforming sender
can never overflow the buffer; ``batch_consumed`` frees room. Deduplication is two-level: batch
sequence numbers per sender epoch (cheap, catches resends after reconnects) and trajectory ids in a
bounded recency window (catches a restarted sender resending spooled trajectories in a new epoch).
Any invalid input is answered with a typed ERROR to that peer only; nothing a peer sends can raise
out of ``receive``.

Durability (``hold_batches``): an ACK tells the sender it may delete the batch, so a learner that
must not lose accepted data stores it first. With ``hold_batches`` a new batch is not acknowledged
or recorded by ``receive``; it waits in ``held_batch`` until the application calls
``accept_batch`` (stored: dedup state updated, ACK queued, ``BatchReceived`` returned) or
``refuse_batch`` (ERROR INTERNAL, which makes the sender keep it and send it again). The dedup
state moves between learner lifetimes with ``export_state``/``restore_state`` plus
``replay_batch`` for batches stored after the export.

Admission (1.3): with ``admission`` on, a peer whose HELLO offers "admission" is told so in WELCOME
and may start prompt groups only as ``admit`` grants (ADMIT); which peer gets how many, on which
weights, is the application's policy (``learner.admission``). Heartbeats carry each sender epoch's
count of response tokens it generated and dropped itself (``dropped_tokens``, summed over epochs).

Weight relays (1.4, ``protocol.relay``): a peer whose HELLO offers "weight_relay" takes no credits
and gets a place in the relay chain (WELCOME ``relay_upstream``); only the head of the chain is
sent chunks. Servers on a relay's host that offer "weights_file" are handed that relay's verified
file once it reports it (WEIGHTS_APPLIED ``file``); everyone else still gets chunks.

Validation (1.1): ``request_validation`` asks every peer in session whose HELLO offered the
"validation" capability (never another: a 1.0 peer would not know the message) and remembers the
request per peer; its VALIDATE_RESULT becomes ``ValidationReceived``, a result nobody asked that
peer for is UNEXPECTED, and a peer that leaves with requests unanswered yields one
``ValidationAbandoned`` per request, so the application never waits for an answer that cannot come.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol import codec
from protocol.batch import as_columns
from protocol.budget import MessageBudget
from protocol.columns import FRAMES_NUMBERS
from protocol.errors import ErrorCode, ProtocolError
from protocol.events import (
    BatchReceived,
    BatchRefused,
    Event,
    PeerClosed,
    PeerError,
    PeerJoined,
    PeerTimedOut,
    PeerWeightsApplied,
    ProtocolViolation,
    ValidationAbandoned,
    ValidationReceived,
)
from protocol.messages import (
    ADMISSION_CAPABILITY,
    PROBE_CAPABILITY,
    TYPE_OF,
    VALIDATION_CAPABILITY,
    WEIGHT_RELAY_CAPABILITY,
    WEIGHTS_FILE_CAPABILITY,
    Ack,
    Admit,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Identity,
    Limits,
    MsgType,
    TensorSpec,
    TrajectoryBatch,
    ValidateRequest,
    ValidateResult,
    WeightsAnnounce,
    WeightsApplied,
    Welcome,
)
from protocol.relay import RelayTier
from protocol.trajectory import Trajectory
from protocol.version import PROTOCOL_VERSION, ProtocolVersion
from protocol.weights import NamedBuffer, plan_transfer

Frames = list[codec.Frame]

SMALL_MESSAGE_BYTES = 1 << 20  # what a peer may send before HELLO, or in session without a credit
_BATCH_FRAMES = 2 + FRAMES_NUMBERS  # the most frames any message to a learner has (a 1.5 batch)


@dataclass
class _Stream:
    """Sequence numbers received from one sender epoch: all below ``next_seq``, plus ``above``."""

    next_seq: int = 1
    above: set[int] = field(default_factory=set)

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, int) and (seq < self.next_seq or seq in self.above)

    def add(self, seq: int) -> bool:
        """Record ``seq``; False if it was already received."""
        if seq < self.next_seq or seq in self.above:
            return False
        self.above.add(seq)
        while self.next_seq in self.above:
            self.above.discard(self.next_seq)
            self.next_seq += 1
        return True


@dataclass
class _Peer:
    identity: bytes
    hello: Hello | None = None
    credits: int = 0  # granted and not yet used
    last_recv: float = 0.0
    last_sent: float = 0.0
    policy_version: int = 0
    validations: set[str] = field(default_factory=set)  # requests sent and not answered yet
    refused_file: bool = False  # failed a file hand-over: gets chunks

    @property
    def name(self) -> str:
        return self.hello.peer_id if self.hello else self.identity.hex()

    @property
    def validates(self) -> bool:
        return self.hello is not None and VALIDATION_CAPABILITY in self.hello.capabilities

    @property
    def admits(self) -> bool:
        return self.hello is not None and ADMISSION_CAPABILITY in self.hello.capabilities


@dataclass
class _Publication:
    """The latest published weights; chunk frames are planned lazily (``_chunk_frames``)."""

    version: int
    tensors: list[NamedBuffer]
    chunk_bytes: int
    file: str = ""
    file_frames: Frames | None = None
    file_transfer_id: str = ""


@dataclass
class _Held:
    """A new batch waiting to be stored by the application (``hold_batches``)."""

    identity: bytes
    ids: list[str]  # all of the batch's trajectory ids, duplicates included
    event: BatchReceived


class RecentIds:
    """The trajectory ids seen recently: remembers at least the last ``window`` and at most about
    twice that. Two generations of sets instead of an ordered dict: a batch of new ids (the common
    case) is checked and added with a few C-level set operations, and old ids are dropped a whole
    generation at a time instead of one by one."""

    def __init__(self, window: int) -> None:
        self.window = max(1, window)
        self._cur: set[str] = set()
        self._prev: set[str] = set()

    def __contains__(self, tid: object) -> bool:
        return tid in self._cur or tid in self._prev

    def __len__(self) -> int:
        return len(self._cur) + len(self._prev)

    def unseen(self, ids: list[str]) -> list[int] | None:
        """What ``add_new`` would return, without remembering anything."""
        new = set(ids)
        if len(new) == len(ids) and self._cur.isdisjoint(new) and self._prev.isdisjoint(new):
            return None
        keep, repeated = [], set()
        for i, tid in enumerate(ids):
            if tid not in self and tid not in repeated:
                repeated.add(tid)
                keep.append(i)
        return keep

    def export(self) -> list[str]:
        """The remembered ids, older generation first."""
        return [*self._prev, *self._cur]

    def restore(self, ids: Sequence[str]) -> None:
        """Remember ``ids`` (as ``export`` lists them) instead of what this window held."""
        ids = list(ids)[-2 * self.window :]
        self._cur = set(ids[-self.window :])
        self._prev = set(ids[: -self.window]) if len(ids) > self.window else set()

    def add_new(self, ids: list[str]) -> list[int] | None:
        """Remember ``ids``. None if all were new (and distinct), else the indices of the new ones
        (an id repeated inside ``ids`` counts once)."""
        new = set(ids)
        if len(new) == len(ids) and self._cur.isdisjoint(new) and self._prev.isdisjoint(new):
            if len(self._cur) + len(new) > self.window:
                self._prev, self._cur = self._cur, set()
            self._cur |= new
            return None
        keep = []
        for i, tid in enumerate(ids):
            if tid not in self:
                if len(self._cur) >= self.window:
                    self._prev, self._cur = self._cur, set()
                self._cur.add(tid)
                keep.append(i)
        return keep


class LearnerProtocol:
    def __init__(
        self,
        *,
        tokenizer: Identity,
        peer_id: str = "learner",
        capacity: int = 16,
        max_credits_per_peer: int = 4,
        limits: codec.CodecLimits | None = None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
        dedup_window: int = 1_000_000,
        version: ProtocolVersion = PROTOCOL_VERSION,
        hold_batches: bool = False,
        host: str = "",
        admission: bool = False,
        small_message_bytes: int = SMALL_MESSAGE_BYTES,
    ) -> None:
        self.admission = (
            admission  # grant prompt groups to peers that offer "admission" (``admit``)
        )
        self.host = (
            host  # this machine's key (``common.hostkey``): peers with the same may get files
        )
        self.tokenizer, self.peer_id = tokenizer, peer_id
        self.capacity, self.max_credits_per_peer = capacity, max_credits_per_peer
        self.limits = limits or codec.CodecLimits()
        self.heartbeat_interval_s, self.heartbeat_timeout_s = (
            heartbeat_interval_s,
            heartbeat_timeout_s,
        )
        self.dedup_window, self.version = dedup_window, version
        self.session_id = uuid.uuid4().hex
        self.policy_version = 0
        self.buffered = 0  # batches handed to the application and not yet consumed
        self.peers: dict[bytes, _Peer] = {}
        self._streams: dict[tuple[str, str], _Stream] = {}
        self._seen = RecentIds(dedup_window)
        self._weights: list[Frames] = []  # frames of the latest published version, for joiners
        self._publication: _Publication | None = None
        self.relays = RelayTier()  # weight relays (1.4, ``protocol.relay``)
        self._out: list[tuple[bytes, Frames]] = []
        self.hold_batches = hold_batches
        self._held: _Held | None = None
        self._dropped: dict[tuple[str, str], int] = {}  # (peer_id, epoch) -> its dropped_tokens
        self.stats = {
            "batches": 0,
            "duplicate_batches": 0,
            "duplicate_trajectories": 0,
            "errors_sent": 0,
            "refused_batches": 0,
        }
        # Per-message budgets (``message_budget``): only a TRAJECTORY_BATCH is big, and only a peer
        # in session holding a credit may send one.
        self.small_message_bytes = small_message_bytes
        self._budgets = (
            MessageBudget(
                small_message_bytes,
                2,
                "before HELLO",
                ErrorCode.HELLO_REQUIRED,
                ((int(MsgType.HELLO), ErrorCode.TOO_LARGE),),
            ),
            MessageBudget(
                small_message_bytes,
                2,
                "a peer without a credit",
                ErrorCode.TOO_LARGE,
                ((int(MsgType.TRAJECTORY_BATCH), ErrorCode.CREDIT_EXCEEDED),),
            ),
            MessageBudget(self.limits.max_message_bytes, _BATCH_FRAMES, "max_message_bytes"),
        )

    # -- application API -------------------------------------------------------------------------
    @property
    def free_room(self) -> int:
        return self.capacity - self.buffered - sum(p.credits for p in self.peers.values())

    def ready_peers(self) -> list[str]:
        """Rollout servers in session (weight relays are not counted)."""
        return [
            p.name
            for p in self.peers.values()
            if p.hello is not None and p.identity not in self.relays.relays
        ]

    def validation_peers(self) -> list[str]:
        """Peers in session that answer validation requests."""
        return [p.name for p in self.peers.values() if p.validates]

    def admission_peers(self) -> list[str]:
        """Peers in session that start prompt groups only as ``admit`` grants (none without ``admission``)."""
        return [p.name for p in self.peers.values() if self.admission and p.admits]

    def admit(self, peer_id: str, groups: int, min_version: int) -> bool:
        """Allow ``peer_id`` to start ``groups`` more prompt groups on weights ``min_version`` or newer.
        False (nothing sent) when that peer is not in session or does not take grants."""
        for p in self.peers.values():
            if p.name == peer_id and self.admission and p.admits and groups > 0:
                self._out.append((p.identity, codec.encode(Admit(groups, min_version))))
                return True
        return False

    @property
    def dropped_tokens(self) -> int:
        """Response tokens the peers reported generating and dropping themselves, over all sender
        epochs seen (peers that left included)."""
        return sum(self._dropped.values())

    def request_validation(
        self, request_id: str, policy_version: int, *, timeout_s: float = 0.0
    ) -> list[str]:
        """Ask every peer in session that offers validation to validate ``policy_version`` (or newer);
        returns the names of the peers asked. Their answers come as ``ValidationReceived``, or as
        ``ValidationAbandoned`` for a peer that leaves first."""
        frames = codec.encode(ValidateRequest(request_id, policy_version, timeout_s))
        asked = []
        for p in self.peers.values():
            if p.validates and request_id not in p.validations:
                p.validations.add(request_id)
                self._out.append((p.identity, frames))
                asked.append(p.name)
        return asked

    def batch_consumed(self, n: int = 1) -> None:
        """The application finished with ``n`` batches: their room becomes credits again."""
        self.buffered = max(0, self.buffered - n)
        self._grant()

    def publish_weights(
        self,
        version: int,
        tensors: list[NamedBuffer],
        *,
        chunk_bytes: int = 64 << 20,
        file: str = "",
    ) -> None:
        """Send policy ``version`` to every connected peer (and later to joiners that ask).

        With ``file`` (a safetensors file holding exactly ``tensors``, e.g. memory-mapped from it),
        peers on this machine that offer "weights_file" get only a manifest naming the file; the
        chunks (and their checksums) are made only once some other peer needs them."""
        self.policy_version = version
        self._weights = []
        self._publication = _Publication(version, tensors, chunk_bytes, file)
        specs = [
            TensorSpec(t.name, t.dtype, list(t.shape), memoryview(t.data).nbytes, 0)
            for t in tensors
        ]
        self.relays.published(version, specs)
        if file:
            announce = WeightsAnnounce(version, uuid.uuid4().hex, specs, 0, file=file)
            self._publication.file_frames, self._publication.file_transfer_id = (
                codec.encode(announce),
                announce.transfer_id,
            )
        else:
            self._chunk_frames()
        for p in self.peers.values():
            if p.hello is not None:
                self._send_weights(p)

    @property
    def held_batch(self) -> BatchReceived | None:
        """With ``hold_batches``: the new batch waiting for ``accept_batch`` or ``refuse_batch``
        (``receive`` refuses to run until it is settled)."""
        return self._held.event if self._held is not None else None

    def accept_batch(self, receipt: Any = None) -> list[Event]:
        """The held batch is stored: record it as received, queue its ACK, and hand it over as
        ``BatchReceived`` (with ``persisted=receipt``). Its peer may have left meanwhile; the batch
        is the learner's all the same (the sender's resend will be a duplicate)."""
        held = self._take_held()
        ev = held.event
        self._streams.setdefault((ev.peer_id, ev.epoch), _Stream()).add(ev.seq)
        self._seen.add_new(held.ids)
        self.stats["batches"] += 1
        self.stats["duplicate_trajectories"] += ev.duplicate_trajectories
        if (peer := self.peers.get(held.identity)) is not None:
            self._out.append((peer.identity, codec.encode(Ack([ev.seq], self._top_up(peer)))))
        return [dataclasses.replace(ev, persisted=receipt) if receipt is not None else ev]

    def refuse_batch(self, reason: str) -> list[Event]:
        """The held batch could not be stored: nothing is recorded, and the sender is told to keep it
        and send it again (ERROR INTERNAL with its seq; both sides take back the credit it used)."""
        held = self._take_held()
        ev = held.event
        self.stats["refused_batches"] += 1
        self.buffered -= 1
        if (peer := self.peers.get(held.identity)) is not None:
            peer.credits += 1  # its room is promised to the sender again
            e = ProtocolError(
                ErrorCode.INTERNAL, f"batch {ev.seq} could not be stored ({reason}); send it again"
            )
            e.ref_type, e.ref_seq = int(MsgType.TRAJECTORY_BATCH), ev.seq
            self.stats["errors_sent"] += 1
            self._out.append((peer.identity, codec.encode(codec.error_message(e))))
        else:
            self._grant()
        return [BatchRefused(ev.peer_id, ev.seq, reason)]

    def export_state(self) -> dict[str, Any]:
        """The dedup state and policy version as plain msgpack/JSON types, for a checkpoint."""
        return {
            "streams": [
                [pid, epoch, s.next_seq, sorted(s.above)]
                for (pid, epoch), s in self._streams.items()
            ],
            "recent_ids": self._seen.export(),
            "policy_version": self.policy_version,
        }

    def restore_state(self, state: dict[str, Any]) -> None:
        """Take over ``export_state``'s output (of an earlier lifetime): reconnecting senders are told
        the right ``next_seq`` and their resends are recognised as duplicates."""
        self._streams = {
            (pid, epoch): _Stream(next_seq, set(above))
            for pid, epoch, next_seq, above in state["streams"]
        }
        self._seen.restore(state["recent_ids"])
        self.policy_version = int(state["policy_version"])

    def replay_batch(self, peer_id: str, epoch: str, seq: int, trajectory_ids: list[str]) -> None:
        """A batch stored in an earlier lifetime (a journal) is back in the application's buffer:
        record it as received (idempotent) and count its room until ``batch_consumed``."""
        self._streams.setdefault((peer_id, epoch), _Stream()).add(seq)
        self._seen.add_new(trajectory_ids)
        self.buffered += 1

    def close(self, reason: str = "learner shutting down") -> None:
        for p in self.peers.values():
            if p.hello is not None:
                self._out.append((p.identity, codec.encode(Bye(reason))))

    # -- driver API ------------------------------------------------------------------------------
    def message_budget(self, identity: bytes) -> MessageBudget:
        """The most the next message from ``identity`` may hold (``protocol.budget``): small before
        HELLO (its answer HELLO_REQUIRED, so a sender the learner forgot handshakes again and keeps
        its batches), small in session without a credit (a batch over it: CREDIT_EXCEEDED, which the
        sender resends later), ``max_message_bytes`` otherwise."""
        peer = self.peers.get(identity)
        if peer is None or peer.hello is None:
            return self._budgets[0]
        return self._budgets[2] if peer.credits > 0 else self._budgets[1]

    def data_to_send(self, now: float) -> list[tuple[bytes, Frames]]:
        for p in self.peers.values():
            if p.hello is not None and now - p.last_sent >= self.heartbeat_interval_s:
                self._out.append((p.identity, codec.encode(Heartbeat(now, self.policy_version))))
        out, self._out = self._out, []
        for ident, _ in out:
            if (p := self.peers.get(ident)) is not None:
                p.last_sent = now
        return out

    def next_deadline(self) -> float:
        ready = [p for p in self.peers.values() if p.hello is not None]
        if not ready:
            return float("inf")
        return min(
            min(p.last_sent + self.heartbeat_interval_s, p.last_recv + self.heartbeat_timeout_s)
            for p in ready
        )

    def tick(self, now: float) -> list[Event]:
        events: list[Event] = []
        for ident, p in list(self.peers.items()):
            if now - p.last_recv >= self.heartbeat_timeout_s:
                del self.peers[ident]
                self._relay_left(p)
                if p.hello is not None:
                    events.append(PeerTimedOut(p.name))
                    events += _abandoned(p, "timed out")
        if events:
            self._grant()
        return events

    def receive(self, identity: bytes, frames: Frames, now: float) -> list[Event]:
        if self._held is not None:
            raise RuntimeError(
                "accept_batch() or refuse_batch() the held batch before receiving more"
            )
        peer = self.peers.get(identity)
        msg = None
        try:
            msg = codec.decode(frames, self.limits)
            if isinstance(msg, Hello):
                return self._on_hello(identity, msg, now)
            if peer is None or peer.hello is None:
                e = ProtocolError(
                    ErrorCode.HELLO_REQUIRED, f"send HELLO before {type(msg).__name__}"
                )
                e.ref_seq = msg.seq if isinstance(msg, TrajectoryBatch) else 0
                raise e
            peer.last_recv = now
            return self._dispatch(peer, msg)
        except ProtocolError as e:
            if msg is not None and not e.ref_type:
                e.ref_type = int(TYPE_OF[type(msg)])
            if peer is not None:
                peer.last_recv = now
            if codec.should_answer(e):
                self.stats["errors_sent"] += 1
                self._out.append((identity, codec.encode(codec.error_message(e))))
            return [ProtocolViolation(peer.name if peer else identity.hex(), e)]

    # -- internals -------------------------------------------------------------------------------
    def _dispatch(self, peer: _Peer, msg: object) -> list[Event]:
        match msg:
            case TrajectoryBatch():
                return self._on_batch(peer, msg)
            case Heartbeat():
                if msg.dropped_tokens and peer.hello is not None:
                    key = (peer.hello.peer_id, peer.hello.epoch)
                    self._dropped[key] = max(self._dropped.get(key, 0), msg.dropped_tokens)
                return []
            case WeightsApplied():
                if msg.ok:
                    peer.policy_version = msg.version
                    if msg.file and (
                        host := self.relays.completed(peer.identity, msg.version, msg.file)
                    ):
                        self._relay_file_ready(host)
                elif msg.transfer_id in self.relays.transfer_ids:
                    # The relay's file could not be used. A file older than the host's newest may
                    # just be gone (a relay keeps its newest few; a "drain" server loads late): the
                    # newer one is handed already. Otherwise chunks from now on.
                    newest = self.relays.newest_file(peer.hello.host if peer.hello else "")
                    if (
                        newest is None
                        or self.relays.transfer_ids[msg.transfer_id] >= newest.version
                    ):
                        peer.refused_file = True
                        self._send_weights(peer)
                elif (
                    pub := self._publication
                ) is not None and msg.transfer_id == pub.file_transfer_id:
                    # The peer could not use the file (another /dev/shm, say): chunks from now on.
                    peer.refused_file = True
                    self._send_weights(peer)
                return [PeerWeightsApplied(peer.name, msg)]
            case Error():
                return [PeerError(peer.name, msg)]
            case ValidateResult():
                if msg.request_id not in peer.validations:
                    raise ProtocolError(
                        ErrorCode.UNEXPECTED,
                        f"VALIDATE_RESULT for request {msg.request_id!r}, "
                        "which this peer was not asked or has answered already",
                    )
                peer.validations.discard(msg.request_id)
                return [ValidationReceived(peer.name, msg)]
            case Bye():
                del self.peers[peer.identity]
                self._relay_left(peer)
                self._grant()
                return [PeerClosed(peer.name, msg.reason), *_abandoned(peer, "closed")]
        raise ProtocolError(ErrorCode.UNEXPECTED, f"{type(msg).__name__} is not sent to a learner")

    def _on_hello(self, identity: bytes, msg: Hello, now: float) -> list[Event]:
        theirs = ProtocolVersion(*msg.protocol_version)
        if not self.version.compatible_with(theirs):
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"peer {msg.peer_id} speaks protocol {theirs}, this learner speaks {self.version}; "
                "major versions must match",
            )
        if msg.role != "rollout-server":
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"role must be 'rollout-server', got {msg.role!r}",
                field="HELLO.role",
            )
        if (
            self.tokenizer.sha256
            and msg.tokenizer.sha256 != self.tokenizer.sha256
            and not RelayTier.is_relay(msg)  # a relay never tokenizes: it forwards bytes
        ):
            raise ProtocolError(
                ErrorCode.INCOMPATIBLE_MODEL,
                f"peer {msg.peer_id} uses tokenizer {msg.tokenizer.name} ({msg.tokenizer.sha256[:12]}), "
                f"the learner {self.tokenizer.name} ({self.tokenizer.sha256[:12]})",
                field="HELLO.tokenizer",
            )
        replaced: list[Event] = []
        for ident, p in list(self.peers.items()):  # same server, new socket: forget the old one
            if p.hello is not None and (p.hello.peer_id == msg.peer_id or ident == identity):
                del self.peers[ident]
                self._relay_left(p)
                replaced += _abandoned(p, "replaced by a new session")
        peer = self.peers[identity] = _Peer(identity, msg, 0, now, now, msg.policy_version)
        stream = self._streams.setdefault((msg.peer_id, msg.epoch), _Stream())
        relay = RelayTier.is_relay(msg)
        credits = 0 if relay else self._take_room(self.max_credits_per_peer)
        peer.credits = credits
        welcome = Welcome(
            protocol_version=list(self.version),
            peer_id=self.peer_id,
            session_id=self.session_id,
            credits=credits,
            policy_version=self.policy_version,
            next_seq=stream.next_seq,
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            limits=Limits(
                self.limits.max_message_bytes,
                self.limits.max_trajectories_per_batch,
                self.limits.max_tokens_per_trajectory,
            ),
            capabilities=[ADMISSION_CAPABILITY] if self.admission and peer.admits else [],
        )
        if relay:  # a weight relay: no credits, a place in the chain (SPEC §"Weight relays")
            self._reroute(self.relays.join(identity, msg))
            return [*replaced, PeerJoined(msg.peer_id, msg)]
        self._out.append((identity, codec.encode(welcome)))
        if self._publication and (
            msg.policy_version < 0 or msg.policy_version < self.policy_version
        ):
            self._send_weights(peer)
        return [*replaced, PeerJoined(msg.peer_id, msg)]

    def _on_batch(self, peer: _Peer, msg: TrajectoryBatch) -> list[Event]:
        assert peer.hello is not None
        if peer.credits <= 0:
            e = ProtocolError(ErrorCode.CREDIT_EXCEEDED, f"batch {msg.seq} sent without a credit")
            e.ref_type, e.ref_seq = 3, msg.seq
            raise e
        peer.credits -= 1
        stream = self._streams[(peer.hello.peer_id, peer.hello.epoch)]
        if msg.seq in stream:
            self.stats["duplicate_batches"] += 1
            peer.credits += 1  # a duplicate occupies no room: give its credit straight back
            self._out.append(
                (peer.identity, codec.encode(Ack([msg.seq], 1 + self._top_up(peer), [msg.seq])))
            )
            return []
        batch = as_columns(msg.trajectories)
        keep = self._seen.unseen(batch.ids)
        dups = 0 if keep is None else len(batch) - len(keep)
        # The common case (nothing seen before) hands the columns on untouched.
        fresh: Sequence[Trajectory] = batch if keep is None else [batch[i] for i in keep]
        if not fresh:  # empty, or every trajectory a duplicate: nothing to store, no room taken
            stream.add(msg.seq)
            self.stats["duplicate_trajectories"] += dups
            self.stats["batches"] += 1
            peer.credits += 1
            self._out.append((peer.identity, codec.encode(Ack([msg.seq], 1 + self._top_up(peer)))))
            return []
        self.buffered += (
            1  # its credit's room is buffered now, also while held (never granted twice)
        )
        self._held = _Held(
            peer.identity,
            batch.ids,
            BatchReceived(
                peer.hello.peer_id,
                msg.seq,
                fresh,
                dups,
                peer.hello.epoch,
                probe=PROBE_CAPABILITY in peer.hello.capabilities,
            ),
        )
        return [] if self.hold_batches else self.accept_batch()

    def _take_held(self) -> _Held:
        if self._held is None:
            raise RuntimeError("no batch is held")
        held, self._held = self._held, None
        return held

    def _take_room(self, want: int) -> int:
        return max(0, min(want, self.free_room))

    def _top_up(self, peer: _Peer) -> int:
        """Grant ``peer`` credits from free room up to its cap; returns the number granted."""
        if peer.identity in self.relays.relays:
            return 0  # a weight relay sends no batches
        n = self._take_room(self.max_credits_per_peer - peer.credits)
        peer.credits += n
        return n

    def _grant(self) -> None:
        """Hand free room to ready peers, fewest outstanding credits first."""
        for p in sorted(
            (p for p in self.peers.values() if p.hello is not None), key=lambda p: p.credits
        ):
            n = self._top_up(p)
            if n:
                self._out.append((p.identity, codec.encode(Ack([], n))))

    def _send_weights(self, peer: _Peer) -> None:
        pub = self._publication
        if pub is None:
            return
        if peer.identity in self.relays.relays:  # only the head of the chain gets them from here
            if self.relays.fed_by_learner(peer.identity):
                self._out.extend((peer.identity, frames) for frames in self._chunk_frames())
            return
        if pub.file_frames is not None and self._takes_files(peer):
            self._out.append((peer.identity, pub.file_frames))
            return
        if self._takes_relay_files(peer):
            assert peer.hello is not None
            frames = self.relays.file_announce(peer.identity, peer.hello.host, peer.policy_version)
            if frames is not None:
                self._out.append((peer.identity, frames))
            return  # the rest comes when its host's relay has verified it (``_relay_file_ready``)
        self._out.extend((peer.identity, frames) for frames in self._chunk_frames())

    # -- weight relays (1.4) ---------------------------------------------------------------------
    def _takes_relay_files(self, peer: _Peer) -> bool:
        h = peer.hello
        return (
            h is not None
            and not peer.refused_file
            and WEIGHTS_FILE_CAPABILITY in h.capabilities
            and self.relays.serves(h.host)
        )

    def _relay_file_ready(self, host: str) -> None:
        """A relay of ``host`` verified a newer version: hand its file to the servers there."""
        for p in self.peers.values():
            if p.hello is not None and p.hello.host == host and self._takes_relay_files(p):
                if (
                    frames := self.relays.file_announce(p.identity, host, p.policy_version)
                ) is not None:
                    self._out.append((p.identity, frames))

    def _reroute(self, routes: list[tuple[bytes, str]]) -> None:
        """WELCOME (again) to every relay whose upstream changed, naming it in ``relay_upstream``;
        one now fed by the learner gets the current version from here if it lacks it."""
        for ident, upstream in routes:
            p = self.peers.get(ident)
            if p is None or p.hello is None:
                continue
            welcome = Welcome(
                protocol_version=list(self.version),
                peer_id=self.peer_id,
                session_id=self.session_id,
                credits=0,
                policy_version=self.policy_version,
                next_seq=1,
                heartbeat_interval_s=self.heartbeat_interval_s,
                heartbeat_timeout_s=self.heartbeat_timeout_s,
                limits=Limits(
                    self.limits.max_message_bytes,
                    self.limits.max_trajectories_per_batch,
                    self.limits.max_tokens_per_trajectory,
                ),
                capabilities=[WEIGHT_RELAY_CAPABILITY],
                relay_upstream=upstream,
            )
            self._out.append((ident, codec.encode(welcome)))
            if upstream == "" and p.policy_version < self.policy_version:
                self._send_weights(p)

    def _relay_left(self, peer: _Peer) -> None:
        """``peer`` is gone: as a relay, the chain closes over it, and the servers of a host left
        without a relay get what they miss as chunks; as a server, its hand-over record goes."""
        self.relays.forget(peer.identity)
        if peer.identity not in self.relays.relays:
            return
        host = self.relays.relays[peer.identity].host
        self._reroute(self.relays.leave(peer.identity))
        if not self.relays.serves(host):
            for p in self.peers.values():
                if (
                    p.hello is not None
                    and p.hello.host == host
                    and p.identity not in self.relays.relays
                    and p.policy_version < self.policy_version
                ):
                    self._send_weights(p)

    def file_peers_oldest_version(self) -> int | None:
        """The lowest weights version applied by a connected peer that takes weight files (None:
        no such peer): files of older versions will not be read again."""
        versions = [p.policy_version for p in self.peers.values() if self._takes_files(p)]
        return min(versions) if versions else None

    @property
    def chunks_planned(self) -> bool:
        """Chunks of the current publication were planned (some peer needed them)."""
        return bool(self._weights)

    def _takes_files(self, peer: _Peer) -> bool:
        h = peer.hello
        return (
            h is not None
            and not peer.refused_file
            and bool(self.host)
            and h.host == self.host
            and WEIGHTS_FILE_CAPABILITY in h.capabilities
        )

    def _chunk_frames(self) -> list[Frames]:
        """The chunked transfer of the current publication, planned on first use."""
        pub = self._publication
        if pub is not None and not self._weights:
            announce, chunks = plan_transfer(pub.version, pub.tensors, chunk_bytes=pub.chunk_bytes)
            self._weights = [codec.encode(announce), *(codec.encode(c) for c in chunks)]
        return self._weights

    def error_for(self, identity: bytes, code: ErrorCode, message: str) -> None:
        """Queue an ERROR to a peer (used by drivers for transport-level problems)."""
        self._out.append((identity, codec.encode(Error(int(code), message, code.fatal))))


def _abandoned(peer: _Peer, reason: str) -> list[Event]:
    """One ``ValidationAbandoned`` per request ``peer`` leaves unanswered."""
    return [ValidationAbandoned(peer.name, rid, reason) for rid in sorted(peer.validations)]
