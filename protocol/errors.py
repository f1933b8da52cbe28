"""Typed protocol errors.

Every way a peer can get the protocol wrong maps to one ``ErrorCode``; the receiving side turns a
``ProtocolError`` into an ERROR message on the wire and a log line, and carries on. ``fatal`` errors
(version mismatch, incompatible model, authentication) end the handshake; all others only reject
the offending message.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Codes carried by ERROR messages. Values are part of the wire format: append only."""

    MALFORMED = 1  # frames could not be decoded (bad msgpack, wrong frame count, not a map)
    UNKNOWN_TYPE = 2  # the type frame names no known message
    INVALID_FIELD = 3  # a field is missing, has the wrong type, or an impossible value
    TOO_LARGE = 4  # message or trajectory over the receiver's limits
    CREDIT_EXCEEDED = 5  # batch sent without a credit
    VERSION_MISMATCH = 6  # incompatible protocol major version (fatal)
    HELLO_REQUIRED = 7  # a message other than HELLO before the handshake
    INCOMPATIBLE_MODEL = 8  # tokenizer identity differs from the learner's (fatal)
    CHECKSUM_MISMATCH = 9  # weight transfer failed verification
    UNEXPECTED = 10  # valid message that makes no sense in the current state
    SHUTTING_DOWN = 11  # receiver is closing; sender should keep its batches and retry later
    INTERNAL = 12  # bug on the receiving side; the message may be retried
    TIMED_OUT = 13  # something the peer started was not finished in time (a weight transfer)

    @property
    def fatal(self) -> bool:
        return self in _FATAL


_FATAL = frozenset({ErrorCode.VERSION_MISMATCH, ErrorCode.INCOMPATIBLE_MODEL})


class ProtocolError(Exception):
    """A peer violated the protocol. ``field`` is the dotted path of the offending field, if any."""

    def __init__(self, code: ErrorCode, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field
        # What the error refers to, filled in by the codec when it got that far: lets the sender
        # match a rejection to the batch it keeps for resending.
        self.ref_type = 0
        self.ref_seq = 0
