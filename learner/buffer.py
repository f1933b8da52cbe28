"""The intake's buffer of accepted groups, from which training batches are taken.

A group is the trajectories of one ``group_uid`` in one received batch (a journal record): GRPO's
samples of a prompt, plus the StateLM snapshots of its episodes, so groups vary in size. Groups are
kept in arrival order under the key ``(record_id, group_uid)`` and taken earliest deadline first:
the oldest ``oldest_version`` first (it is the first to grow too stale), arrival order among equals.

Staleness of a group is the token age of ``protocol.staleness`` (the rule lives there): the
learner's policy version minus the *oldest* policy version that produced any of the group's trained
tokens (``response_mask == 1``); a trajectory without such tokens counts with its oldest response
token of any kind, and one without any response token does not count. A group with no response
tokens at all has staleness 0. A group too old for ``max_staleness`` is dropped (counted) instead
of trained as soon as it is seen (versions only grow: it stays stale).

Room: the protocol counts room per received batch, not per group. The buffer therefore counts, per
record, the groups not yet finished (queued, or taken and not yet trained); the record's room is
freed (``batch_consumed``) by whoever finishes its last group, trained or dropped, exactly once.

Mixed batches (``data.datasets``): ``mixed_pick`` chooses a step's groups in the configured counts
per data source (``common.mixing.batch_counts``, the rounding the rollout servers' schedules use),
earliest deadline first within each source. Deadlines come first: while what the pick leaves behind
does not fit (a group would grow too stale, or admission's feasibility fails), the latest-deadline
group picked gives its place to the earliest-deadline group left, so mixing never makes a group
stale that plain earliest-deadline-first would have trained. A source with too few groups queued
leaves its places empty (the caller waits) unless ``fill``: then they go to the other sources,
earliest deadline first. ``learner.intake`` decides when to fill (``learner.mix_wait_s``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from protocol.lineage import NO_RESTARTS, Lineage
from protocol.staleness import deadline, oldest_version, token_age, too_old
from protocol.trajectory import Trajectory

GroupKey = tuple[int, str]  # (journal record id, group_uid)


@dataclass(eq=False)
class Group:
    key: GroupKey
    trajectories: list[Trajectory]
    oldest_version: int | None  # None: no response tokens at all
    carried: bool = False
    """Accepted before a learner restart and replayed from the journal: the bound held when it was
    admitted, and a rollback since may have put it past the bound (its data comes from a branch the
    restart discarded). It is trained, once, not dropped: nothing accepted is lost. It never holds
    a step back (no deadline) and goes first (the oldest data)."""

    @property
    def record_id(self) -> int:
        return self.key[0]

    @property
    def uid(self) -> str:
        return self.key[1]

    def staleness(self, policy_version: int) -> int:
        """Token age at ``policy_version`` (``protocol.staleness``)."""
        return token_age(self.oldest_version, policy_version)

    def deadline(self, max_staleness: int) -> int | None:
        """The newest version whose step may train the group (None: never stale)."""
        if self.oldest_version is None or self.carried:
            return None
        return deadline(self.oldest_version, max_staleness)

    def too_old(self, policy_version: int, max_staleness: int) -> bool:
        return not self.carried and too_old(self.oldest_version, policy_version, max_staleness)

    def past_bound(self, policy_version: int, max_staleness: int) -> bool:
        """Trained at ``policy_version`` beyond the bound: only a carried group can be."""
        return too_old(self.oldest_version, policy_version, max_staleness)

    @property
    def deadline_key(self) -> float:
        """Sorts groups by how soon they grow stale (no response token: never)."""
        return float("inf") if self.oldest_version is None else float(self.oldest_version)

    @property
    def source(self) -> str:
        """The data source of the group's prompt (``Trajectory.data_source``)."""
        return self.trajectories[0].data_source if self.trajectories else ""

    @property
    def sampled_tokens(self) -> int:
        """Response tokens the policy generated (mask 1): what training on the group uses."""
        return sum(int(np.count_nonzero(t.response_mask)) for t in self.trajectories)


