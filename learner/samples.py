"""Training samples as they travel from the trainer to its workers, and their micro-batch tensors.

Design: one `Sample` per trajectory holds numpy arrays of its own length (no padding crosses a
process boundary); a worker pads only inside a micro-batch, right-padded to that micro-batch's
longest sequence. Per-token training inputs (advantages, old logprobs, ...) are response-length
arrays aligned with ``response_mask``. `split_for_ranks` deals mini-batches to workers so every rank
runs the same number of micro-batches (FSDP's collectives need every rank in every forward), padding
short ranks with zero-weight copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "returns", "values", "is_weights")


@dataclass
class Sample:
    input_ids: np.ndarray  # int64, prompt + response
    prompt_len: int
    response_mask: np.ndarray  # float32, length of the response: 1 = trained on
    tokens: dict[str, np.ndarray] = field(default_factory=dict)  # TOKEN_FIELDS -> float32 [R]

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    def dummy(self) -> Sample:
        """A copy that contributes nothing to any loss: keeps a rank in step with the others."""
        return replace(self, response_mask=np.zeros_like(self.response_mask),
                       tokens={k: np.zeros_like(v) for k, v in self.tokens.items()})


@dataclass
class MiniBatchPlan:
    """One optimizer step: the micro-batches of one rank, plus the global counts losses divide by."""

    micro_batches: list[list[Sample]]
    num_tokens: int  # masked response tokens in the whole mini-batch, over all ranks
    num_seqs: int  # sequences with at least one masked token, over all ranks
    max_response_len: int  # over all ranks (seq-mean-token-sum-norm's constant)


def count_tokens(samples: Sequence[Sample]) -> int:
    return int(sum(float(s.response_mask.sum()) for s in samples))


def even_chunks(items: Sequence[Sample], n: int) -> list[list[Sample]]:
    """``items`` in ``n`` contiguous chunks whose sizes differ by at most one."""
    n = max(1, min(n, len(items))) if items else 1
    q, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def balance(samples: Sequence[Sample], ranks: int) -> list[list[Sample]]:
    """Greedy longest-first assignment by token count: equal sample counts (+-1), similar tokens."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
    parts: list[list[Sample]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    cap = -(-len(samples) // ranks)
    for i in order:
        r = min((r for r in range(ranks) if len(parts[r]) < cap), key=lambda r: loads[r])
        parts[r].append(samples[i])
        loads[r] += len(samples[i].input_ids)
    return parts


def split_for_ranks(samples: Sequence[Sample], *, mini_batches: int, ranks: int,
                    micro_size: int) -> list[list[MiniBatchPlan]]:
    """Per rank, the plans of ``mini_batches`` optimizer steps over ``samples`` (in order)."""
    per_rank: list[list[MiniBatchPlan]] = [[] for _ in range(ranks)]
    for mb in even_chunks(samples, mini_batches):
        parts = balance(mb, ranks)
        n_micro = max(1, max(-(-len(p) // micro_size) for p in parts))
        num_tokens = count_tokens(mb)
        num_seqs = sum(1 for s in mb if s.response_mask.any())
        max_len = max(s.response_len for s in mb)
        for r, part in enumerate(parts):
            part = sorted(part, key=lambda s: len(s.input_ids))  # similar lengths pad less
            micro = [part[i:i + micro_size] for i in range(0, len(part), micro_size)]
            while len(micro) < n_micro:
                micro.append([mb[0].dummy()])
            per_rank[r].append(MiniBatchPlan(micro, num_tokens, num_seqs, max_len))
    return per_rank


def split_forward(samples: Sequence[Sample], *, ranks: int, micro_size: int) -> list[list[list[int]]]:
    """Per rank, micro-batches of sample indices for a forward-only pass; -1 marks a dummy."""
    idx = list(range(len(samples)))
    parts = [idx[r::ranks] for r in range(ranks)]
    n_micro = max(1, max(-(-len(p) // micro_size) for p in parts))
    out = []
    for part in parts:
        micro = [part[i:i + micro_size] for i in range(0, len(part), micro_size)]
        while len(micro) < n_micro:
            micro.append([-1])
        out.append(micro)
    return out
