"""One peer of the learner end of the protocol (``protocol.receiver``): its session and what it
owes.

Design: a peer is keyed by its transport identity (a ZeroMQ routing id) until its HELLO names it.
Besides its credits and heartbeat times it keeps the validation requests sent to it and not yet
answered (1.1), so an answer nobody asked for is refused and a peer that leaves yields one
``ValidationAbandoned`` per request: the application never waits for an answer that cannot come.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.errors import ErrorCode, ProtocolError
from protocol.events import ValidationAbandoned
from protocol.messages import ADMISSION_CAPABILITY, VALIDATION_CAPABILITY, Hello


@dataclass
class Peer:
    """One peer of the learner end (``protocol.receiver``), keyed by its transport identity."""

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

    def ask(self, request_id: str) -> bool:
        """Validation request ``request_id`` is to be sent to this peer: False if it does not
        validate or was asked already."""
        if not self.validates or request_id in self.validations:
            return False
        self.validations.add(request_id)
        return True

    def answered(self, request_id: str) -> None:
        """Its VALIDATE_RESULT for ``request_id``: UNEXPECTED unless it was asked and has not
        answered yet."""
        if request_id not in self.validations:
            raise ProtocolError(
                ErrorCode.UNEXPECTED,
                f"VALIDATE_RESULT for request {request_id!r}, "
                "which this peer was not asked or has answered already",
            )
        self.validations.discard(request_id)

    def abandoned(self, reason: str) -> list[ValidationAbandoned]:
        """It left: one ``ValidationAbandoned`` per request it leaves unanswered."""
        return [ValidationAbandoned(self.name, rid, reason) for rid in sorted(self.validations)]
