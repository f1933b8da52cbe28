"""Mixed training batches: several sources, each an exact share of every batch.

Counts. Ratios are normalised and every batch of ``B`` prompts holds ``floor(ratio * B)`` rows of
each source, plus one more for the sources with the largest fractional parts until the batch is
full (largest-remainder rounding; ties go to the earlier source). The counts are the same in every
batch, so any ``B`` consecutive prompts of a batch-aligned stream hold the exact mix.

Epochs. An epoch is ``ceil(total_rows / B)`` batches: about one pass over the data in total, so
epochs mean roughly what they mean without mixing (and what ``trainer.total_epochs`` counts). A
small source is repeated within an epoch and a large one only partly seen, in proportion to its
ratio. The whole epoch's schedule follows from ``(seed, epoch)`` alone, never from the sharding, so
the servers' shares (whole batches, dealt round-robin by the caller) add up to one schedule.

Pools. Each source is drawn from an endless stream of passes over its rows: pass ``k`` is a
permutation seeded by ``(seed, source, k)`` (rows in file order without shuffle). Epoch ``e`` takes
the source's draws ``[e*D, (e+1)*D)`` where ``D = count * batches_per_epoch``. So a row repeats
only after all of its source's rows were drawn (wrap-around), and an epoch carries on where the
previous one stopped instead of restarting its pools: restarting would, without shuffle, never
reach a large source's rows past the first ``D``. Inside a batch the rows are shuffled (seeded by
``(seed, epoch)``) so the sources interleave.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The counts have one home, shared with the learner's batch assembly (learner/buffer.py).
from common.mixing import batch_counts as batch_counts
from common.mixing import smallest_fitting_batch_size as smallest_fitting_batch_size

_POOL, _BATCH = 1, 2  # seed tags: pool passes and in-batch shuffles draw from separate streams


class MixedSchedule:
    """Which rows fill each slot of an epoch: ``epoch(e)[batch * B + place]`` is a global row index."""

    def __init__(
        self, pool_sizes: Sequence[int], counts: Sequence[int], *, seed: int, shuffle: bool
    ) -> None:
        assert len(pool_sizes) == len(counts) and min(counts) > 0 and min(pool_sizes) > 0
        self.pool_sizes, self.counts = list(pool_sizes), list(counts)
        self.batch_size = sum(counts)
        self.batches_per_epoch = -(-sum(pool_sizes) // self.batch_size)
        self.seed, self.shuffle = seed, shuffle
        self._starts = np.cumsum([0, *pool_sizes[:-1]])  # global index of each source's first row

    def epoch(self, epoch: int) -> np.ndarray:
        """Global row indices of the epoch's ``batches_per_epoch * B`` slots, batch after batch."""
        nb = self.batches_per_epoch
        columns = [
            self._draws(s, epoch * c * nb, (epoch + 1) * c * nb).reshape(nb, c) + self._starts[s]
            for s, c in enumerate(self.counts)
        ]
        batches = np.concatenate(columns, axis=1)
        if self.shuffle:
            batches = np.random.default_rng([self.seed, _BATCH, epoch]).permuted(batches, axis=1)
        return batches.reshape(-1)

    def _draws(self, source: int, start: int, stop: int) -> np.ndarray:
        """Draws ``[start, stop)`` of the source's endless stream of passes (local row indices)."""
        n = self.pool_sizes[source]
        first, last = start // n, (stop - 1) // n
        passes = [self._pass(source, k) for k in range(first, last + 1)]
        return np.concatenate(passes)[start - first * n : stop - first * n]

    def _pass(self, source: int, k: int) -> np.ndarray:
        n = self.pool_sizes[source]
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, _POOL, source, k]).permutation(n)
