"""Message structs and their type codes.

Each message is a frozen dataclass whose annotations are its schema (see ``schema``). On the wire a
message is a multipart ZeroMQ message: ``[type byte, msgpack header, *binary frames]``. The type byte
lets a receiver route before decoding. Only TRAJECTORY_BATCH and WEIGHTS_CHUNK carry binary frames;
their payload objects live in ``trajectory`` and ``weights``.

Evolution rule: fields are only appended, always with a default, and never change meaning. A decoder
ignores keys it does not know. Type codes are never reused.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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


Role = Literal["rollout-server", "learner"]


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

    def __post_init__(self) -> None:
        if len(self.protocol_version) != 2:
            raise ValueError("protocol_version must be [major, minor]")
        if not self.peer_id:
            raise ValueError("peer_id must not be empty")


@dataclass(frozen=True)
class Welcome:
    """The learner's answer to an acceptable HELLO. Credits are batches the sender may send now."""

    protocol_version: list[int]
    peer_id: str
    session_id: str
    credits: int
    policy_version: int
    next_seq: int  # lowest seq of this epoch the learner has not yet received (resend from here)
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    limits: Limits
    capabilities: list[str] = field(default_factory=list)

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
    apply_time_s: float = 0.0


@dataclass(frozen=True)
class Heartbeat:
    time: float
    policy_version: int = 0


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


Message = (
    Hello | Welcome | TrajectoryBatch | Ack | WeightsAnnounce | WeightsChunk | WeightsApplied
    | Heartbeat | Error | Bye
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
}
TYPE_OF: dict[type, MsgType] = {cls: t for t, cls in MESSAGE_TYPES.items()}
