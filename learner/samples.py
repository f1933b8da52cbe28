"""Training samples as they travel from the trainer to its workers, and how they are cut into
micro-batches.

Design: one `Sample` per trajectory holds numpy arrays of its own length (no padding crosses a
process boundary); a worker lays a micro-batch out only when it runs it (`learner.model.collate`):
packed (the sequences end to end, no padding: ``Batching.packed``) or right-padded to the
micro-batch's longest sequence. Per-token training inputs (advantages, old logprobs, ...) are named
fields of the sample, response-length float32 arrays aligned with ``response_mask``, None until a
step computes them (and set back to None to keep them off the wire when the loss does not need
them); ``TokenField`` names them where code is generic over them.

`split_for_ranks` deals mini-batches to workers and `split_forward` deals forward-only passes. Both
balance the ranks by tokens and give every rank the same number of micro-batches (FSDP's
collectives need every rank in every forward), padding short ranks with zero-weight dummies. A
micro-batch holds ``micro_size`` samples, or, with a token cap (``max_tokens``, verl's
``use_dynamic_bsz``), as many as fit under the cap, where a micro-batch costs what its tensors hold:
the sum of its lengths when packed, count x longest when padded. Long and short sequences then share
micro-batches so that each costs about the same, and a step costs its tokens, not its padding. With
shared prefixes (``Batching.share_prefix``) the prefix all samples share counts once a micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import numpy as np

T = TypeVar("T")

TokenField = Literal[
    "old_logprobs",
    "ref_logprobs",
    "advantages",
    "returns",
    "values",
    "is_weights",
    "rollout_logprobs",
]
TOKEN_FIELDS: tuple[TokenField, ...] = (
    "old_logprobs",
    "ref_logprobs",
    "advantages",
    "returns",
    "values",
    "is_weights",
    "rollout_logprobs",
)


@dataclass
class Sample:
    input_ids: np.ndarray  # int64, prompt + response
    prompt_len: int
    response_mask: np.ndarray  # float32, length of the response: 1 = trained on
    # Per-token inputs, float32 [response_len] each, None while not computed or not shipped:
    rollout_logprobs: np.ndarray | None = None  # the sampling engine's (from the trajectory)
    old_logprobs: np.ndarray | None = None  # the policy's before this step's update
    ref_logprobs: np.ndarray | None = None  # the reference model's (KL loss, KL in the reward)
    values: np.ndarray | None = None  # the critic's before the update
    advantages: np.ndarray | None = None
    returns: np.ndarray | None = None
    is_weights: np.ndarray | None = None  # truncated importance weights old / rollout

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    def token_fields(self) -> dict[TokenField, np.ndarray]:
        """The per-token inputs this sample carries, by name."""
        out: dict[TokenField, np.ndarray] = {}
        for name in TOKEN_FIELDS:
            arr = getattr(self, name)
            if arr is not None:
                out[name] = arr
        return out

    def get(self, name: TokenField) -> np.ndarray:
        """The per-token input ``name``; an error names it when it was never set."""
        arr = getattr(self, name)
        if arr is None:
            raise ValueError(f"the sample carries no {name} (not computed before it was needed)")
        return arr

    def set(self, name: TokenField, arr: np.ndarray | None) -> None:
        setattr(self, name, arr)

    def tokens_only(self) -> Sample:
        """The sample without its per-token fields: all a forward-only pass reads, so none of them
        is shipped to it or laid out by it."""
        return Sample(self.input_ids, self.prompt_len, self.response_mask)

    def dummy(self) -> Sample:
        """A copy that contributes nothing to any loss: keeps a rank in step with the others."""
        zeros = {k: np.zeros_like(v) for k, v in self.token_fields().items()}
        return replace(self, response_mask=np.zeros_like(self.response_mask), **zeros)


@dataclass(frozen=True)
class Batching:
    """How one rank's samples are cut into micro-batches, and how the worker lays them out."""

    micro_size: int = 4
    """Samples per micro-batch when ``max_tokens`` is 0."""
    max_tokens: int = 0
    """> 0: micro-batches by token count, each costing at most this many tokens (a sequence longer
    than the cap runs alone); the sample count then varies."""
    packed: bool = False
    """Padding-free micro-batches (sequences end to end); else right-padded."""
    share_prefix: bool = False
    """Packed micro-batches hold the prefix all their sequences share once (`learner.model`)."""

    def cost(self, lengths: Sequence[int]) -> int:
        """Tokens a micro-batch of these sequence lengths puts through the model."""
        if not lengths:
            return 0
        return sum(lengths) if self.packed else len(lengths) * max(lengths)


