"""Per-message budgets: how many bytes and frames one received message may take, per peer.

A transport reads a message frame by frame and feeds each frame to a ``MessageReader`` made with
the sending peer's ``MessageBudget``. Once the message goes over its budget the reader keeps
nothing more (the transport drains the rest of the frames and lets them go at once), and the
transport hands the receiver a ``Truncated`` list instead of the frames: the type frame and a
small header (so the refusal can name the batch), plus what was seen and which budget it broke.
The codec turns that into a typed ERROR (``codec.decode``). Pure, no I/O.

Which budget applies is the receiver's choice (``LearnerProtocol.message_budget``): a peer without
a session gets a small one, because nothing it may send (a HELLO) is big; a peer in session gets
``max_message_bytes``; a peer in session without a credit gets the small one too, because only a
TRAJECTORY_BATCH is big and it may send none.

What this bounds is what the application keeps and decodes. ZeroMQ delivers a multipart message
only once all of it has arrived, so the bytes of one message are already in libzmq's buffers when
its first frame is read; libzmq itself bounds each frame (``MAXMSGSIZE``), not the frame count.
What libzmq holds meanwhile is bounded per connection by ``protocol.hold_ledger`` (SPEC §13).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.errors import ErrorCode

# a refused message's header is kept (to name its batch) up to this size
KEEP_HEADER_BYTES = 64 << 10


@dataclass(frozen=True)
class MessageBudget:
    """The most one message may hold. ``name`` says which budget it is (for the error text) and
    ``code`` what a message over it is answered with."""

    max_bytes: int
    max_frames: int
    name: str = "max_message_bytes"
    code: ErrorCode = ErrorCode.TOO_LARGE
    codes: tuple[tuple[int, ErrorCode], ...] = ()  # (message type, code) where it is not ``code``

    def code_for(self, msg_type: int) -> ErrorCode:
        return next((c for t, c in self.codes if t == msg_type), self.code)


class Truncated(list):  # type: ignore[type-arg]
    """The frames kept of a message refused over its budget (type frame, small header), with what
    was seen of it. A list, so it travels wherever frames travel."""

    def __init__(
        self, kept: Sequence[Any], *, nbytes: int, nframes: int, budget: MessageBudget
    ) -> None:
        super().__init__(kept)
        self.nbytes, self.nframes, self.budget = nbytes, nframes, budget

    @property
    def what(self) -> str:
        """What broke the budget, with the limit, e.g. "8 frames (limit 7, before HELLO)"."""
        b = self.budget
        if self.nframes > b.max_frames:
            return f"more than {b.max_frames} frames ({self.nframes} seen; limit of {b.name})"
        return f"more than {b.max_bytes} bytes ({self.nbytes} seen; limit of {b.name})"


class MessageReader:
    """Accumulates one message's frames within ``budget``; ``result`` gives frames or ``Truncated``."""

    def __init__(self, budget: MessageBudget) -> None:
        self.budget = budget
        self.frames: list[Any] = []
        self.nbytes = 0
        self.nframes = 0
        self.over = False

    def add(self, frame: Any) -> None:
        """One more frame (a buffer). Over budget, only the type frame and a small header stay."""
        if self.count(memoryview(frame).nbytes):
            self.frames.append(frame)

    def count(self, nbytes: int) -> bool:
        """Count one more frame of ``nbytes`` without keeping it here (a transport that keeps the
        frames itself); whether the message is still within its budget."""
        self.nbytes += nbytes
        self.nframes += 1
        if not self.over and (
            self.nbytes > self.budget.max_bytes or self.nframes > self.budget.max_frames
        ):
            self.over = True
            self.frames = [f for f in self.frames[:2] if memoryview(f).nbytes <= KEEP_HEADER_BYTES]
        return not self.over

    def result(self) -> list[Any]:
        if not self.over:
            return self.frames
        return Truncated(self.frames, nbytes=self.nbytes, nframes=self.nframes, budget=self.budget)
