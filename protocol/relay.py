"""Weight relays (protocol 1.4, capability "weight_relay"): the sans-IO cores of both ends.

The learner sends each policy version once, to the head of a chain of relays (one per host); each
relay forwards every announce and chunk, as it arrives, to the relay behind it, assembles the
version into a slot file on its host's /dev/shm (every xxh3 checksum of the learner's announce
verified, ``protocol.weights``) and reports the file in WEIGHTS_APPLIED ``file``. The learner then
hands that file, as a 1.2 file announce, to every rollout server of that host that offers
"weights_file"; everyone else (an old peer, a host without a relay) still gets chunks directly.

``RelayTier`` is the learner's view: the chain (relays in order of joining, each taking weights
from the one before it, the first from the learner), the newest verified file per host, and which
file version each server was handed. When a relay leaves (BYE, heartbeat timeout, replaced) the
chain closes over the gap: the relay behind it is routed to the one before it (WELCOME
``relay_upstream`` again), re-attaches and is sent the whole transfer again; chunks it already
has are skipped, so it still gets the version.

``RelayNode`` is the relay's view: the learner link (HELLO / WELCOME / heartbeats / reports), the
transfer it is forwarding (its frames, kept for a downstream that attaches late or re-attaches),
the downstream relays that said HELLO, and the assembler. It never blocks and never touches a
socket; ``rollout_service.relay`` drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import codec
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import (
    WEIGHT_RELAY_CAPABILITY,
    Bye,
    ChunkPart,
    Error,
    Heartbeat,
    Hello,
    Identity,
    MsgType,
    TensorSpec,
    WeightsAnnounce,
    WeightsApplied,
    WeightsChunk,
    Welcome,
)
from protocol.version import PROTOCOL_VERSION
from protocol.weights import ReceivedWeights, WeightAssembler

Frames = list[codec.Frame]
KEEP_SPECS = 8  # versions whose manifest the learner keeps for relay file announces


# -- learner side ---------------------------------------------------------------------------------
@dataclass
class _Relay:
    identity: bytes
    peer_id: str
    host: str
    address: str
    upstream: str = ""  # "": fed by the learner
    version: int = -1  # newest version verified in ``file``
    file: str = ""


@dataclass
class RelayTier:
    """The learner's relays: chain order, routes, and the newest verified file per host."""

    relays: dict[bytes, _Relay] = field(default_factory=dict)  # in chain order
    specs: dict[int, list[TensorSpec]] = field(default_factory=dict)
    handed: dict[bytes, int] = field(default_factory=dict)  # server -> relay file version sent
    transfer_ids: dict[str, int] = field(default_factory=dict)  # file announces made -> version

    @staticmethod
    def is_relay(hello: Hello) -> bool:
        return WEIGHT_RELAY_CAPABILITY in hello.capabilities and bool(hello.relay_address)

    def join(self, identity: bytes, hello: Hello) -> list[tuple[bytes, str]]:
        """A relay said HELLO: it goes to the end of the chain. Returns (relay, upstream) for
        every relay whose route is new, the joiner included."""
        for ident, r in list(self.relays.items()):
            if r.peer_id == hello.peer_id or ident == identity:
                del self.relays[ident]
        self.relays[identity] = _Relay(
            identity, hello.peer_id, hello.host, hello.relay_address, upstream="\0"
        )
        return self._route()

    def leave(self, identity: bytes) -> list[tuple[bytes, str]]:
        """A relay is gone: the chain closes over it. Returns the relays routed anew."""
        if self.relays.pop(identity, None) is None:
            return []
        return self._route()

    def _route(self) -> list[tuple[bytes, str]]:
        changed, before = [], ""
        for r in self.relays.values():
            if r.upstream != before:
                r.upstream = before
                changed.append((r.identity, before))
            before = r.address
        return changed

    def fed_by_learner(self, identity: bytes) -> bool:
        r = self.relays.get(identity)
        return r is not None and r.upstream == ""

    def published(self, version: int, specs: list[TensorSpec]) -> None:
        self.specs[version] = specs
        for old in sorted(self.specs)[:-KEEP_SPECS]:
            del self.specs[old]
        oldest = min(self.specs)
        self.transfer_ids = {t: v for t, v in self.transfer_ids.items() if v >= oldest}

    def completed(self, identity: bytes, version: int, file: str) -> str | None:
        """A relay verified ``version`` into ``file``; the host it serves (None: not a relay, or
        a version older than what it reported before)."""
        r = self.relays.get(identity)
        if r is None or version <= r.version or not file:
            return None
        r.version, r.file = version, file
        return r.host

    def newest_file(self, host: str) -> _Relay | None:
        """The relay of ``host`` with the newest verified file (None: no relay, or none yet)."""
        best = None
        for r in self.relays.values():
            if r.host == host and r.file and (best is None or r.version > best.version):
                best = r
        return best

    def serves(self, host: str) -> bool:
        return bool(host) and any(r.host == host for r in self.relays.values())

    def file_announce(self, server: bytes, host: str, applied: int) -> Frames | None:
        """The file announce to hand ``server`` (on ``host``, running version ``applied``) now:
        the newest verified file there, once, if newer than what it runs; else None."""
        r = self.newest_file(host)
        if r is None or r.version <= max(applied, self.handed.get(server, -1)):
            return None
        specs = self.specs.get(r.version)
        if specs is None:
            return None
        self.handed[server] = r.version
        tid = f"relay-{r.peer_id}-{r.version}"
        self.transfer_ids[tid] = r.version
        return codec.encode(WeightsAnnounce(r.version, tid, specs, 0, file=r.file))

    def forget(self, server: bytes) -> None:
        self.handed.pop(server, None)


