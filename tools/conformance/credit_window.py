"""Replaying a learner's credit window from its replies (pure; used by the credit_limit check).

Credits form a sliding window: WELCOME grants some, every ACK may grant more, every accepted batch
uses one. A learner processes a session's messages in order and answers in that order, so its
replies are a faithful log of the window as it saw it: replaying them tells, for each batch of a
burst sent without waiting, whether the learner had granted a credit for it when it decided. A
batch accepted with the window at 0 means credits are not enforced; a CREDIT_EXCEEDED while the
window is open means the learner broke its own promise. A learner that grants credits while the
burst is in flight (a fast consumer frees room at once) legitimately accepts more than
WELCOME.credits, so "how many were rejected" is only meaningful relative to this replay.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from protocol.errors import ErrorCode
from protocol.messages import Ack, Error
from tools.conformance.wire import Received


@dataclass
class Replay:
    initial: int
    verdicts: dict[int, str] = field(default_factory=dict)  # seq -> "ACK" | "CREDIT_EXCEEDED"
    problems: list[str] = field(default_factory=list)
    window: int = 0  # credits granted and unused after the last reply
    granted_later: int = 0  # credits granted by ACKs during the replay

    @property
    def accepted(self) -> list[int]:
        return [s for s, v in self.verdicts.items() if v == "ACK"]

    @property
    def rejected(self) -> list[int]:
        return [s for s, v in self.verdicts.items() if v == "CREDIT_EXCEEDED"]


def replay(initial: int, seqs: Sequence[int], records: Iterable[Received]) -> Replay:
    """Check every verdict on ``seqs`` against the window the learner had granted at that point.

    An ACK's own credits count only after its seqs: the learner must have granted a credit before
    it accepted the batch, not in the same breath.
    """
    ours = set(seqs)
    r = Replay(initial=initial, window=initial)

    def verdict(seq: int, v: str) -> bool:
        if seq in r.verdicts:
            r.problems.append(f"batch {seq} got a second verdict ({r.verdicts[seq]}, then {v})")
            return False
        r.verdicts[seq] = v
        return True

    for rec in records:
        msg = rec.msg
        if isinstance(msg, Ack):
            for s in msg.seqs:
                if s not in ours:
                    continue
                if verdict(s, "ACK"):
                    if r.window <= 0:
                        r.problems.append(
                            f"batch {s} was ACKed although the learner had granted no credit for it "
                            f"(WELCOME.credits={initial}, ACK credits so far {r.granted_later}, "
                            f"{len(r.accepted) - 1} batches accepted before it)"
                        )
                    else:
                        r.window -= 1
            r.window += msg.credits
            r.granted_later += msg.credits
        elif isinstance(msg, Error):
            code = rec.error_code()
            if code is not ErrorCode.CREDIT_EXCEEDED:
                r.problems.append(f"unexpected {rec.describe()}")
                continue
            if msg.ref_seq not in ours:
                r.problems.append(
                    f"CREDIT_EXCEEDED names ref_seq={msg.ref_seq}, not one of the batches sent "
                    f"{list(seqs)}"
                )
                continue
            if verdict(msg.ref_seq, "CREDIT_EXCEEDED") and r.window > 0:
                r.problems.append(
                    f"batch {msg.ref_seq} was rejected with CREDIT_EXCEEDED although "
                    f"{r.window} granted credit(s) were unused"
                )
        elif rec.msg is None:
            r.problems.append(f"the learner sent an {rec.describe()}")
    missing = [s for s in seqs if s not in r.verdicts]
    if missing:
        r.problems.append(f"no ACK or CREDIT_EXCEEDED for batch(es) {missing}")
    return r