def split_groups(
    record_id: int, trajectories: Sequence[Trajectory], effective: Lineage = NO_RESTARTS
) -> list[Group]:
    """The groups of one batch, in order of first appearance (a group's trajectories in batch
    order). A group's oldest version is projected onto the newest branch of ``effective`` (the
    run's restarts, ``protocol.lineage``), so its staleness counts the updates it really is from
    the weights being trained."""
    by_uid: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_uid.setdefault(t.group_uid, []).append(t)
    groups = []
    for uid, trajs in by_uid.items():
        olds = [v for v in map(oldest_version, trajs) if v is not None]
        oldest = effective.effective(min(olds)) if olds else None
        groups.append(Group((record_id, uid), trajs, oldest))
    return groups


def mixed_pick(
    queued: Sequence[Group],
    quotas: Mapping[str, int],
    *,
    fill: bool,
    fits: Callable[[list[Group]], bool],
) -> list[Group] | None:
    """The groups of one mixed step: ``quotas[source]`` groups of each source (``sum(quotas)`` in
    all) out of ``queued`` (earliest deadline first, as ``GroupBuffer.by_deadline``), in that order.
    None when a source has too few groups and not ``fill``; with ``fill`` the empty places go to the
    groups of any source (one without a quota included), earliest deadline first, and fewer are
    returned only if fewer are queued. Then, while ``fits(left behind)`` is false, the latest-deadline
    group picked is swapped for the earliest-deadline one left (only ever for a strictly earlier
    deadline): at worst the pick ends as earliest-deadline-first would have made it."""
    n = sum(quotas.values())
    order = {g: i for i, g in enumerate(queued)}
    want = dict(quotas)
    pick: list[Group] = []
    for g in queued:
        if want.get(g.source, 0) > 0:
            want[g.source] -= 1
            pick.append(g)
    if len(pick) < n:
        if not fill:
            return None
        chosen = set(pick)
        pick += [g for g in queued if g not in chosen][: n - len(pick)]
    chosen = set(pick)
    rest = [g for g in queued if g not in chosen]
    while rest and not fits(rest):
        late = max(pick, key=lambda g: (g.deadline_key, order[g]))
        early = rest[0]
        if late.deadline_key <= early.deadline_key:
            break  # nothing earlier to take instead: as good as earliest-deadline-first
        pick[pick.index(late)] = early
        rest = sorted([*rest[1:], late], key=order.__getitem__)
    return sorted(pick, key=order.__getitem__)


def mix_shortfall(groups: Iterable[Group], quotas: Mapping[str, int]) -> int:
    """Places of the configured mix that ``groups`` fill with another source's groups (or leave
    empty): ``sum over sources of max(0, quota - groups of that source)``."""
    have: dict[str, int] = {}
    for g in groups:
        have[g.source] = have.get(g.source, 0) + 1
    return sum(max(0, q - have.get(s, 0)) for s, q in quotas.items())


@dataclass
class Taken:
    groups: list[Group] = field(default_factory=list)  # fresh groups, now in flight
    dropped: list[Group] = field(default_factory=list)  # stale groups dropped by this call
    # records whose last group was dropped here
    done_records: list[int] = field(default_factory=list)