# -- relay side -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routed:
    """Take weights from ``upstream`` from now on ("": the learner's own socket)."""

    upstream: str


@dataclass(frozen=True)
class Completed:
    """A version is assembled and every checksum verified (into the assembler's buffers)."""

    weights: ReceivedWeights


@dataclass(frozen=True)
class LearnerLost:
    """The learner went silent, said BYE or refused the relay: reconnect (or stop, ``fatal``)."""

    reason: str
    fatal: bool = False


RelayEvent = Routed | Completed | LearnerLost


@dataclass
class _Forwarding:
    version: int
    transfer_id: str
    frames: list[Frames]  # the announce, then every chunk received so far, in arrival order
    parts: list[list[ChunkPart]] = field(default_factory=list)  # of each chunk, for ``rebase``
    seen: set[int] = field(default_factory=set)
    complete: bool = False


class RelayNode:
    """A relay's state: learner session, the transfer being forwarded, downstream relays."""

    def __init__(
        self,
        *,
        peer_id: str,
        host: str,
        address: str,
        assembler: WeightAssembler,
        model: Identity,
        tokenizer: Identity,
        epoch: str,
        limits: codec.CodecLimits | None = None,
    ) -> None:
        self.peer_id, self.host, self.address, self.epoch = peer_id, host, address, epoch
        self.model, self.tokenizer = model, tokenizer
        self.assembler = assembler
        self.limits = limits or codec.CodecLimits()
        self.version = -1  # newest version verified
        self.upstream: str | None = None  # None: no route yet (no WELCOME)
        self.in_session = False
        self.heartbeat_interval_s, self.heartbeat_timeout_s = 1.0, 10.0
        self._last_recv = self._last_sent = 0.0
        self._to_learner: list[Frames] = []
        self._to_down: list[tuple[bytes, Frames]] = []
        self.downstream: dict[bytes, str] = {}  # identity -> peer_id of relays behind this one
        self._fwd: _Forwarding | None = None
        self.stats = {"forwarded_chunks": 0, "duplicate_chunks": 0, "versions": 0}

    @staticmethod
    def is_weights(frames: Frames) -> bool:
        try:
            return codec.peek_type(frames) in (MsgType.WEIGHTS_ANNOUNCE, MsgType.WEIGHTS_CHUNK)
        except ProtocolError:
            return False

    # -- learner link ------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """(Re)open the learner session: queue HELLO."""
        self._to_learner.clear()
        self.in_session = False
        hello = Hello(
            protocol_version=list(PROTOCOL_VERSION),
            peer_id=self.peer_id,
            role="rollout-server",
            epoch=self.epoch,
            model=self.model,
            tokenizer=self.tokenizer,
            policy_version=self.version,
            capabilities=[WEIGHT_RELAY_CAPABILITY],
            host=self.host,
            relay_address=self.address,
        )
        self._to_learner.append(codec.encode(hello))
        self._last_recv = self._last_sent = now

    def from_learner(self, frames: Frames, now: float) -> list[RelayEvent]:
        """Session messages of the learner (weights go to ``weights``: ``is_weights``)."""
        self._last_recv = now
        try:
            msg = codec.decode(frames, self.limits)
        except ProtocolError as e:
            self._report_error(e)
            return []
        match msg:
            case Welcome():
                if WEIGHT_RELAY_CAPABILITY not in msg.capabilities:
                    return [
                        LearnerLost(
                            f"the learner (protocol {msg.protocol_version[0]}.{msg.protocol_version[1]}) "
                            "does not run weight relays; upgrade it or stop this relay",
                            fatal=True,
                        )
                    ]
                self.in_session = True
                self.heartbeat_interval_s = msg.heartbeat_interval_s
                self.heartbeat_timeout_s = msg.heartbeat_timeout_s
                if msg.relay_upstream != self.upstream:
                    self.upstream = msg.relay_upstream
                    return [Routed(msg.relay_upstream)]
                return []
            case Bye():
                self.in_session = False
                return [LearnerLost(f"learner said BYE: {msg.reason}")]
            case Error():
                if msg.fatal or msg.code == ErrorCode.HELLO_REQUIRED:
                    self.in_session = False
                    return [LearnerLost(f"learner error {msg.code}: {msg.message}", msg.fatal)]
                return []
            case _:
                return []  # heartbeats, and anything a relay has no use for

    def heard(self, now: float) -> None:
        """Anything from the learner, weights included, shows it is alive."""
        self._last_recv = now

    def tick(self, now: float) -> list[RelayEvent]:
        if self.in_session or self._to_learner:
            if now - self._last_recv >= self.heartbeat_timeout_s:
                self.in_session = False
                return [LearnerLost(f"no word from the learner for {now - self._last_recv:.1f} s")]
        return []

    def next_deadline(self) -> float:
        return min(
            self._last_sent + self.heartbeat_interval_s, self._last_recv + self.heartbeat_timeout_s
        )

    def to_learner(self, now: float) -> list[Frames]:
        out, self._to_learner = self._to_learner, []
        if self.in_session and not out and now - self._last_sent >= self.heartbeat_interval_s:
            out.append(codec.encode(Heartbeat(now, max(self.version, 0))))
        if out:
            self._last_sent = now
        return out

    def file_ready(self, version: int, transfer_id: str, file: str, seconds: float) -> None:
        """The verified version lies in ``file``: tell the learner (it hands the file out)."""
        self.version = max(self.version, version)
        self.stats["versions"] += 1
        self._to_learner.append(
            codec.encode(WeightsApplied(version, transfer_id, True, "", seconds, file=file))
        )

    def failed(self, version: int, transfer_id: str, reason: str) -> None:
        self._to_learner.append(codec.encode(WeightsApplied(version, transfer_id, False, reason)))

    def _report_error(self, e: ProtocolError) -> None:
        if codec.should_answer(e):
            self._to_learner.append(codec.encode(codec.error_message(e)))

    # -- weights, from the learner or the upstream relay -------------------------------------------
    def weights(self, frames: Frames) -> WeightsAnnounce | WeightsChunk | None:
        """An announce or a chunk: queued at once for every downstream relay (unless it is a
        repeat, as after a re-attach, or of no use); returns what ``assemble`` must take next
        (None: nothing). Split in two so that the driver forwards before it assembles: a hop
        then costs one chunk's time, never a version's checksums. A relay forwards what it
        cannot assemble too: the relays behind it check every checksum themselves."""
        try:
            msg = codec.decode(frames, self.limits)
        except ProtocolError as e:
            self._report_error(e)
            return None
        fwd = self._fwd
        if isinstance(msg, WeightsAnnounce):
            if msg.file or msg.version <= self.version:
                return None  # a file announce is not for relays; an old version is of no use
            if fwd is not None and fwd.transfer_id == msg.transfer_id:
                return None  # the same transfer again (re-attached): keep what arrived
            self._fwd = _Forwarding(msg.version, msg.transfer_id, [frames])
        elif isinstance(msg, WeightsChunk):
            if fwd is None or fwd.transfer_id != msg.transfer_id or msg.index in fwd.seen:
                self.stats["duplicate_chunks"] += 1
                return None
            fwd.seen.add(msg.index)
            fwd.frames.append(frames)
            fwd.parts.append(msg.parts)
            self.stats["forwarded_chunks"] += 1
        else:
            return None
        for ident in self.downstream:
            self._to_down.append((ident, frames))
        return msg

    def completes(self, msg: WeightsAnnounce | WeightsChunk) -> bool:
        """Whether assembling ``msg`` finishes its version (and so runs every checksum)."""
        fwd = self._fwd
        if isinstance(msg, WeightsAnnounce):
            return msg.num_chunks == 0
        return fwd is not None and len(fwd.seen) == self._num_chunks(fwd)

    def _num_chunks(self, fwd: _Forwarding) -> int:
        a = self.assembler.in_progress
        return a.num_chunks if a is not None and a.transfer_id == fwd.transfer_id else -1

    def assemble(self, msg: WeightsAnnounce | WeightsChunk) -> list[RelayEvent]:
        """The assembler's step for what ``weights`` returned (thread-safe against the rest of
        this class: it touches only the assembler); a failure is reported to the learner."""
        try:
            if isinstance(msg, WeightsAnnounce):
                done = self.assembler.announce(msg)
            else:
                done = self.assembler.chunk(msg)
        except ProtocolError as e:
            self.failed(msg.version, msg.transfer_id, e.message)
            return []
        if done is None:
            return []
        self._rebase(done)
        return [Completed(done)]

    def _rebase(self, done: ReceivedWeights) -> None:
        """The version is verified: the chunks kept for relays behind this one now point into
        the verified buffers (the relay's slot file) instead of the received frames, which are
        released, so a relay holds a version's bytes once, not twice."""
        fwd = self._fwd
        if fwd is None or fwd.transfer_id != done.transfer_id:
            return
        bufs = [memoryview(b).cast("B") for _, b in done.tensors]
        for i, parts in enumerate(fwd.parts, start=1):
            head = fwd.frames[i][:2]
            fwd.frames[i] = [
                *head,
                *(bufs[p.tensor][p.offset : p.offset + p.nbytes] for p in parts),
            ]
        fwd.complete = True

    def from_downstream(self, identity: bytes, frames: Frames) -> None:
        """A relay behind this one said HELLO (``policy_version``: the newest it has): it gets the
        transfer being forwarded, from its announce, and every chunk after that as it arrives."""
        try:
            msg = codec.decode(frames, self.limits)
        except ProtocolError:
            return
        if isinstance(msg, Bye):
            self.downstream.pop(identity, None)
            return
        if not isinstance(msg, Hello):
            return
        for ident, name in list(self.downstream.items()):  # the same relay, reconnected
            if name == msg.peer_id:
                del self.downstream[ident]
        self.downstream[identity] = msg.peer_id
        fwd = self._fwd
        if fwd is not None and fwd.version > msg.policy_version:
            self._to_down.extend((identity, f) for f in fwd.frames)

    def to_downstream(self) -> list[tuple[bytes, Frames]]:
        out, self._to_down = self._to_down, []
        return out

    def hello_upstream(self) -> Frames:
        """What this relay sends a new upstream relay: its HELLO, with the newest version it has."""
        return codec.encode(
            Hello(
                protocol_version=list(PROTOCOL_VERSION),
                peer_id=self.peer_id,
                role="rollout-server",
                epoch=self.epoch,
                model=self.model,
                tokenizer=self.tokenizer,
                policy_version=self.version,
                capabilities=[WEIGHT_RELAY_CAPABILITY],
                host=self.host,
                relay_address=self.address,
            )
        )
