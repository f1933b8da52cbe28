"""Events the sans-IO connections hand to the application (the h11 way: data in, events out)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.errors import ProtocolError
from protocol.messages import Error, Hello, ValidateRequest, ValidateResult, WeightsApplied, Welcome
from protocol.trajectory import Trajectory
from protocol.weights import ReceivedWeights


@dataclass(frozen=True)
class Connected:
    """Rollout side: the learner accepted our HELLO."""

    welcome: Welcome


@dataclass(frozen=True)
class GroupsAdmitted:
    """Rollout side (1.3): the learner allows ``groups`` more prompt groups on weights of version
    ``min_version`` or newer (ADMIT)."""

    groups: int
    min_version: int


@dataclass(frozen=True)
class BatchAcked:
    seqs: list[int]
    duplicates: list[int]


@dataclass(frozen=True)
class BatchRejected:
    """Rollout side: the learner refused a batch for good (invalid); it is dropped."""

    seq: int
    error: Error


@dataclass(frozen=True)
class WeightsAnnounced:
    version: int


@dataclass(frozen=True)
class WeightsReceived:
    """Rollout side: a complete, verified transfer. Apply it, then call ``weights_applied``."""

    weights: ReceivedWeights


@dataclass(frozen=True)
class WeightsFailed:
    version: int
    reason: str


@dataclass(frozen=True)
class PeerError:
    """The peer sent us an ERROR (it did not like something we sent)."""

    peer_id: str
    error: Error


@dataclass(frozen=True)
class ProtocolViolation:
    """We received something invalid; a typed ERROR has been queued for the peer."""

    peer_id: str
    error: ProtocolError


@dataclass(frozen=True)
class PeerClosed:
    peer_id: str
    reason: str


@dataclass(frozen=True)
class PeerTimedOut:
    peer_id: str


@dataclass(frozen=True)
class PeerJoined:
    """Learner side: a rollout server completed its handshake."""

    peer_id: str
    hello: Hello


@dataclass(frozen=True)
class BatchReceived:
    """Learner side: new trajectories (already deduplicated). The learner owns them now."""

    peer_id: str
    seq: int
    # column-wise ``protocol.batch.Trajectories`` unless deduplicated
    trajectories: Sequence[Trajectory]
    duplicate_trajectories: int
    epoch: str = ""  # the sender's epoch (HELLO.epoch): (peer_id, epoch, seq) names the batch
    persisted: Any = (
        None  # what the learner's persist hook returned for it (e.g. a journal record id)
    )
    probe: bool = False  # from a peer with the "conformance" capability (the conformance suite): never trained


@dataclass(frozen=True)
class BatchRefused:
    """Learner side: a new batch could not be stored (the persist hook failed). It was not
    acknowledged: an ERROR INTERNAL told the sender to keep it and send it again."""

    peer_id: str
    seq: int
    reason: str


@dataclass(frozen=True)
class PeerWeightsApplied:
    peer_id: str
    applied: WeightsApplied


@dataclass(frozen=True)
class ValidationRequested:
    """Rollout side: the learner asks for a validation run. Answer it exactly once with
    ``RolloutConnection.validation_result`` (an answer after the session ended is dropped)."""

    request: ValidateRequest


@dataclass(frozen=True)
class ValidationReceived:
    """Learner side: a peer answered a validation request it was sent."""

    peer_id: str
    result: ValidateResult


@dataclass(frozen=True)
class ValidationAbandoned:
    """Learner side: a peer asked to validate left (BYE, timeout, or replaced by a new session of
    the same peer_id) before answering; its result will never come."""

    peer_id: str
    request_id: str
    reason: str


Event = (
    Connected
    | GroupsAdmitted
    | BatchAcked
    | BatchRejected
    | WeightsAnnounced
    | WeightsReceived
    | WeightsFailed
    | PeerError
    | ProtocolViolation
    | PeerClosed
    | PeerTimedOut
    | PeerJoined
    | BatchReceived
    | PeerWeightsApplied
    | BatchRefused
    | ValidationRequested
    | ValidationReceived
    | ValidationAbandoned
)
