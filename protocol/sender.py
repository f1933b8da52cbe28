"""Sans-IO state machine of the rollout-server end of a connection.

States: IDLE -> HELLO_SENT -> READY, back to IDLE when the learner goes silent (heartbeat timeout)
or says it does not know us (HELLO_REQUIRED, e.g. it restarted), FAILED on a fatal error, CLOSED
after BYE. The driver (``zmq_transport``) feeds received frames and the time, and sends what
``data_to_send`` returns; on IDLE it opens a fresh socket and calls ``start`` again.

Delivery: every batch is kept (as encoded frames) until ACKed or refused as invalid. On every new
session the unacknowledged ones go back to the front of the queue and are resent with their
original sequence numbers, skipping those the learner reports (WELCOME.next_seq) as received. A
batch is only sent while a credit is available; ACKs and WELCOME grant credits.

Admission (1.3, capability "admission"): an ADMIT becomes a ``GroupsAdmitted`` event (the
application keeps the grants; a new session starts with none, like credits), and the application's
running count of response tokens it dropped itself goes out in heartbeats (``dropped_tokens``).

Weights: announces and chunks go to ``assembler`` (``protocol.weights``: checked before anything is
allocated, with deadlines that ``tick`` enforces). A failed transfer is answered with
WEIGHTS_APPLIED ok=false; a refused announce and an abandoned (timed-out) transfer also with a typed
ERROR. Only an accepted announce becomes ``WeightsAnnounced``.

Validation (1.1, capability "validation"): a VALIDATE_REQUEST becomes a ``ValidationRequested``
event; ``validation_result`` queues the answer, but only while the session that asked is still
open (a learner that lost the session has forgotten the request), and only once per request.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from protocol import codec
from protocol.errors import ErrorCode, ProtocolError
from protocol.events import (
    BatchAcked,
    BatchRejected,
    Connected,
    Event,
    GroupsAdmitted,
    PeerClosed,
    PeerError,
    PeerTimedOut,
    ProtocolViolation,
    ValidationRequested,
    WeightsAnnounced,
    WeightsFailed,
    WeightsReceived,
)
from protocol.messages import (
    ADMISSION_CAPABILITY,
    TYPE_OF,
    VALIDATION_CAPABILITY,
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
    TrajectoryBatch,
    ValidateRequest,
    ValidateResult,
    WeightsAnnounce,
    WeightsApplied,
    WeightsChunk,
    Welcome,
)
from protocol.trajectory import Trajectory
from protocol.version import FRAME_PIECES, NUMBER_FRAMES, PROTOCOL_VERSION, ProtocolVersion
from protocol.weights import ReceivedWeights, WeightAssembler

Frames = list[codec.Frame]


def encode_batch(
    seq: int, trajectories: Sequence[Trajectory], number_frames: bool = False
) -> Frames:
    """Pure and thread-safe: the expensive part of ``submit``. ``number_frames``: the 1.5 form
    (``RolloutConnection.number_frames`` says whether the learner takes it)."""
    return codec.encode(
        TrajectoryBatch(seq=seq, trajectories=trajectories), number_frames=number_frames
    )


class SenderState(enum.Enum):
    IDLE = "idle"
    HELLO_SENT = "hello_sent"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


class RolloutConnection:
    def __init__(
        self,
        *,
        peer_id: str,
        epoch: str,
        model: Identity,
        tokenizer: Identity,
        capabilities: list[str] | None = None,
        limits: codec.CodecLimits | None = None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
        version: ProtocolVersion = PROTOCOL_VERSION,
        host: str = "",
        slots: int = 0,
        weights: WeightAssembler | None = None,
    ) -> None:
        self.slots = slots  # prompt groups this server generates at once, sent in HELLO (admission)
        self.host = host  # this machine's key, sent in HELLO (file hand-over of weights)
        self.peer_id, self.epoch = peer_id, epoch
        self.model, self.tokenizer = model, tokenizer
        self.capabilities = capabilities or []
        self.limits = limits or codec.CodecLimits()
        self.heartbeat_interval_s, self.heartbeat_timeout_s = (
            heartbeat_interval_s,
            heartbeat_timeout_s,
        )
        self.version = version
        self.state = SenderState.IDLE
        self.policy_version = 0  # weights generation currently runs on; set by the application
        self.dropped_tokens = (
            0  # response tokens generated and dropped here, ever; set by the application
        )
        self.welcome: Welcome | None = None
        self.peer_limits: Limits | None = None
        self.fatal_error: Error | None = None
        self.credits = 0
        self._next_seq = 1
        self._queue: deque[tuple[int, Frames]] = deque()  # not sent in this session
        self._unacked: OrderedDict[int, Frames] = OrderedDict()  # sent in this session
        self._out: list[Frames] = []
        self._last_sent = self._last_recv = 0.0
        self._validations: set[str] = set()  # requests of this session not yet answered
        # The application's assembler knows its model, slot-file directories and transfer timeouts.
        self.assembler = weights if weights is not None else WeightAssembler()

    # -- application API -------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Batches accepted by ``submit`` and not yet acknowledged (queued or in flight)."""
        return len(self._queue) + len(self._unacked)

    def start(self, now: float, *, request_weights: bool = False) -> None:
        """(Re)open a session: queue HELLO. Unacknowledged batches will be resent after WELCOME."""
        if self.state in (SenderState.FAILED, SenderState.CLOSED):
            raise RuntimeError(f"connection is {self.state.value}")
        self._requeue_unacked()
        self._out.clear()
        self.credits = 0
        self._validations.clear()  # asked by a session that is gone: its learner forgot them
        hello = Hello(
            protocol_version=list(self.version),
            peer_id=self.peer_id,
            role="rollout-server",
            epoch=self.epoch,
            model=self.model,
            tokenizer=self.tokenizer,
            policy_version=-1 if request_weights else self.policy_version,
            capabilities=self.capabilities,
            host=self.host,
            slots=self.slots,
        )
        self._out.append(codec.encode(hello))
        self.state = SenderState.HELLO_SENT
        self._last_recv = now  # the handshake timeout counts from here

    @property
    def number_frames(self) -> bool:
        """Encode batches in the 1.5 form (per-trajectory numbers as binary frames)? Yes when both
        ends speak 1.5. Before the first WELCOME the learner's version is unknown: assumed new, and
        a batch goes out converted (``codec.header_form``) should the learner turn out older."""
        if self.version < NUMBER_FRAMES:
            return False
        w = self.welcome
        return w is None or ProtocolVersion(*w.protocol_version) >= NUMBER_FRAMES

    @property
    def piece_bytes(self) -> int:
        """The learner's frame bound (WELCOME ``limits.max_frame_bytes``, since 1.6): every frame
        this large or larger goes out split into pieces of this size (SPEC §2). 0: frames go whole
        (before WELCOME, nothing sent is that large: a HELLO)."""
        if self.version < FRAME_PIECES or self.welcome is None:
            return 0
        return max(self.welcome.limits.max_frame_bytes, 0)

    def submit(self, trajectories: Sequence[Trajectory]) -> int:
        """Take ownership of a batch (encoding it now) and return its sequence number."""
        seq = self.allocate_seq()
        self.enqueue(seq, encode_batch(seq, trajectories, self.number_frames))
        return seq

    def allocate_seq(self) -> int:
        """Split form of ``submit`` for drivers that encode off the event loop."""
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def enqueue(self, seq: int, frames: Frames) -> None:
        self._queue.append((seq, frames))

    def weights_applied(
        self,
        version: int,
        transfer_id: str,
        *,
        ok: bool,
        error: str = "",
        apply_time_s: float = 0.0,
    ) -> None:
        if ok:
            self.policy_version = version
        self._out.append(
            codec.encode(WeightsApplied(version, transfer_id, ok, error, apply_time_s))
        )

    def validation_result(self, result: ValidateResult) -> bool:
        """Queue the answer to a ``ValidationRequested``. False (nothing sent) when the request is
        not one this session received and has not answered yet: the session that asked is gone."""
        if self.state is not SenderState.READY or result.request_id not in self._validations:
            return False
        self._validations.discard(result.request_id)
        self._out.append(codec.encode(result))
        return True

    @property
    def validations_pending(self) -> set[str]:
        """Validation requests of this session not answered yet."""
        return set(self._validations)

    def close(self, reason: str = "") -> None:
        if self.state in (SenderState.HELLO_SENT, SenderState.READY):
            self._out.append(codec.encode(Bye(reason)))
        self.state = SenderState.CLOSED

    # -- driver API ------------------------------------------------------------------------------
    def data_to_send(self, now: float) -> list[Frames]:
        """Everything to put on the wire now, in order."""
        out, self._out = self._out, []
        if self.state is SenderState.READY:
            while self.credits > 0 and self._queue:
                seq, frames = self._queue.popleft()
                if not self.number_frames:  # encoded for a 1.5 learner, sent to an older one
                    frames = codec.header_form(frames)
                self._unacked[seq] = frames
                self.credits -= 1
                out.append(frames)
            if not out and now - self._last_sent >= self.heartbeat_interval_s:
                out.append(
                    codec.encode(
                        Heartbeat(
                            time=now,
                            policy_version=self.policy_version,
                            dropped_tokens=self.dropped_tokens,
                        )
                    )
                )
        if out:
            self._last_sent = now
        if piece := self.piece_bytes:
            # Unacknowledged batches stay whole: a resend is split for the learner of its session.
            out = [codec.split_frames(frames, piece) for frames in out]
        return out

    def next_deadline(self) -> float:
        """When ``tick`` must run next (heartbeat due, peer timeout, or a weight transfer's deadline)."""
        if self.state is SenderState.READY:
            return min(
                self._last_sent + self.heartbeat_interval_s,
                self._last_recv + self.heartbeat_timeout_s,
                self.assembler.deadline,
            )
        if self.state is SenderState.HELLO_SENT:
            return min(self._last_recv + self.heartbeat_timeout_s, self.assembler.deadline)
        return float("inf")

    def tick(self, now: float) -> list[Event]:
        events: list[Event] = []
        if (stuck := self.assembler.expire(now)) is not None:  # abandoned: said once, here
            announce, err = stuck
            events += self._weights_failed(announce.version, announce.transfer_id, err, report=True)
        if self.state in (SenderState.READY, SenderState.HELLO_SENT):
            if now - self._last_recv >= self.heartbeat_timeout_s:
                self._requeue_unacked()
                self.state = SenderState.IDLE
                events.append(PeerTimedOut("learner"))
        return events

    def receive(self, frames: Frames, now: float) -> list[Event]:
        self._last_recv = now
        try:
            msg = codec.decode(frames, self.limits)
        except ProtocolError as e:
            if codec.should_answer(e):
                self._out.append(codec.encode(codec.error_message(e)))
            return [ProtocolViolation("learner", e)]
        try:
            return self._dispatch(msg, now)
        except ProtocolError as e:
            e.ref_type = e.ref_type or int(TYPE_OF[type(msg)])
            self._out.append(codec.encode(codec.error_message(e)))
            return [ProtocolViolation("learner", e)]

    # -- internals -------------------------------------------------------------------------------
    def _requeue_unacked(self) -> None:
        if self._unacked:
            self._queue.extendleft(reversed(list(self._unacked.items())))
            self._unacked.clear()

    def _dispatch(self, msg: object, now: float) -> list[Event]:
        match msg:
            case Welcome():
                return self._on_welcome(msg)
            case Ack():
                return self._on_ack(msg)
            case Error():
                return self._on_error(msg)
            case Heartbeat():
                return []
            case WeightsAnnounce():
                return self._weights(
                    lambda: self._announce(msg, now), msg.version, msg.transfer_id, announce=True
                )
            case WeightsChunk():
                return self._weights(
                    lambda: self.assembler.chunk(msg, now), msg.version, msg.transfer_id
                )
            case ValidateRequest():
                return self._on_validate_request(msg)
            case Admit():
                if ADMISSION_CAPABILITY not in self.capabilities:
                    raise ProtocolError(
                        ErrorCode.UNEXPECTED,
                        "ADMIT to a rollout server whose HELLO did not offer "
                        f"the {ADMISSION_CAPABILITY!r} capability",
                    )
                # Outside a session it is stale: the grants of a new session start from zero.
                return (
                    [GroupsAdmitted(msg.groups, msg.min_version)]
                    if self.state is SenderState.READY
                    else []
                )
            case Bye():
                # The learner is going away, perhaps to restart: keep everything and reconnect.
                self._requeue_unacked()
                self.state = SenderState.IDLE
                return [PeerClosed("learner", msg.reason)]
        raise ProtocolError(
            ErrorCode.UNEXPECTED, f"{type(msg).__name__} is not sent to a rollout server"
        )

    def _on_welcome(self, msg: Welcome) -> list[Event]:
        if self.state is not SenderState.HELLO_SENT:
            raise ProtocolError(ErrorCode.UNEXPECTED, "WELCOME without a pending HELLO")
        theirs = ProtocolVersion(*msg.protocol_version)
        if not self.version.compatible_with(theirs):
            err = ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"learner speaks protocol {theirs}, this rollout server {self.version}",
            )
            self.state = SenderState.FAILED
            self.fatal_error = codec.error_message(err)
            raise err
        self.welcome = msg
        self.heartbeat_interval_s, self.heartbeat_timeout_s = (
            msg.heartbeat_interval_s,
            msg.heartbeat_timeout_s,
        )
        self.peer_limits = msg.limits  # what the learner accepts; our own limits stay for decoding
        # Batches below next_seq reached the learner before the reconnect: their ACK was lost.
        acked = [s for s, _ in self._queue if s < msg.next_seq]
        self._queue = deque((s, f) for s, f in self._queue if s >= msg.next_seq)
        self.credits = msg.credits
        self.state = SenderState.READY
        events: list[Event] = [Connected(msg)]
        if acked:
            events.append(BatchAcked(acked, acked))
        return events

    def _on_validate_request(self, msg: ValidateRequest) -> list[Event]:
        if VALIDATION_CAPABILITY not in self.capabilities:
            raise ProtocolError(
                ErrorCode.UNEXPECTED,
                "VALIDATE_REQUEST to a rollout server whose HELLO did not "
                f"offer the {VALIDATION_CAPABILITY!r} capability",
            )
        if self.state is not SenderState.READY or msg.request_id in self._validations:
            return []  # outside a session (stale), or a repeat of a request being worked on
        self._validations.add(msg.request_id)
        return [ValidationRequested(msg)]

    def _on_ack(self, msg: Ack) -> list[Event]:
        if self.state is not SenderState.READY:
            return []  # stale ACK from a previous session; its batches will be resent and deduped
        done = [s for s in msg.seqs if self._unacked.pop(s, None) is not None]
        self.credits += msg.credits
        return (
            [BatchAcked(done, [s for s in msg.duplicates if s in done])] if done or msg.seqs else []
        )

    def _on_error(self, msg: Error) -> list[Event]:
        events: list[Event] = [PeerError("learner", msg)]
        code = ErrorCode(msg.code) if msg.code in ErrorCode._value2member_map_ else None
        if msg.fatal:
            self.fatal_error = msg
            self.state = SenderState.FAILED
        elif code is ErrorCode.HELLO_REQUIRED:
            if self.state is SenderState.READY:  # a late one for an older session changes nothing
                self._requeue_unacked()  # the learner lost our session (restart): handshake again
                self.state = SenderState.IDLE
        elif msg.ref_seq and msg.ref_seq in self._unacked:
            frames = self._unacked.pop(msg.ref_seq)
            if code is not ErrorCode.CREDIT_EXCEEDED:
                self.credits += 1  # the learner refused it before taking a credit for it
            if code in (ErrorCode.CREDIT_EXCEEDED, ErrorCode.SHUTTING_DOWN, ErrorCode.INTERNAL):
                self._queue.appendleft((msg.ref_seq, frames))  # not our batch's fault: keep it
            else:
                events.append(BatchRejected(msg.ref_seq, msg))
        return events

    def _announce(self, msg: WeightsAnnounce, now: float) -> ReceivedWeights | None:
        if msg.file and WEIGHTS_FILE_CAPABILITY not in self.capabilities:
            raise ProtocolError(
                ErrorCode.UNEXPECTED,
                "a weights file announced to a rollout server whose "
                f"HELLO did not offer the {WEIGHTS_FILE_CAPABILITY!r} capability",
                field="file",
            )
        return self.assembler.announce(msg, now)

    def _weights(
        self,
        step: Callable[[], ReceivedWeights | None],
        version: int,
        transfer_id: str,
        *,
        announce: bool = False,
    ) -> list[Event]:
        """Run one assembler step. Only an accepted announce is ``WeightsAnnounced`` (a refused one
        must not raise the version the application waits for)."""
        try:
            done = step()
        except ProtocolError as e:
            # A refused announce also gets a typed ERROR, which the learner logs as a warning. Chunk
            # and verification failures only fail the transfer (one ERROR per bad chunk would flood).
            return self._weights_failed(version, transfer_id, e, report=announce)
        events: list[Event] = [WeightsAnnounced(version)] if announce else []
        return events + ([WeightsReceived(done)] if done is not None else [])

    def _weights_failed(
        self, version: int, transfer_id: str, err: ProtocolError, *, report: bool
    ) -> list[Event]:
        self._out.append(codec.encode(WeightsApplied(version, transfer_id, False, err.message)))
        if report:
            err.ref_type = err.ref_type or int(MsgType.WEIGHTS_ANNOUNCE)
            self._out.append(codec.encode(codec.error_message(err)))
        return [WeightsFailed(version, err.message)]
