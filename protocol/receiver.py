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

Weights: ``publish_weights`` hands the version to ``protocol.weight_routing``, the sans-IO piece
beside this one that decides each peer's route (a slot file on this machine, a relay's file on its
host, chunks, or down the relay chain). Weight relays (1.4, ``protocol.relay``): a peer whose HELLO
offers "weight_relay" takes no credits and gets a place in the relay chain (WELCOME
``relay_upstream``); only the head of the chain is sent chunks.

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
    WEIGHT_RELAY_CAPABILITY,
    Ack,
    Admit,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Identity,
    MsgType,
    TrajectoryBatch,
    ValidateRequest,
    ValidateResult,
    WeightsApplied,
    Welcome,
)
from protocol.peers import Peer
from protocol.relay import RelayTier
from protocol.trajectory import Trajectory
from protocol.version import FRAME_PIECES, PROTOCOL_VERSION, ProtocolVersion
from protocol.weight_routing import WeightRouting
from protocol.weights import NamedBuffer

Frames = list[codec.Frame]

SMALL_MESSAGE_BYTES = 1 << 20  # what a peer may send before HELLO, or in session without a credit
STATS = ("batches", "duplicate_batches", "duplicate_trajectories", "errors_sent", "refused_batches")
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


class Senders:
    """What the learner remembers of its senders, per sender epoch ``(peer_id, epoch)``: two-level
    deduplication, batch sequence numbers per epoch (cheap, catches resends after reconnects) and
    trajectory ids in a recency window (catches a restarted sender resending spooled trajectories
    in a new epoch); and the response tokens each epoch reported dropping itself (1.3)."""

    def __init__(self, window: int) -> None:
        self.streams: dict[tuple[str, str], _Stream] = {}
        self.seen = RecentIds(window)
        self.dropped: dict[tuple[str, str], int] = {}  # cumulative per epoch: the largest seen

    def heard(self, hello: Hello, heartbeat: Heartbeat) -> None:
        """A heartbeat of the sender of ``hello``: its epoch's dropped tokens so far."""
        if heartbeat.dropped_tokens:
            key = (hello.peer_id, hello.epoch)
            self.dropped[key] = max(self.dropped.get(key, 0), heartbeat.dropped_tokens)

    def stream(self, peer_id: str, epoch: str) -> _Stream:
        return self.streams.setdefault((peer_id, epoch), _Stream())

    def record(self, peer_id: str, epoch: str, seq: int, ids: list[str]) -> None:
        """Batch ``seq`` of that sender epoch, holding trajectories ``ids``, is received."""
        self.stream(peer_id, epoch).add(seq)
        self.seen.add_new(ids)

    def export(self) -> dict[str, Any]:
        return {
            "streams": [
                [pid, epoch, s.next_seq, sorted(s.above)]
                for (pid, epoch), s in self.streams.items()
            ],
            "recent_ids": self.seen.export(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.streams = {
            (pid, epoch): _Stream(next_seq, set(above))
            for pid, epoch, next_seq, above in state["streams"]
        }
        self.seen.restore(state["recent_ids"])


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
        max_frame_bytes: int = 0,
    ) -> None:
        """``max_frame_bytes``: the transport's frame bound, announced in WELCOME; peers split
        larger frames into pieces of this size, joined here (SPEC §2; 0: frames arrive whole, and
        peers older than 1.6 are served)."""
        # Grant prompt groups to peers that offer "admission" (``admit``).
        self.admission = admission
        self.tokenizer, self.peer_id = tokenizer, peer_id
        self.capacity, self.max_credits_per_peer = capacity, max_credits_per_peer
        self.limits = limits or codec.CodecLimits()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.dedup_window, self.version = dedup_window, version
        self.session_id = uuid.uuid4().hex
        self.buffered = 0  # batches handed to the application and not yet consumed
        self.peers: dict[bytes, Peer] = {}
        self._senders = Senders(dedup_window)
        self._seen = self._senders.seen
        self._out: list[tuple[bytes, Frames]] = []
        self.routing = WeightRouting(
            self.peers, host=host, send=self._send, relay_welcome=self._relay_welcome
        )
        self.relays = self.routing.relays  # weight relays (1.4, ``protocol.relay``)
        self.hold_batches = hold_batches
        self._held: _Held | None = None
        self.stats = dict.fromkeys(STATS, 0)
        self.small_message_bytes = small_message_bytes
        self.max_frame_bytes = max_frame_bytes
        self._budgets = _budgets(
            small_message_bytes, self.limits.max_message_bytes, max_frame_bytes
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
        return sum(self._senders.dropped.values())

    def request_validation(
        self, request_id: str, policy_version: int, *, timeout_s: float = 0.0
    ) -> list[str]:
        """Ask every peer in session that offers validation to validate ``policy_version`` (or newer);
        returns the names of the peers asked. Their answers come as ``ValidationReceived``, or as
        ``ValidationAbandoned`` for a peer that leaves first."""
        frames = codec.encode(ValidateRequest(request_id, policy_version, timeout_s))
        asked = [p for p in self.peers.values() if p.ask(request_id)]
        self._out += [(p.identity, frames) for p in asked]
        return [p.name for p in asked]

    def batch_consumed(self, n: int = 1) -> None:
        """The application finished with ``n`` batches: their room becomes credits again."""
        self.buffered = max(0, self.buffered - n)
        self._grant()

    @property
    def policy_version(self) -> int:
        """The latest version published (or restored)."""
        return self.routing.version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.routing.version = version

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
        chunks (and their checksums) are made only once some other peer needs them. Which peer gets
        what is ``protocol.weight_routing``'s."""
        self.routing.publish(version, tensors, chunk_bytes, file)

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
        self._senders.record(ev.peer_id, ev.epoch, ev.seq, held.ids)
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
        return {**self._senders.export(), "policy_version": self.policy_version}

    def restore_state(self, state: dict[str, Any]) -> None:
        """Take over ``export_state``'s output (of an earlier lifetime): reconnecting senders are told
        the right ``next_seq`` and their resends are recognised as duplicates."""
        self._senders.restore(state)
        self.policy_version = int(state["policy_version"])

    def replay_batch(self, peer_id: str, epoch: str, seq: int, trajectory_ids: list[str]) -> None:
        """A batch stored in an earlier lifetime (a journal) is back in the application's buffer:
        record it as received (idempotent) and count its room until ``batch_consumed``."""
        self._senders.record(peer_id, epoch, seq, trajectory_ids)
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

    def hold_allowance(self, identity: bytes | None) -> int:
        """The most the peer of ``identity`` (None: not seen yet) may have sent that is not read
        yet (``protocol.hold_ledger``): before HELLO, one small message; in session, a batch for
        each credit it holds, and a batch's worth of small messages besides (heartbeats and
        answers that pile up while the learner's loop is busy). The transport's watch thread
        calls it: it only reads."""
        peer = self.peers.get(identity) if identity is not None else None
        if peer is None or peer.hello is None:
            return self._budgets[0].max_bytes
        return (1 + max(peer.credits, 0)) * self._budgets[2].max_bytes

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
        for p in list(self.peers.values()):
            if now - p.last_recv >= self.heartbeat_timeout_s:
                abandoned = self._drop(p, "timed out")
                if p.hello is not None:
                    events += [PeerTimedOut(p.name), *abandoned]
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
            msg = codec.decode(frames, self.limits, piece_bytes=self.max_frame_bytes)
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
    def _dispatch(self, peer: Peer, msg: object) -> list[Event]:
        match msg:
            case TrajectoryBatch():
                return self._on_batch(peer, msg)
            case Heartbeat():
                if peer.hello is not None:
                    self._senders.heard(peer.hello, msg)
                return []
            case WeightsApplied():
                self.routing.applied(peer, msg)
                return [PeerWeightsApplied(peer.name, msg)]
            case Error():
                return [PeerError(peer.name, msg)]
            case ValidateResult():
                peer.answered(msg.request_id)
                return [ValidationReceived(peer.name, msg)]
            case Bye():
                abandoned = self._drop(peer, "closed")
                self._grant()
                return [PeerClosed(peer.name, msg.reason), *abandoned]
        raise ProtocolError(ErrorCode.UNEXPECTED, f"{type(msg).__name__} is not sent to a learner")

    def _on_hello(self, identity: bytes, msg: Hello, now: float) -> list[Event]:
        _check_hello(msg, self.version, self.tokenizer, self.max_frame_bytes)
        replaced: list[Event] = []
        for ident, p in list(self.peers.items()):  # same server, new socket: forget the old one
            if p.hello is not None and (p.hello.peer_id == msg.peer_id or ident == identity):
                replaced += self._drop(p, "replaced by a new session")
        peer = self.peers[identity] = Peer(identity, msg, 0, now, now, msg.policy_version)
        stream = self._senders.stream(msg.peer_id, msg.epoch)
        relay = RelayTier.is_relay(msg)
        credits = 0 if relay else self._take_room(self.max_credits_per_peer)
        peer.credits = credits
        if relay:  # a weight relay: no credits, a place in the chain (SPEC §"Weight relays")
            self.routing.relay_joined(identity, msg)
            return [*replaced, PeerJoined(msg.peer_id, msg)]
        caps = [ADMISSION_CAPABILITY] if self.admission and peer.admits else []
        self._send(identity, codec.encode(welcome(self, credits, stream.next_seq, caps)))
        if self.routing.published and (
            msg.policy_version < 0 or msg.policy_version < self.policy_version
        ):
            self.routing.send_to(peer)
        return [*replaced, PeerJoined(msg.peer_id, msg)]

    def _on_batch(self, peer: Peer, msg: TrajectoryBatch) -> list[Event]:
        assert peer.hello is not None
        if peer.credits <= 0:
            e = ProtocolError(ErrorCode.CREDIT_EXCEEDED, f"batch {msg.seq} sent without a credit")
            e.ref_type, e.ref_seq = 3, msg.seq
            raise e
        peer.credits -= 1
        stream = self._senders.stream(peer.hello.peer_id, peer.hello.epoch)
        if msg.seq in stream:
            self.stats["duplicate_batches"] += 1
            peer.credits += 1  # a duplicate occupies no room: give its credit straight back
            self._out.append(
                (peer.identity, codec.encode(Ack([msg.seq], 1 + self._top_up(peer), [msg.seq])))
            )
            return []
        batch = as_columns(msg.trajectories)
        keep = self._senders.seen.unseen(batch.ids)
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
        # Its credit's room is buffered now, also while held (never granted twice).
        self.buffered += 1
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

    def _top_up(self, peer: Peer) -> int:
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

    def _relay_welcome(self, upstream: str) -> Welcome:
        """A weight relay's WELCOME: no credits, its place in the chain (``relay_upstream``)."""
        return welcome(self, 0, 1, [WEIGHT_RELAY_CAPABILITY], upstream)

    def _send(self, identity: bytes, frames: Frames) -> None:
        self._out.append((identity, frames))

    def _drop(self, peer: Peer, reason: str) -> list[ValidationAbandoned]:
        """``peer``'s session is over (``reason``): forgotten, and off the weight routes."""
        del self.peers[peer.identity]
        self.routing.left(peer)
        return peer.abandoned(reason)

    def error_for(self, identity: bytes, code: ErrorCode, message: str) -> None:
        """Queue an ERROR to a peer (used by drivers for transport-level problems)."""
        self._out.append((identity, codec.encode(Error(int(code), message, code.fatal))))


def welcome(
    p: LearnerProtocol,
    credits: int,
    next_seq: int,
    capabilities: list[str],
    relay_upstream: str = "",
) -> Welcome:
    """The WELCOME of a session with ``p``: its identity and settings, and what this peer gets."""
    return Welcome(
        protocol_version=list(p.version),
        peer_id=p.peer_id,
        session_id=p.session_id,
        credits=credits,
        policy_version=p.policy_version,
        next_seq=next_seq,
        heartbeat_interval_s=p.heartbeat_interval_s,
        heartbeat_timeout_s=p.heartbeat_timeout_s,
        limits=p.limits.announced(p.max_frame_bytes),
        capabilities=capabilities,
        relay_upstream=relay_upstream,
    )


def _check_hello(
    msg: Hello, ours: ProtocolVersion, tokenizer: Identity, max_frame_bytes: int = 0
) -> None:
    """A HELLO this learner cannot serve: another major version, a version that does not split
    frames to a learner with a frame bound, another role or tokenizer (a relay never tokenizes: it
    forwards bytes)."""
    theirs = ProtocolVersion(*msg.protocol_version)
    if not ours.compatible_with(theirs):
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"peer {msg.peer_id} speaks protocol {theirs}, this learner speaks {ours}; "
            "major versions must match",
        )
    if max_frame_bytes and theirs < FRAME_PIECES:
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"peer {msg.peer_id} speaks protocol {theirs}; this learner takes frames of at most "
            f"{max_frame_bytes} bytes, which senders split since {FRAME_PIECES}: upgrade the peer",
        )
    if msg.role != "rollout-server":
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"role must be 'rollout-server', got {msg.role!r}",
            field="HELLO.role",
        )
    if (
        tokenizer.sha256
        and msg.tokenizer.sha256 != tokenizer.sha256
        and not RelayTier.is_relay(msg)  # a relay never tokenizes: it forwards bytes
    ):
        raise ProtocolError(
            ErrorCode.INCOMPATIBLE_MODEL,
            f"peer {msg.peer_id} uses tokenizer {msg.tokenizer.name} ({msg.tokenizer.sha256[:12]}), "
            f"the learner {tokenizer.name} ({tokenizer.sha256[:12]})",
            field="HELLO.tokenizer",
        )


def _budgets(
    small: int, max_message_bytes: int, max_frame_bytes: int = 0
) -> tuple[MessageBudget, MessageBudget, MessageBudget]:
    """Per-message budgets (``LearnerProtocol.message_budget``): before HELLO, in session without a
    credit, in session with one. Only a TRAJECTORY_BATCH is big, and only a peer in session holding
    a credit may send one. With a frame bound, frames are counted as they arrive (pieces): a frame
    of n bytes arrives as n // max_frame_bytes + 1 of them."""

    def frames(n: int, nbytes: int) -> int:
        return n + nbytes // max_frame_bytes if max_frame_bytes else n

    return (
        MessageBudget(
            small,
            frames(2, small),
            "before HELLO",
            ErrorCode.HELLO_REQUIRED,
            ((int(MsgType.HELLO), ErrorCode.TOO_LARGE),),
        ),
        MessageBudget(
            small,
            frames(2, small),
            "a peer without a credit",
            ErrorCode.TOO_LARGE,
            ((int(MsgType.TRAJECTORY_BATCH), ErrorCode.CREDIT_EXCEEDED),),
        ),
        MessageBudget(
            max_message_bytes, frames(_BATCH_FRAMES, max_message_bytes), "max_message_bytes"
        ),
    )
