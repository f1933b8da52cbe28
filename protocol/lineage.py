"""Which weights each policy version names, and how many updates separate two versions.

Design: versions only go up over a run, also across learner restarts (``learner.versions``). A
learner resumed from checkpoint version ``c`` after it had published up to ``h > c`` publishes the
restored weights as ``R = h + 1``: ``R`` names the same weights as ``c``, and ``c+1 .. h`` name
weights of a branch the restart discarded. The versions are then the nodes of a tree: each version
``x`` follows ``x - 1`` by one update, except a resumed version ``R``, which follows ``c`` by none
(an alias). The distance of two versions is the number of updates on the path between them; with no
restart it is their difference. A trajectory sampled with version ``v`` is that many updates away
from the weights of version ``V``: what the staleness bound is about, so the bound measured this way
neither drops the groups accepted before a restart as if they were older than they are, nor trains
a discarded branch's groups as if they were fresh.

Pure and small: the aliases are the ``(R, c)`` pairs of the run's restarts, in order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lineage:
    aliases: tuple[tuple[int, int], ...] = ()
    """(resumed version R, restored version c) of each restart, R increasing, c < R."""

    def __post_init__(self) -> None:
        last = -1
        for resumed, restored in self.aliases:
            if not 0 <= restored < resumed or resumed <= last:
                raise ValueError(f"bad lineage aliases {self.aliases}")
            last = resumed

    def resumed(self, resumed: int, restored: int) -> Lineage:
        """This lineage after a restart that published ``restored``'s weights as ``resumed``."""
        if resumed == restored:
            return self
        return Lineage((*self.aliases, (resumed, restored)))

    def _ancestors(self, x: int) -> list[tuple[int, int]]:
        """The versions on the path from ``x`` back to 0, as inclusive (lo, hi) intervals."""
        out, hi = [], x
        for resumed, restored in reversed(self.aliases):
            if resumed <= hi:  # hi lies in the segment this restart began: jump to what it restored
                out.append((resumed, hi))
                hi = restored
        out.append((0, hi))
        return out

    def _depth(self, x: int) -> int:
        return sum(hi - lo for lo, hi in self._ancestors(x))

    def effective(self, version: int) -> int:
        """``version`` projected onto the newest branch: the version of the newest branch as many
        updates away from the weights of the last restart as ``version`` is (itself when no restart
        came after it). Staleness stays a difference on the newest branch: data of ``version`` is
        ``V - effective(version)`` updates from the weights of any later ``V`` there."""
        if not self.aliases or version >= self.aliases[-1][0]:
            return version
        resumed = self.aliases[-1][0]
        return resumed - self.distance(version, resumed)

    def distance(self, a: int, b: int) -> int:
        """Updates on the path between the weights of versions ``a`` and ``b`` (>= 0)."""
        if a < 0 or b < 0:
            raise ValueError(f"versions are >= 0 (got {a}, {b})")
        if not self.aliases:
            return abs(a - b)
        common = -1
        for lo_a, hi_a in self._ancestors(a):
            for lo_b, hi_b in self._ancestors(b):
                top = min(hi_a, hi_b)
                if top >= max(lo_a, lo_b):
                    common = max(common, top)
        return self._depth(a) + self._depth(b) - 2 * self._depth(common)


NO_RESTARTS = Lineage()
"""A run that never restarted from an older checkpoint: versions are plain differences."""
