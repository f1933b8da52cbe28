"""Message structs and their type codes.

Each message is a frozen dataclass whose annotations are its schema (see ``schema``). On the wire a
message is a multipart ZeroMQ message: ``[type byte, msgpack header, *binary frames]``. The type byte
lets a receiver route before decoding. Only TRAJECTORY_BATCH and WEIGHTS_CHUNK carry binary frames;
their payload objects live in ``trajectory`` and ``weights``.

Evolution rule: fields are only appended, always with a default, and never change meaning. A decoder
ignores keys it does not know. Type codes are never reused; a type added by a minor version is only
sent to a peer that announced the matching capability in HELLO (VALIDATE_REQUEST: "validation").
Fields appended after 1.1 carry ``OMIT_DEFAULT`` metadata: they are left out of the encoding while
they hold their default, so every message an older peer could send encodes byte for byte as before.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from protocol.schema import Finite
from protocol.trajectory import Trajectory


class MsgType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    TRAJECTORY_BATCH = 3
    ACK = 4
    WEIGHTS_ANNOUNCE = 5
    WEIGHTS_CHUNK = 6
    WEIGHTS_APPLIED = 7
    HEARTBEAT = 8
    ERROR = 9
    BYE = 10
    VALIDATE_REQUEST = 11  # since 1.1
    VALIDATE_RESULT = 12  # since 1.1
    ADMIT = 13  # since 1.3


Role = Literal["rollout-server", "learner"]

VALIDATION_CAPABILITY = "validation"
"""HELLO capability of a rollout server that answers VALIDATE_REQUEST (protocol 1.1)."""

WEIGHTS_FILE_CAPABILITY = "weights_file"
"""HELLO capability of a rollout server that loads weights from a file named in WEIGHTS_ANNOUNCE
when its HELLO ``host`` equals the learner's (protocol 1.2)."""

ADMISSION_CAPABILITY = "admission"
"""HELLO capability of a rollout server that starts prompt groups only as ADMIT grants allow, and
WELCOME capability of a learner that grants them (protocol 1.3)."""

WEIGHT_RELAY_CAPABILITY = "weight_relay"
"""HELLO capability of a weight relay (``bin/weight-relay``, SPEC §"Weight relays"): it takes no
credits, receives each version from the learner or from the relay named in WELCOME
``relay_upstream``, forwards it to the relays behind it and reports the slot file it wrote in
WEIGHTS_APPLIED ``file``; WELCOME capability of a learner that runs the relay tier (1.4)."""

PROBE_CAPABILITY = "conformance"
"""HELLO capability of a peer whose batches only test the learner (the conformance suite): they are
acknowledged like any other and never trained, so probing a live learner leaves its run as it was."""

OMIT_DEFAULT = {"omit_default": True}
"""Field metadata: not encoded while equal to its default (fields added since 1.2)."""


