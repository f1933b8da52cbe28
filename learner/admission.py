"""Admission: which prompt groups rollout servers may start, so that nothing generated is wasted.

Without it a rollout server generates as far ahead as credits let it, and the learner drops what
has grown too old by the time a step takes it: two thirds of all generation in the demo. With it
(protocol 1.3, capability "admission") a server starts a group only under a grant (ADMIT) from the
learner, and this module is the learner's policy for those grants. Sans-IO: the learner link's
admission part (``learner.granting``) feeds it joins, departures and arrivals and sends the grants
it returns.

The rule, for ``B`` groups per training step and ``max_staleness = k`` (versions count steps):

- Window. At most ``(k + 1) * B`` groups are admitted and not yet trained (granted and still
  generating, or received and waiting in the buffer), and never more than the steps left in the
  run can train. Each step that trains ``B`` groups therefore opens exactly ``B`` new grants.
- Freshness at the start. A grant made while the learner's newest published version is ``V`` says
  "start on weights ``V`` or newer" (``min_version``): the group is then meant for step ``V + k``,
  and its oldest token is at most ``k`` versions old there. With ``k = 0`` this *is* a synchronous
  trainer: ``B`` groups per version, all generated on the newest weights, nothing generated ahead.
- Deadlines instead of drops. A group whose oldest token is version ``u`` can be trained up to
  the step of version ``u + k`` (its deadline, ``protocol.staleness``; a group still generating
  under a grant counts with ``min_version + k``). The learner takes groups earliest deadline first, and takes a step of
  version ``w`` only when what it leaves behind can still all be trained in time: for every ``j >=
  w``, at most ``(j - w) * B`` of the groups not taken have a deadline ``<= j`` (``feasible``).
  Otherwise it waits for more groups to arrive. So a slow group makes the learner wait (at most as
  long as a synchronous trainer would) instead of being generated and then thrown away, and a fast
  group never waits for a slow one while the window has slack.
- What that costs. A group granted on version ``V`` starts once the server runs ``V`` and must be
  in the step of ``V + k``: it has about ``k`` of the learner's steps, less the weight hand-over,
  to be generated. A group that takes longer (a long-tail episode) makes that step wait for it,
  whatever the grants: the wait is for a group already running, and a grant on older weights
  would only make a group due sooner.
  When most versions have such a group, the waits come every ``k + 1`` steps: a wait lets the
  groups behind it finish, so the next ``k`` steps find data ready (``bench/sim_waits.py``).

Mixed runs (``chunk = B``, ``Intake.configure_mix``): each server's prompt stream holds the exact
mix in every run of ``B`` consecutive prompts (whole schedule batches), but grants dealt one at a time
over several servers start a part of one server's batch and a part of another's, so what arrives is
not in the mix. With a chunk, a server that has started a chunk (its grants of this session are not
a multiple of ``chunk``) is granted the rest of it first (within its slots, as always), a new chunk
goes to one server (the least loaded) and only while the free grants also cover what the started
chunks still need, so the groups started are whole schedule batches and the learner can take each
step in the exact mix. Chunks are used only while the window holds one per server (else one server
would generate while the others wait: ``max_staleness: 0`` with several servers is dealt one at a
time, and its steps are filled); a part of a chunk is granted only when fewer grants are free than
a chunk with none started (after a server left with some of its grants).

Dynamic sampling (``learner.group_filter``): a filtered group is received (its grant is off the
books) and never held, so its place in the window opens at once. With the filter's pass rate
``p`` (``pass_rate``, 1 without a filter) the window counts the groups still generating that may
be trained, ``kept_bound(n)``: of ``n`` groups, at most ``n p`` plus ``PASS_MARGIN_SD`` binomial
standard deviations. Grants go on while ``held + kept_bound(generating)`` is within the window
(and the run's groups left), and ``can_take`` counts the groups still generating for each deadline
at ``kept_bound``. So the servers generate up to about ``B / p`` groups a step, the learner does not
wait for groups it will filter, and a group is left past its deadline (dropped, in
``rollout/waste_frac``) only when more of one deadline's groups pass than the bound, which two
standard deviations make rare. The bound, not the mean: ``B`` groups a step is a small sample, and planning on ``n p``
would leave a group behind whenever a deadline's groups pass above the average.

Which grant an arriving group used is not on the wire: it used one of its server's grants with
``min_version <= u``. The largest such is taken off the books, which leaves the smallest minimum
versions outstanding: the learner may wait longer than needed, never too little. A server that
leaves takes its outstanding grants with it; they are granted again to the servers still there.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from protocol.staleness import deadline, steps_left

PASS_MARGIN_SD = 2.0
"""Standard deviations above the expected kept groups that admission plans on (dynamic sampling)."""


def feasible(untaken: Iterable[int], version: int, per_step: int) -> bool:
    """Whether groups with deadlines ``untaken`` (one entry per group, a version) can all still be
    trained after the step of ``version``, ``per_step`` groups per later step, earliest first."""
    waiting = 0
    for last, n in sorted(Counter(untaken).items()):
        waiting += n
        if waiting > steps_left(last, version) * per_step:
            return False
    return True


@dataclass
class Admission:
    batch_groups: int  # B: groups per training step
    max_staleness: int  # k
    # peer -> min_version -> groups generating
    _granted: dict[str, Counter[int]] = field(default_factory=dict)
    # peer -> groups it generates at once (0: unstated)
    _slots: dict[str, int] = field(default_factory=dict)
    chunk: int = 1  # grants go to a server in runs of this many (mixed runs: B)
    _issued: dict[str, int] = field(default_factory=dict)  # peer -> grants made in its session
    pass_rate: float = 1.0  # dynamic sampling: share of received groups expected to be trained

    def __post_init__(self) -> None:
        if self.batch_groups < 1 or self.max_staleness < 0:
            raise ValueError("batch_groups must be >= 1 and max_staleness >= 0")

    @property
    def window(self) -> int:
        return (self.max_staleness + 1) * self.batch_groups

    @property
    def generating(self) -> int:
        """Groups granted and not yet received, over all servers."""
        return sum(sum(c.values()) for c in self._granted.values())

    def peers(self) -> list[str]:
        return list(self._granted)

    def oldest_generating(self) -> int | None:
        """The oldest version a group still generating may start from (its grant's
        ``min_version``); None when none is generating."""
        return min((m for c in self._granted.values() for m in c), default=None)

    def joined(self, peer: str, slots: int = 0) -> None:
        """``peer`` takes grants (a new session: none outstanding); it generates ``slots`` groups at
        once (0: unstated, no cap), and is never granted more than that outstanding."""
        self._granted[peer] = Counter()
        self._slots[peer] = slots
        self._issued[peer] = 0

    def left(self, peer: str) -> int:
        """``peer``'s session ended; its outstanding grants are void. Returns how many."""
        self._slots.pop(peer, None)
        self._issued.pop(peer, None)
        return sum(self._granted.pop(peer, Counter()).values())

    def received(self, peer: str, oldest_version: int | None) -> bool:
        """A group from ``peer`` arrived whose oldest token is ``oldest_version`` (None: no response
        token). False when no grant of that peer can have covered it (a group of an earlier session,
        or of a server that does not take grants)."""
        book = self._granted.get(peer)
        if not book:
            return False
        fits = [m for m in book if oldest_version is None or m <= oldest_version]
        m = max(fits) if fits else min(book)
        book[m] -= 1
        if not book[m]:
            del book[m]
        return True

    def kept_bound(self, n: int) -> int:
        """Of ``n`` groups still generating, how many admission plans to train: all without a
        filter, else the binomial mean plus ``PASS_MARGIN_SD`` standard deviations, rounded up."""
        p = self.pass_rate
        if p >= 1 or n <= 0:
            return max(n, 0)
        bound = n * p + PASS_MARGIN_SD * math.sqrt(n * p * (1 - p))
        return min(n, math.ceil(bound - 1e-9))

    def _plannable(self, space: int) -> int:
        """The most groups generating whose ``kept_bound`` fits ``space``."""
        if self.pass_rate >= 1:
            return max(space, 0)
        n = max(space, 0)
        while self.kept_bound(n + 1) <= space:
            n += 1
        return n

    def deadlines(self) -> list[int]:
        """The deadline of every group still generating that is expected to be trained (at the
        earliest: ``min_version + k``)."""
        per_version: Counter[int] = Counter()
        for c in self._granted.values():
            per_version.update(c)
        return [
            deadline(m, self.max_staleness)
            for m, n in per_version.items()
            for _ in range(self.kept_bound(n))
        ]

    def can_take(self, left: Iterable[int], version: int) -> bool:
        """Whether a step of ``version`` may go ahead, leaving received groups with deadlines
        ``left`` (and those still generating) behind. Nothing generating: yes, a wait could not help."""
        return not self.generating or feasible(
            [*left, *self.deadlines()], version, self.batch_groups
        )

    def grants(self, *, held: int, remaining: int, min_version: int) -> list[tuple[str, int]]:
        """New grants: ``held`` groups are received and not yet trained or dropped, the run can still
        train ``remaining`` groups. Grants go one at a time to the server with the fewest groups
        generating (ties: the one that joined first), never beyond a server's slots: a server that
        joins later then still finds grants left, instead of the first one queueing them all.
        They are booked here as generating."""
        # With a pass rate below 1, more than the window: those expected to be filtered.
        free = self._plannable(min(self.window, remaining) - held) - self.generating
        out: Counter[str] = Counter()
        load = {p: sum(c.values()) for p, c in self._granted.items()}

        def room(p: str) -> float:
            return self._slots[p] - load[p] if self._slots.get(p) else float("inf")

        # Whole batches only while the window holds one per server: else one server would do all.
        chunk = self.chunk if self.window >= self.chunk * len(load) else 1
        while free > 0:
            owed = {p: chunk - self._issued[p] % chunk for p in load if self._issued[p] % chunk}
            finishing = [p for p in owed if room(p) > 0]  # a started batch is finished first
            if finishing:
                p = min(finishing, key=load.__getitem__)
                n = int(min(free, owed[p], room(p)))
            else:
                open_ = [p for p in load if room(p) > 0]
                spare = free - sum(owed.values())  # what the started batches still need is kept
                if not open_ or (owed and spare < chunk):
                    break
                p = min(open_, key=load.__getitem__)
                # a new batch; fewer grants than one free (a server left with some): a part
                n = int(min(free, chunk, room(p)))
            load[p] += n
            out[p] += n
            self._issued[p] += n
            free -= n
        for p, n in out.items():
            self._granted[p][min_version] += n
        return list(out.items())
