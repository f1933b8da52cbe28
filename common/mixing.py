"""Per-batch counts of a mixed training set, shared by the rollout servers' schedules
(``rollout_service.mixing``) and the learner's batch assembly (``learner.buffer.mixed_pick``).

Ratios are normalised and every batch of ``B`` prompts holds ``floor(ratio * B)`` of each source,
plus one more for the sources with the largest fractional parts until the batch is full
(largest-remainder rounding; ties go to the earlier source).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def batch_counts(ratios: Sequence[float], batch_size: int) -> list[int]:
    """Rows per batch for each source: largest-remainder rounding of the normalised ratios."""
    total = float(sum(ratios))
    # Rounded so that float noise neither floors 2.9999999 to 2 nor breaks a tie (1/3, 1/3, 1/3).
    quotas = [round(r / total * batch_size, 9) for r in ratios]
    counts = [math.floor(q) for q in quotas]
    # sorted() is stable, so equal remainders keep source order
    by_remainder = sorted(range(len(quotas)), key=lambda i: counts[i] - quotas[i])
    for i in by_remainder[: batch_size - sum(counts)]:
        counts[i] += 1
    return counts


def smallest_fitting_batch_size(ratios: Sequence[float], batch_size: int) -> int:
    """The smallest batch size from ``batch_size`` on that gives every source at least one row."""
    # Once B >= 1/min(ratio) every floor is >= 1, so the search ends there at the latest.
    limit = max(batch_size, math.ceil(sum(ratios) / min(ratios)))
    return next(b for b in range(batch_size, limit + 1) if min(batch_counts(ratios, b)) > 0)
