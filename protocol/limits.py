"""What a decoder accepts: the size limits of a message and of the trajectories it carries.

Design: a frozen dataclass of plain numbers, apart from the codec (`protocol.codec`) and the column
decoder (`protocol.columns`) that both check against it. The model-tied limits (vocabulary, context
length, response budget) come from the run; 0 leaves them unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import Limits

MAX_FRAME_BYTES = 64 << 10
"""The reference learner's frame bound (SPEC §2, §13): what libzmq may be made to buffer for one
frame, also by a peer still in the handshake; senders split larger frames into pieces of this size."""


@dataclass(frozen=True)
class CodecLimits:
    max_message_bytes: int = 256 << 20
    max_trajectories_per_batch: int = 4096
    max_tokens_per_trajectory: int = 1 << 20
    vocab_size: int = 0  # 0: token ids are only checked for >= 0
    # Tied to the model and the run (0: unchecked). A trajectory longer than the model's context, or
    # with more response tokens than the rollout budget, cannot be trained; refused before any ACK.
    max_model_len: int = 0  # prompt_len + response_len
    max_response_tokens: int = 0  # response_len

    def announced(self, max_frame_bytes: int = 0) -> Limits:
        """What WELCOME tells a sender of these limits, with the transport's frame bound."""
        return Limits(
            self.max_message_bytes,
            self.max_trajectories_per_batch,
            self.max_tokens_per_trajectory,
            max_frame_bytes,
        )