@dataclass(frozen=True)
class OldFromForward:
    """Tells the actor update (``UpdateRequest.old_from_forward``) to take the first mini-batch's
    old logprobs from that mini-batch's own forward, detached, instead of from
    ``Sample.old_logprobs``: the first mini-batch's forward is the one forward of a one-epoch update
    that runs on the weights before it, so it gives the numbers a separate forward of the same
    micro-batches would (the trainer's rule: `learner.prepare.old_logprobs_from_update`). Later
    mini-batches bring theirs from a forward before the update, cut as the update cuts them
    (`split_forward`'s ``parts``). The truncated importance weights (old / rollout, ``is_level``,
    ``is_cap``) and the metrics that compare old and rollout logprobs are computed in the update for
    every mini-batch, from ``rollout_logprobs``."""

    is_level: str = "off"  # token | sequence | off
    is_cap: float = 2.0
    # set by the worker per mini-batch: True for the first, whose forward gives its old logprobs
    from_own_forward: bool = True


@dataclass
class MiniBatchPlan:
    """One optimizer step: the micro-batches of one rank, plus the global counts losses divide by."""

    micro_batches: list[list[Sample]]
    num_tokens: int  # masked response tokens in the whole mini-batch, over all ranks
    num_seqs: int  # sequences with at least one masked token, over all ranks
    max_response_len: int  # over all ranks (seq-mean-token-sum-norm's constant)
    packed: bool = False  # how the worker lays the micro-batches out (Batching.packed)
    share_prefix: bool = False  # Batching.share_prefix


def count_tokens(samples: Sequence[Sample]) -> int:
    return int(sum(float(s.response_mask.sum()) for s in samples))


def even_chunks(items: Sequence[T], n: int) -> list[list[T]]:
    """``items`` in ``n`` contiguous chunks whose sizes differ by at most one: a step's mini-batches
    (`split_for_ranks`), or their sample indices (`split_forward`'s ``parts``)."""
    n = max(1, min(n, len(items))) if items else 1
    q, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def shared_prefix(samples: Sequence[Sample]) -> int:
    """Length of the token prefix all ``samples`` start with, short of every prompt's last token
    (which predicts the first response token, so it stays in each sequence); 0 for one sample."""
    if len(samples) < 2:
        return 0
    limit = max(min(s.prompt_len for s in samples) - 1, 0)
    first = samples[0].input_ids[:limit]
    n = len(first)
    for s in samples[1:]:
        diff = np.flatnonzero(s.input_ids[:n] != first[:n])
        n = int(diff[0]) if diff.size else n
    return n


def balance_indices(
    lengths: Sequence[int], ranks: int, *, equal_counts: bool = True
) -> list[list[int]]:
    """Greedy longest-first assignment of item indices to ranks by token count. ``equal_counts``:
    every rank gets the same number of items (+-1), as fixed-size micro-batches need; without it
    only the tokens are balanced (token-capped micro-batches)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    parts: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    cap = -(-len(lengths) // ranks) if equal_counts else len(lengths)
    for i in order:
        r = min((r for r in range(ranks) if len(parts[r]) < cap), key=lambda r: loads[r])
        parts[r].append(i)
        loads[r] += lengths[i]
    return parts


def balance(samples: Sequence[Sample], ranks: int) -> list[list[Sample]]:
    """Greedy longest-first assignment by token count: equal sample counts (+-1), similar tokens."""
    return [
        [samples[i] for i in part]
        for part in balance_indices([len(s.input_ids) for s in samples], ranks)
    ]


def micro_batches(lengths: Sequence[int], batching: Batching) -> list[list[int]]:
    """Item indices cut into micro-batches, each sorted by length (similar lengths pad less).

    Token cap: the fewest micro-batches that first-fit decreasing finds under the cap, then the
    items dealt longest first to the cheapest micro-batch that still has room, so the micro-batches
    cost about the same (verl balances them with Karmarkar-Karp; this keeps the cap a guarantee)."""
    idx = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if not idx:
        return []
    if batching.max_tokens <= 0:
        size = max(1, batching.micro_size)
        return [idx[i : i + size] for i in range(0, len(idx), size)]
    longest_first = idx[::-1]
    n = len(_fill(longest_first, lengths, batching, None))
    while True:
        bins = _fill(longest_first, lengths, batching, n)
        if len(bins) == n:
            return [sorted(b, key=lambda i: lengths[i]) for b in bins]
        n += 1  # an item found no room in n balanced bins: one more


def _fill(
    order: Sequence[int], lengths: Sequence[int], batching: Batching, n: int | None
) -> list[list[int]]:
    """n None: first fit (a bin opens when none has room). n set: the cheapest of n bins that has
    room; an item with no room anywhere opens a bin beyond n (the caller then retries with more).
    ``order`` is longest first, so a bin's first item is its longest (padded cost = count x it)."""
    bins: list[list[int]] = [[] for _ in range(n or 0)]
    costs = [0] * len(bins)

    def cost_with(b: int, i: int) -> int:
        if not bins[b]:
            return lengths[i]
        if batching.packed:
            return costs[b] + lengths[i]
        return (len(bins[b]) + 1) * lengths[bins[b][0]]

    for i in order:
        fits = [
            b for b in range(len(bins)) if not bins[b] or cost_with(b, i) <= batching.max_tokens
        ]
        if not fits:
            bins.append([])
            costs.append(0)
            fits = [len(bins) - 1]
        b = fits[0] if n is None else min(fits, key=lambda b: costs[b])
        costs[b] = cost_with(b, i)
        bins[b].append(i)
    return [b for b in bins if b]


