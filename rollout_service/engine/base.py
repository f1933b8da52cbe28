"""The engine interface the agent loops use: token ids in, token ids + logprobs + versions out.

Design: agents never see vLLM. They hand a prompt as token ids and get back the sampled token ids
verbatim (never decoded and re-encoded: retokenisation drift is the classic bug of agent RL), the
logprob of each sampled token under the policy that sampled it, and the policy version of each
token (a generation can straddle a weight update under the ``keep`` policy). A scripted engine for
unit tests implements the same protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingSettings:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    choices: tuple[str, ...] = ()  # constrain the output to one of these texts (vLLM structured outputs)
    stop: tuple[str, ...] = ()  # stop strings (the code agent's closing tag); the ids that spell one stay in the output


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token, <= 0
    versions: list[int]  # policy version that produced each token
    finish_reason: FinishReason
    stop_token_included: bool = True  # an EOS/stop token that ended the turn is in token_ids
    stop_string: str | None = None  # the stop string that ended generation, if one did
    timings: dict[str, float] = field(default_factory=dict)


class Engine(Protocol):
    @property
    def policy_version(self) -> int:
        """Version of the weights generation uses now."""
        ...

    async def generate(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings) -> Generation:
        """Sample a continuation. Returns with finish_reason "abort" (and the tokens so far) when
        the request is aborted; cancelling the caller aborts the request in the engine."""
        ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...