class FieldError(ValueError):
    """A cross-field check of a message failed on ``field`` (a path relative to the message), so
    the decoder's INVALID_FIELD can name it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Identity:
    """What a model or tokenizer is: a name for humans, a content hash for machines."""

    name: str
    sha256: str
    vocab_size: int = 0


@dataclass(frozen=True)
class Limits:
    """Receiver limits, advertised in WELCOME so a sender can split its batches to fit."""

    max_message_bytes: int
    max_trajectories_per_batch: int
    max_tokens_per_trajectory: int
    # Since 1.6: the largest frame the learner's transport takes (0: no bound below the message's);
    # a sender splits larger frames into pieces of exactly this size (SPEC §2).
    max_frame_bytes: int = 0


@dataclass(frozen=True)
class Hello:
    """First message of a rollout server on every (re)connection.

    ``epoch`` names the sender's stream of batches (one per sender process lifetime): sequence
    numbers are unique within it, and resends after a reconnect reuse them, which is what lets the
    learner deduplicate. ``policy_version`` -1 asks the learner for its current weights.
    """

    protocol_version: list[int]
    peer_id: str
    role: Role
    epoch: str
    model: Identity
    tokenizer: Identity
    policy_version: int = 0
    capabilities: list[str] = field(default_factory=list)
    # since 1.2: which machine (and /dev/shm) the sender runs on, for the "weights_file" capability
    host: str = field(default="", metadata=OMIT_DEFAULT)
    # since 1.3: prompt groups the sender generates at once (0: unstated); admission grants at most these
    slots: int = field(default=0, metadata=OMIT_DEFAULT)
    # since 1.4, a "weight_relay" peer: where relays downstream of it connect (tcp://HOST:PORT)
    relay_address: str = field(default="", metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        if len(self.protocol_version) != 2:
            raise ValueError("protocol_version must be [major, minor]")
        if not self.peer_id:
            raise ValueError("peer_id must not be empty")
        if self.slots < 0:
            raise FieldError("slots", "slots must be >= 0")


@dataclass(frozen=True)
class Welcome:
    """The learner's answer to an acceptable HELLO. Credits are batches the sender may send now."""

    protocol_version: list[int]
    peer_id: str
    session_id: str
    credits: int
    policy_version: int
    next_seq: int  # lowest seq of this epoch the learner has not yet received (resend from here)
    heartbeat_interval_s: Finite
    heartbeat_timeout_s: Finite
    limits: Limits
    capabilities: list[str] = field(default_factory=list)
    # since 1.4, to a "weight_relay" peer only: the relay address it takes weights from ("": the
    # learner itself). Sent again, unasked, whenever the relay chain changes (a relay left).
    relay_upstream: str = field(default="", metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        if len(self.protocol_version) != 2:
            raise ValueError("protocol_version must be [major, minor]")
        if self.credits < 0:
            raise ValueError("credits must be >= 0")


@dataclass(frozen=True)
class TrajectoryBatch:
    """A batch of trajectories; ``seq`` is unique within the sender's epoch and starts at 1."""

    seq: int
    trajectories: Sequence[Trajectory]  # a list, or column-wise ``protocol.batch.Trajectories``

    def __post_init__(self) -> None:
        if self.seq < 1:
            raise ValueError("seq must be >= 1")


@dataclass(frozen=True)
class Ack:
    """Acknowledges batches (the learner now owns them) and grants further credits.

    ``duplicates`` lists acknowledged seqs that had already been received: the sender drops them
    as usual, and observers (conformance) can see that deduplication happened.
    """

    seqs: list[int]
    credits: int
    duplicates: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.credits < 0:
            raise ValueError("credits must be >= 0")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    checksum: int  # xxh3_64 of the tensor's raw bytes


@dataclass(frozen=True)
class WeightsAnnounce:
    """Announces policy ``version``; its tensors follow in ``num_chunks`` WEIGHTS_CHUNK messages."""

    version: int
    transfer_id: str
    tensors: list[TensorSpec]
    num_chunks: int
    checksum_algo: str = "xxh3_64"
    # since 1.2, only to a "weights_file" peer on the learner's host: the tensors are not chunked
    # but lie in this safetensors file (num_chunks 0; checksums 0: the file never left the machine)
    file: str = field(default="", metadata=OMIT_DEFAULT)


@dataclass(frozen=True)
class ChunkPart:
    """Bytes [offset, offset+nbytes) of tensor ``tensor`` travel in the chunk's frame of same index."""

    tensor: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightsChunk:
    transfer_id: str
    version: int
    index: int
    parts: list[ChunkPart]
    frames: tuple[Any, ...] = ()  # raw bytes per part; filled by the codec, never in the header


@dataclass(frozen=True)
class WeightsApplied:
    """Sent by a rollout server once generation uses ``version`` (or, with ok=False, why not)."""

    version: int
    transfer_id: str
    ok: bool
    error: str = ""
    apply_time_s: Finite = 0.0
    # since 1.4, from a "weight_relay" peer: the verified slot file on its host holding ``version``
    file: str = field(default="", metadata=OMIT_DEFAULT)


@dataclass(frozen=True)
class Heartbeat:
    time: Finite
    policy_version: int = 0
    # since 1.3, R->L: response tokens this sender epoch generated and dropped itself (never
    # shipped), cumulative; the learner counts them as waste. Omitted while 0.
    dropped_tokens: int = field(default=0, metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        if self.dropped_tokens < 0:
            raise FieldError("dropped_tokens", "dropped_tokens must be >= 0")


@dataclass(frozen=True)
class Admit:
    """L->R (1.3, capability "admission"): the server may start ``groups`` more prompt groups, each
    only once its engine runs weights of version ``min_version`` or newer. Grants add up within a
    session and end with it (like credits)."""

    groups: int
    min_version: int

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise FieldError("groups", "groups must be >= 1")
        if self.min_version < 0:
            raise FieldError("min_version", "min_version must be >= 0")


@dataclass(frozen=True)
class Error:
    code: int
    message: str
    fatal: bool = False
    field: str = ""
    ref_type: int = 0  # type of the message that caused it, 0 if unknown
    ref_seq: int = 0  # seq of the rejected batch, 0 if not a batch


@dataclass(frozen=True)
class Bye:
    reason: str = ""


@dataclass(frozen=True)
class ValidateRequest:
    """L->R (1.1): run this server's shard of the validation set on policy ``policy_version`` or
    newer and answer with exactly one VALIDATE_RESULT of the same ``request_id``. ``timeout_s``: how
    long the learner waits for it (0: unstated); a server may give up after that."""

    request_id: str
    policy_version: int
    timeout_s: Finite = 0.0

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        if self.policy_version < 0:
            raise FieldError("policy_version", "policy_version must be >= 0")
        if self.timeout_s < 0:
            raise FieldError("timeout_s", "timeout_s must be >= 0")


@dataclass(frozen=True)
class SourceMetrics:
    """Validation metrics of one data source on one rollout server: sums and means over ``count``
    episodes, so the learner can merge servers weighted by counts. ``reward_mean`` is
    ``reward_sum / count`` (0 when count is 0). ``extras_mean[k]`` is the mean of the numeric
    reward extra ``k`` over the ``extras_count[k]`` episodes that have it."""

    data_source: str
    count: int
    reward_sum: Finite
    reward_mean: Finite
    response_length_mean: Finite = 0.0  # response tokens of an episode's final trajectory
    turns_mean: Finite = 0.0
    terminations: dict[str, int] = field(default_factory=dict)  # termination -> episodes
    extras_mean: dict[str, Finite] = field(default_factory=dict)
    extras_count: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.count < 0:
            raise FieldError("count", "count must be >= 0")
        expected = self.reward_sum / self.count if self.count else 0.0
        if abs(self.reward_mean - expected) > 1e-6 * max(1.0, abs(expected)):
            raise FieldError(
                "reward_mean",
                f"reward_mean {self.reward_mean} is not reward_sum / count "
                f"({self.reward_sum} / {self.count})",
            )
        if self.count == 0 and self.reward_sum != 0:
            raise FieldError("reward_sum", "reward_sum must be 0 when count is 0")
        if self.response_length_mean < 0 or self.turns_mean < 0:
            raise FieldError(
                "response_length_mean" if self.response_length_mean < 0 else "turns_mean",
                "means of lengths and turns must be >= 0",
            )
        for k, v in self.terminations.items():
            if v < 0:
                raise FieldError(f"terminations.{k}", "termination counts must be >= 0")
        if sum(self.terminations.values()) > self.count:
            raise FieldError(
                "terminations", f"termination counts add up to more than count ({self.count})"
            )
        for k, v in self.extras_count.items():
            if not 0 <= v <= self.count:
                raise FieldError(f"extras_count.{k}", f"must be in [0, count={self.count}]")
        for k in self.extras_mean:
            if k not in self.extras_count:
                raise FieldError(
                    f"extras_count.{k}", "every extras_mean key needs its extras_count"
                )


@dataclass(frozen=True)
class ValidateResult:
    """R->L (1.1): the answer to VALIDATE_REQUEST ``request_id``: metrics only, never trajectories,
    so validation episodes can neither be trained on nor use credits. ``policy_version``: the
    weights the episodes ran on (the oldest, if new weights arrived meanwhile). ``ok`` false:
    validation could not run (``error`` says why; ``sources`` are ignored). A server without
    validation data answers ok with no sources."""

    request_id: str
    policy_version: int
    ok: bool = True
    error: str = ""
    sources: list[SourceMetrics] = field(default_factory=list)
    shard_index: int = 0  # this server's shard of the validation set (rows i % count == index)
    shard_count: int = 1
    prompts: int = 0  # validation prompts in the shard
    duration_s: Finite = 0.0

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        if self.policy_version < 0:
            raise FieldError("policy_version", "policy_version must be >= 0")
        if self.shard_count < 1 or not 0 <= self.shard_index < self.shard_count:
            raise FieldError(
                "shard_index",
                f"shard {self.shard_index} of {self.shard_count} is not a shard "
                "(need 0 <= shard_index < shard_count)",
            )
        if self.prompts < 0 or self.duration_s < 0:
            raise FieldError("prompts" if self.prompts < 0 else "duration_s", "must be >= 0")
        seen: set[str] = set()
        for i, s in enumerate(self.sources):
            if s.data_source in seen:
                raise FieldError(
                    f"sources[{i}].data_source", f"data source {s.data_source!r} is listed twice"
                )
            seen.add(s.data_source)

    @property
    def count(self) -> int:
        """Episodes over all sources."""
        return sum(s.count for s in self.sources)


def _check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > 128:
        raise FieldError("request_id", "request_id must be 1 to 128 characters")


Message = (
    Hello
    | Welcome
    | TrajectoryBatch
    | Ack
    | WeightsAnnounce
    | WeightsChunk
    | WeightsApplied
    | Heartbeat
    | Error
    | Bye
    | ValidateRequest
    | ValidateResult
    | Admit
)

MESSAGE_TYPES: dict[MsgType, type] = {
    MsgType.HELLO: Hello,
    MsgType.WELCOME: Welcome,
    MsgType.TRAJECTORY_BATCH: TrajectoryBatch,
    MsgType.ACK: Ack,
    MsgType.WEIGHTS_ANNOUNCE: WeightsAnnounce,
    MsgType.WEIGHTS_CHUNK: WeightsChunk,
    MsgType.WEIGHTS_APPLIED: WeightsApplied,
    MsgType.HEARTBEAT: Heartbeat,
    MsgType.ERROR: Error,
    MsgType.BYE: Bye,
    MsgType.VALIDATE_REQUEST: ValidateRequest,
    MsgType.VALIDATE_RESULT: ValidateResult,
    MsgType.ADMIT: Admit,
}
TYPE_OF: dict[type, MsgType] = {cls: t for t, cls in MESSAGE_TYPES.items()}