class GroupBuffer:
    def __init__(self, lineage: Lineage = NO_RESTARTS) -> None:
        self.lineage = lineage  # the run's restarts: how old accepted data really is
        self._queue: OrderedDict[GroupKey, Group] = OrderedDict()
        self._inflight: dict[GroupKey, Group] = {}
        self._remaining: dict[int, int] = {}  # record id -> groups queued or in flight
        self.dropped_stale = 0  # groups dropped as stale, ever

    def __len__(self) -> int:
        """Groups waiting to be taken."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Groups taken and not yet finished."""
        return len(self._inflight)

    @property
    def records(self) -> int:
        """Records with groups queued or in flight: the protocol room the buffer holds."""
        return len(self._remaining)

    @property
    def trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self._queue.values())

    def add(
        self,
        record_id: int,
        trajectories: Sequence[Trajectory],
        *,
        only: Collection[str] | None = None,
        carried: bool = False,
    ) -> list[Group]:
        """Queue the groups of record ``record_id`` (only the group uids in ``only``, if given: a
        record replayed after a restart that was partly trained); returns them. ``carried``: the
        record was accepted before a restart (``Group.carried``). A record that yields no group
        holds no room: the caller frees it at once."""
        if record_id in self._remaining:
            raise ValueError(f"record {record_id} is already in the buffer")
        groups = split_groups(record_id, trajectories, self.lineage)
        for g in groups:
            g.carried = carried
        if only is not None:
            missing = set(only) - {g.uid for g in groups}
            if missing:
                raise ValueError(f"record {record_id} has no group {sorted(missing)[:3]}")
            groups = [g for g in groups if g.uid in only]
        for g in groups:
            self._queue[g.key] = g
        if groups:
            self._remaining[record_id] = len(groups)
        return groups

    def drop_stale(self, policy_version: int, max_staleness: int) -> Taken:
        """Drop every queued group whose staleness exceeds ``max_staleness``."""
        out = Taken()
        for key in [k for k, g in self._queue.items() if g.too_old(policy_version, max_staleness)]:
            g = self._queue.pop(key)
            out.dropped.append(g)
            out.done_records += self._finish_one(g.record_id)
        self.dropped_stale += len(out.dropped)
        return out

    def take(self, n_groups: int, policy_version: int, max_staleness: int) -> Taken:
        """Drop the stale groups, then take up to ``n_groups`` fresh ones, earliest deadline first
        (arrival order among equals). Taken groups are in flight until ``finish``."""
        out = self.drop_stale(policy_version, max_staleness)
        for g in self.by_deadline()[:n_groups]:
            self._inflight[g.key] = self._queue.pop(g.key)
            out.groups.append(g)
        return out

    def discard(self, groups: Iterable[Group]) -> list[int]:
        """Queued ``groups`` will never be trained (dynamic sampling filtered them): they leave the
        queue; returns the records that have no group left (free their room)."""
        done = []
        for g in groups:
            del self._queue[g.key]
            done += self._finish_one(g.record_id)
        return done

    def take_these(self, groups: Iterable[Group]) -> list[Group]:
        """Take exactly ``groups`` (queued ones, e.g. a ``mixed_pick``): in flight until ``finish``."""
        out = []
        for g in groups:
            self._inflight[g.key] = self._queue.pop(g.key)
            out.append(g)
        return out

    def by_deadline(self) -> list[Group]:
        """The queued groups in the order ``take`` takes them."""
        # stable: arrival order among equals
        return sorted(self._queue.values(), key=lambda g: g.deadline_key)

    def finish(self, keys: Iterable[GroupKey]) -> list[int]:
        """Taken groups were trained; returns the records that have no group left (free their room)."""
        keys = list(keys)
        unknown = [k for k in keys if k not in self._inflight]
        if unknown or len(set(keys)) != len(keys):
            raise ValueError(
                f"groups not in flight (finished twice?): {unknown[:3] or 'repeated keys'}"
            )
        done = []
        for k in keys:
            del self._inflight[k]
            done += self._finish_one(k[0])
        return done

    def pending_keys(self) -> list[GroupKey]:
        """Every group not yet trained or dropped (queued or in flight), in key order."""
        return sorted([*self._inflight, *self._queue])

    def _finish_one(self, record_id: int) -> list[int]:
        self._remaining[record_id] -= 1
        if self._remaining[record_id]:
            return []
        del self._remaining[record_id]
        return [record_id]