def split_for_ranks(
    samples: Sequence[Sample],
    *,
    mini_batches: int,
    ranks: int,
    micro_size: int = 4,
    batching: Batching | None = None,
) -> list[list[MiniBatchPlan]]:
    """Per rank, the plans of ``mini_batches`` optimizer steps over ``samples`` (in order), cut by
    ``batching`` (default: ``micro_size`` samples per padded micro-batch)."""
    batching = batching or Batching(micro_size=micro_size)
    per_rank: list[list[MiniBatchPlan]] = [[] for _ in range(ranks)]
    for mb in even_chunks(samples, mini_batches):
        num_tokens = count_tokens(mb)
        num_seqs = sum(1 for s in mb if s.response_mask.any())
        max_len = max(s.response_len for s in mb)
        micro = _deal(mb, ranks, batching)
        for r in range(ranks):
            per_rank[r].append(
                MiniBatchPlan(
                    micro[r], num_tokens, num_seqs, max_len, batching.packed, batching.share_prefix
                )
            )
    return per_rank


def _cut_by(items: Sequence[Sample], batching: Batching) -> tuple[list[int], Batching]:
    """The lengths to cut ``items`` into micro-batches by, and the batching to cut them with. With
    shared prefixes under a token cap, every micro-batch's row holds one copy of the prefix all
    ``items`` share (or a longer one): it comes off each length and once off the cap, so the cap
    still bounds every row and a micro-batch holds as many sequences as its row has room for."""
    lengths = [len(s.input_ids) for s in items]
    if not (batching.packed and batching.share_prefix and batching.max_tokens > 0):
        return lengths, batching
    p = shared_prefix(items)
    if p == 0 or p >= batching.max_tokens:
        return lengths, batching
    return [n - p for n in lengths], replace(batching, max_tokens=batching.max_tokens - p)


def _deal(items: Sequence[Sample], ranks: int, batching: Batching) -> list[list[list[Sample]]]:
    """Per rank, its micro-batches of ``items``; every rank gets as many (dummies fill them: copies
    of the shortest item, the cheapest way to keep a rank in step)."""
    shortest = min(items, key=lambda s: len(s.input_ids))
    idx = _deal_indices(*_cut_by(items, batching), ranks)
    return [[[shortest.dummy() if i < 0 else items[i] for i in m] for m in rank] for rank in idx]


def _deal_indices(lengths: Sequence[int], batching: Batching, ranks: int) -> list[list[list[int]]]:
    """Per rank, micro-batches of item indices, the same number on every rank; -1 is a dummy."""
    parts = balance_indices(lengths, ranks, equal_counts=batching.max_tokens <= 0)
    per_rank = [
        [[part[j] for j in m] for m in micro_batches([lengths[i] for i in part], batching)]
        for part in parts
    ]
    n_micro = max(1, max(len(m) for m in per_rank))
    for m in per_rank:
        while len(m) < n_micro:
            m.append([-1])
    return per_rank


def split_forward(
    samples: Sequence[Sample],
    *,
    ranks: int,
    micro_size: int = 4,
    batching: Batching | None = None,
    parts: Sequence[Sequence[int]] | None = None,
) -> list[list[list[int]]]:
    """Per rank, micro-batches of sample indices for a forward-only pass; -1 marks a dummy.

    ``parts`` (default: all samples, one part): index lists cut each on its own, as
    `split_for_ranks` cuts each mini-batch, so that a part that is a mini-batch (`even_chunks` of
    the indices) gets the micro-batches its update will run; per rank, the parts' micro-batches
    follow each other (every rank has as many of each part)."""
    batching = batching or Batching(micro_size=micro_size)
    if parts is None:
        return _deal_indices(*_cut_by(samples, batching), ranks)
    per_rank: list[list[list[int]]] = [[] for _ in range(ranks)]
    for part in parts:
        local = _deal_indices(*_cut_by([samples[i] for i in part], batching), ranks)
        for out, micro in zip(per_rank, local, strict=True):
            out.extend([part[j] if j >= 0 else -1 for j in m] for m in micro)
    return per_rank
