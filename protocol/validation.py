"""Validation metrics on the wire: summarising episodes into VALIDATE_RESULT sources, merging results.

Both sides use these, so "mean" means the same thing everywhere: a rollout server turns its
validation episodes into per-data-source sums and means (``summarize``), and the learner merges the
results of all servers weighted by their counts (``merge``): reward means by episodes, a reward
extra by the episodes that reported it. Only ok results are merged. Pure functions, no I/O.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import SourceMetrics, ValidateResult


@dataclass(frozen=True)
class EpisodeOutcome:
    """What validation keeps of one episode."""

    data_source: str
    reward: float
    response_length: int = 0
    turns: int = 0
    termination: str = "answered"
    extras: Mapping[str, Any] = field(default_factory=dict)


def numeric(value: Any) -> float | None:
    """A reward extra as a number (booleans as 0/1); None when it is not a finite number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return v if math.isfinite(v) else None
    return None


@dataclass
class _Acc:
    count: int = 0
    reward: float = 0.0
    length: float = 0.0
    turns: float = 0.0
    terminations: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    extras: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    extras_n: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, s: SourceMetrics) -> None:
        self.count += s.count
        self.reward += s.reward_sum
        self.length += s.response_length_mean * s.count
        self.turns += s.turns_mean * s.count
        for k, v in s.terminations.items():
            self.terminations[k] += v
        for k, mean in s.extras_mean.items():
            n = s.extras_count.get(k, 0)
            self.extras[k] += mean * n
            self.extras_n[k] += n

    def metrics(self, source: str) -> SourceMetrics:
        n = self.count
        return SourceMetrics(
            data_source=source,
            count=n,
            reward_sum=self.reward,
            reward_mean=self.reward / n if n else 0.0,
            response_length_mean=self.length / n if n else 0.0,
            turns_mean=self.turns / n if n else 0.0,
            terminations=dict(sorted(self.terminations.items())),
            extras_mean={k: self.extras[k] / c for k, c in sorted(self.extras_n.items()) if c},
            extras_count={k: c for k, c in sorted(self.extras_n.items()) if c},
        )


def summarize(outcomes: Iterable[EpisodeOutcome]) -> list[SourceMetrics]:
    """Per data source (sorted by name): count, reward sum and mean, mean response length and turns,
    termination counts, and the mean of every numeric reward extra."""
    accs: dict[str, _Acc] = defaultdict(_Acc)
    for o in outcomes:
        a = accs[o.data_source]
        a.count += 1
        a.reward += float(o.reward)
        a.length += o.response_length
        a.turns += o.turns
        a.terminations[o.termination] += 1
        for k, v in o.extras.items():
            if (x := numeric(v)) is not None:
                a.extras[k] += x
                a.extras_n[k] += 1
    return [accs[s].metrics(s) for s in sorted(accs)]


def merge(results: Iterable[ValidateResult]) -> dict[str, SourceMetrics]:
    """The ok results of several servers as one set of per-source metrics, weighted by counts."""
    accs: dict[str, _Acc] = defaultdict(_Acc)
    for r in results:
        if r.ok:
            for s in r.sources:
                accs[s.data_source].add(s)
    return {s: accs[s].metrics(s) for s in sorted(accs)}


def total(sources: Iterable[SourceMetrics], name: str = "all") -> SourceMetrics:
    """Several sources as one, named ``name``."""
    acc = _Acc()
    for s in sources:
        acc.add(s)
    return acc.metrics(name)
