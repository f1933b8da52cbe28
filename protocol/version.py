"""Protocol version and the compatibility rule.

Major versions must match exactly. Minor versions interoperate: a newer minor only appends optional
fields (with defaults) or message types that are only sent to peers announcing the matching HELLO
capability, and decoders ignore keys they do not know, so either side may be newer.

History: 1.0 the first version; 1.1 adds VALIDATE_REQUEST / VALIDATE_RESULT (capability
"validation"); 1.2 adds HELLO ``host`` and WEIGHTS_ANNOUNCE ``file`` (capability "weights_file":
weights handed over as a local file, not chunks, when learner and rollout server share a machine);
1.3 adds ADMIT (capability "admission": the learner grants the prompt groups a rollout server may
start, and on which weights) and HEARTBEAT ``dropped_tokens``; 1.4 adds weight relays (capability
"weight_relay", HELLO ``relay_address``, WELCOME ``relay_upstream``, WEIGHTS_APPLIED ``file``);
1.5 adds the number frames of TRAJECTORY_BATCH: the per-trajectory numbers (lengths, reward,
snapshot index and flag, turns) travel as binary columns after the token columns instead of header
lists. Every receiver decodes both batch forms; a sender uses the 1.5 form only once the learner's
WELCOME says 1.5 or newer (``NUMBER_FRAMES``), so older peers keep working in both directions;
1.6 adds frame pieces: a learner announces a frame bound (WELCOME ``limits.max_frame_bytes``) and a
sender splits every larger frame into pieces of that size, which the learner joins, so that a peer
still in ZeroMQ's handshake can make the learner buffer at most that much (SPEC §2, §13). The one
exception to minor interoperability: a learner with a frame bound refuses a HELLO older than 1.6
(``FRAME_PIECES``) with VERSION_MISMATCH, since such a sender's batch frames would be dropped by
the transport; a 1.6 sender still talks to an older learner (it splits only what WELCOME asks).
"""

from __future__ import annotations

from typing import NamedTuple


class ProtocolVersion(NamedTuple):
    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    def compatible_with(self, other: ProtocolVersion) -> bool:
        return self.major == other.major


PROTOCOL_VERSION = ProtocolVersion(1, 6)
# the first version whose receivers decode batch number frames
NUMBER_FRAMES = ProtocolVersion(1, 5)
FRAME_PIECES = ProtocolVersion(1, 6)  # the first version whose senders split frames (SPEC §2)
