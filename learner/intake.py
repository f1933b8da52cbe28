"""The learner's intake: accepted trajectory batches are journaled and buffered, the trainer takes
groups out, and their room flows back to the rollout servers as credits.

``Intake`` is one part of the learner's link (``learner.link``, which owns the socket and hands it
the batches that arrive); it holds the journal, the buffer, the credits and the dedup state.
Design:

- Durability. Every new batch is appended to the journal (``learner.journal``, fsynced) before
  the protocol may acknowledge it (``persist`` is the driver's hook: the ACK is not even queued
  until the append returned), because the ACK lets the rollout server delete its copy. An append
  that fails refuses the batch (the sender keeps it and resends), it never stops the server.
- Buffer. Accepted batches are split into groups (``learner.buffer``) and wait in arrival order;
  ``next_batch`` takes the oldest fresh ones and drops stale ones (``protocol.staleness``) as soon
  as it sees them. A batch's room is freed (credits flow again) once all its groups are trained
  (``mark_trained``) or dropped, so credits never promise more than the buffer holds.
- Checkpoints. ``state_dict`` holds the dedup state, the groups not yet trained and the journal
  position. An intake built with that state (after a crash, even SIGKILL) replays from the journal
  exactly those groups plus every record appended after the position, and re-registers their
  batches for deduplication, so nothing accepted is lost and nothing is trained twice (relative to
  the checkpointed model). ``checkpoint_saved`` compacts the journal down to what a state needs.
  Without a state the journal is replayed whole (a learner that died before its first
  checkpoint); ``open_journal(fresh=True)`` deletes it instead (a new run). Replayed groups are
  *carried* (``buffer.Group.carried``): admitted under the staleness bound, they are trained once
  even where the rollback put them past it (``intake/carried_past_bound`` counts those), never
  dropped. The waste counts (generated and dropped tokens) are part of the state too.

- Admission (``learner.granting``). With it, ``next_batch`` also waits for groups still generating
  that would be too stale after the step, and takes the buffer earliest deadline first.
  ``waste_metrics`` reports the share of generated tokens never trained (dropped here as stale, or
  dropped by the servers themselves and reported in heartbeats).

- Dynamic sampling (``learner.group_filter``, ``algorithm.filter_groups``). Each accepted group is
  judged as it is buffered: one whose episodes all score the same is filtered, it leaves the buffer
  at once (its record's room is freed once the record has no group left) and admission's window
  has room for another. A restart replays a filtered record from the journal and the filter, a
  function of the stored trajectories, filters it again; a checkpoint's pending groups never hold
  one. A step waiting for groups stops the run once the filter's bound is reached
  (``FilterGroupsExhausted``). ``filter_metrics`` reports them apart from waste.

- Mixed batches (``data.datasets``, ``configure_mix``). Each step takes exactly the configured
  count of groups per data source (``common.mixing.batch_counts`` of the ratios, the counts every
  rollout server's schedule already holds), earliest deadline first within each source
  (``learner.buffer.mixed_pick``). The rule: a step first waits as it does without mixing (enough
  groups, and with admission a feasible remainder). If a source then has too few groups buffered,
  the step waits for them at most ``learner.mix_wait_s`` from that moment, or not at all when
  nothing more can arrive (the buffer is full, or with admission nothing is generating), and then
  fills the missing places from the other sources, earliest deadline first. Deadlines come before
  the mix: a group that would be too stale after the step, or that admission's feasibility needs
  trained now, takes the place of the latest-deadline group picked, so groups of one source never
  go stale waiting behind another's quota. Places not filled by their own source are counted
  (``TakenBatch.mix_shortfall``, the trainer's ``batch/mix_shortfall``); with every source
  delivering and no deadline forcing a swap, it is 0 and the batch is exactly the configured mix.
  With admission, grants go to servers in whole batches (``Admission.chunk``) while the window
  holds one per server, so what is generated is whole schedule batches, each in the exact mix.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from common.mixing import batch_counts
from learner.buffer import Group, GroupBuffer, GroupKey, mix_shortfall, mixed_pick
from learner.granting import Granting
from learner.group_filter import GroupFilter
from learner.journal import Journal
from protocol.batch import token_count
from protocol.driver import LearnerServer
from protocol.events import BatchReceived, BatchRefused
from protocol.staleness import due
from protocol.trajectory import Trajectory

STATE_FORMAT = 1
PROBE_RECORD = -1
"""The record id a probe's batch gets instead of a journal record: it is never stored nor trained."""


class IntakeClosed(Exception):
    """The intake was closed while a training batch was being waited for."""


class IntakeStarved(RuntimeError):
    """The buffer is full and still holds fewer groups than a training batch needs."""


@dataclass
class TakenBatch:
    """Groups for one training step: ``trajectories`` holds each group's trajectories contiguously,
    in the order of ``group_uids``."""

    trajectories: list[Trajectory]
    group_uids: list[str]
    group_sizes: list[int]
    staleness: list[int]  # per group: token age (policy version - its oldest trained token's)
    dropped_stale: int  # groups dropped as stale since the previous batch was taken
    wait_s: float
    carried_past_bound: int = 0  # groups accepted before a restart, trained past the bound now
    keys: list[GroupKey] = field(default_factory=list, repr=False)  # for mark_trained
    sources: list[str] = field(default_factory=list)  # per group: its data source
    mix_shortfall: int = 0  # mixed runs: places of the configured mix not filled by their source
    mix: dict[str, int] = field(default_factory=dict)  # mixed runs: groups per source configured


def open_journal(
    directory: Path, *, fresh: bool, resumed: bool, log: structlog.stdlib.BoundLogger
) -> Journal:
    """The intake journal in ``directory``; ``fresh`` and not ``resumed`` (no state to resume
    from): emptied first (a new run)."""
    journal = Journal(directory)
    if fresh and not resumed and len(journal):
        log.info(
            "fresh run: deleting the intake journal",
            records=len(journal),
            directory=str(journal.directory),
        )
        journal.clear()
    return journal


def persist(journal: Journal, ev: BatchReceived) -> tuple[int, int]:
    """The driver's persist hook (a worker thread): (record id, bytes) once the batch is durable.
    A probe's batch (the conformance suite's) is never journaled: it must not be trained."""
    if ev.probe:
        return PROBE_RECORD, 0
    return journal.append(ev.peer_id, ev.epoch, ev.seq, ev.trajectories)


class Mix:
    """The configured mix of data sources (``configure_mix``): quotas per step and their pick."""

    def __init__(
        self, ratios: Mapping[str, float], wait_s: float, log: structlog.stdlib.BoundLogger
    ) -> None:
        if not ratios or min(ratios.values()) <= 0 or wait_s < 0:
            raise ValueError(f"a mix needs ratios above 0 and wait_s >= 0 (got {ratios}, {wait_s})")
        self.ratios, self.wait_s, self._log = dict(ratios), wait_s, log
        self._unknown: set[str] = set()  # sources seen that the mix does not name (warned)

    def quotas(self, n_groups: int) -> dict[str, int]:
        """Groups per source in a step of ``n_groups``."""
        counts = batch_counts(list(self.ratios.values()), n_groups)
        return dict(zip(self.ratios, counts, strict=True))

    def warn_unknown(self, queued: list[Group]) -> None:
        unknown = {g.source for g in queued} - set(self.ratios) - self._unknown
        if unknown:
            self._unknown |= unknown
            self._log.warning(
                "groups of a data source the mix does not name: they only fill places of others",
                sources=sorted(unknown),
                mix=sorted(self.ratios),
            )


class Intake:
    """The intake of one learner process, on ``server`` (the link's). ``state``: an earlier intake's
    ``state_dict`` to resume from (a checkpoint's): its groups are replayed from ``journal``."""

    def __init__(
        self,
        server: LearnerServer,
        journal: Journal,
        buffer: GroupBuffer,
        admission: Granting,
        *,
        state: dict[str, Any] | None,
        log: structlog.stdlib.BoundLogger,
        group_filter: GroupFilter | None = None,
    ) -> None:
        """``group_filter``: dynamic sampling (``learner.group_filter``), None: every group trained."""
        self._server, self._proto, self._journal = server, server.proto, journal
        self._filter = group_filter
        self._buffer, self._admission, self._log = buffer, admission, log
        self._position = 0  # highest journal record id whose groups reached the buffer
        self.counts = dict.fromkeys(
            (
                "batches",
                "trajectories",
                "tokens",
                "persisted_bytes",
                "persist_failures",
                "replayed_records",
                "replayed_groups",
                "probe_batches",
            ),
            0,
        )
        self._arrived: anyio.Event | None = None
        # (policy version, max staleness) of the last request, also applied to arrivals.
        self._rule: tuple[int, int] | None = None
        self._dropped_reported = 0
        self._mix: Mix | None = None
        # Sampled response tokens received / dropped as stale.
        self._tokens = {"generated": 0, "dropped": 0}
        self._waste_reported = (0, 0)  # (generated, wasted) at the last waste_metrics call
        self.closed = False
        self._restore(state)

    # -- the link's events -----------------------------------------------------------------------
    def on_batch(self, ev: BatchReceived) -> None:
        if ev.probe:
            # Acknowledged like any batch (the wire behaviour under test), then let go: probing a
            # live learner must not change what it trains.
            self.counts["probe_batches"] += 1
            self._free([PROBE_RECORD])
            return
        rid, nbytes = ev.persisted
        c = self.counts
        c["batches"] += 1
        c["trajectories"] += len(ev.trajectories)
        c["tokens"] += token_count(ev.trajectories)
        c["persisted_bytes"] += nbytes
        groups = self._buffer.add(rid, ev.trajectories)
        if not groups:
            self._free([rid])
        self._free(self._filter_out(groups, count=True))
        self._tokens["generated"] += sum(g.sampled_tokens for g in groups)
        # Filtered groups too: each used a grant, and its place in the window is open again.
        self._admission.received(ev.peer_id, groups, self.pass_rate)
        self._position = max(self._position, rid)
        if self._rule is not None:
            self._drop_stale(*self._rule)
        self.wake()

    def on_refused(self, ev: BatchRefused) -> None:
        self.counts["persist_failures"] += 1
        self._log.error(
            "could not store a batch; its rollout server will resend it",
            peer=ev.peer_id,
            seq=ev.seq,
            error=ev.reason,
        )

    def announced(self, version: int) -> None:
        """A newer policy version was announced: arrivals are judged against it."""
        if self._rule is not None:
            self._rule = (max(version, self._rule[0]), self._rule[1])

    # -- the trainer's -----------------------------------------------------------------------------
    def configure_mix(self, ratios: Mapping[str, float], wait_s: float) -> None:
        """Take every batch in the mix of ``ratios`` (data source -> ratio, ``data.datasets``),
        waiting at most ``wait_s`` for a missing source (the module docstring has the rule). With
        admission (configured first), grants then go to servers in whole batches (``chunk``)."""
        self._mix = Mix(ratios, wait_s, self._log)
        self._admission.whole_batches()
        self._log.info("mixed batches", ratios=self._mix.ratios, mix_wait_s=wait_s)

    async def next_batch(
        self, n_groups: int, policy_version: int, max_staleness: int
    ) -> TakenBatch:
        """Wait until ``n_groups`` fresh groups are buffered and take them, earliest deadline first.
        Groups staler than ``max_staleness`` are dropped whenever they are seen. With admission, also
        wait for every group still generating that this step must train (it is too stale after).
        With a mix (``configure_mix``), take each source's count, waiting a bounded time for it."""
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1 (got {n_groups})")
        t0 = time.monotonic()
        quotas = self._mix.quotas(n_groups) if self._mix is not None else None
        ready_since: float | None = None  # when the step could have been taken without the mix
        mixed: list[Group] | None = None
        while True:
            # Also applied to arrivals until the next call.
            self._rule = (policy_version, max_staleness)
            self._drop_stale(policy_version, max_staleness)
            wait_for: float | None = None  # until something arrives
            if len(self._buffer) >= n_groups and self._can_take(
                n_groups, policy_version, max_staleness
            ):
                if self._mix is None or quotas is None:
                    break
                now = time.monotonic()
                ready_since = now if ready_since is None else ready_since
                fill = now - ready_since >= self._mix.wait_s or not self._more_can_arrive()
                mixed = self._mixed_pick(quotas, policy_version, max_staleness, fill=fill)
                if mixed is not None:
                    break
                wait_for = ready_since + self._mix.wait_s - now
            if self.closed:
                raise IntakeClosed("the intake was closed")
            self._check_starved(n_groups)
            self._arrived = self._arrived or anyio.Event()
            with anyio.move_on_after(wait_for):
                await self._arrived.wait()
        if mixed is None:
            out = self._buffer.take(n_groups, policy_version, max_staleness)
            self._free(out.done_records)  # (nothing is stale here: dropped just above)
            groups = out.groups
        else:
            groups = self._buffer.take_these(mixed)
        if self._filter is not None:
            self._filter.step_taken()
        dropped, self._dropped_reported = (
            self._buffer.dropped_stale - self._dropped_reported,
            self._buffer.dropped_stale,
        )
        return TakenBatch(
            trajectories=[t for g in groups for t in g.trajectories],
            group_uids=[g.uid for g in groups],
            group_sizes=[len(g.trajectories) for g in groups],
            staleness=[g.staleness(policy_version) for g in groups],
            dropped_stale=dropped,
            wait_s=time.monotonic() - t0,
            carried_past_bound=sum(g.past_bound(policy_version, max_staleness) for g in groups),
            keys=[g.key for g in groups],
            sources=[g.source for g in groups],
            mix_shortfall=mix_shortfall(groups, quotas) if quotas is not None else 0,
            mix=dict(quotas or {}),
        )

    def buffered(self) -> list[Group]:
        """The groups waiting to be taken, in the order ``next_batch`` takes them."""
        return self._buffer.by_deadline()

    def generating_from(self) -> float:
        """Every group that can still arrive has its oldest token at this version or later
        (`learner.granting.Granting.generating_from`: inf when none can, -inf when unknown)."""
        return self._admission.generating_from()

    async def arrival(self) -> None:
        """Returns at the next arrival that would wake ``next_batch``."""
        self._arrived = self._arrived or anyio.Event()
        await self._arrived.wait()

    def mark_trained(self, taken: TakenBatch) -> None:
        """``taken`` was trained on: batches whose groups are now all trained free their room, and
        (with admission) as many new groups are granted, on the newest published weights."""
        self._free(self._buffer.finish(taken.keys))
        self._admission.trained(len(taken.keys))

    def waste_metrics(self) -> dict[str, float]:
        """``rollout/waste_frac``: the share of sampled response tokens generated so far that were
        never trained and never will be (dropped as stale here, or dropped by a rollout server and
        reported in its heartbeats); ``rollout/waste_frac_step`` the same since the last call."""
        dropped_there = self._proto.dropped_tokens
        generated = self._tokens["generated"] + dropped_there
        wasted = self._tokens["dropped"] + dropped_there
        g0, w0 = self._waste_reported
        self._waste_reported = (generated, wasted)
        return {
            "rollout/waste_frac": wasted / generated if generated else 0.0,
            "rollout/waste_frac_step": (wasted - w0) / (generated - g0) if generated > g0 else 0.0,
            "rollout/generated_tokens": float(generated),
            "rollout/wasted_tokens": float(wasted),
        }

    def filter_metrics(self) -> dict[str, float]:
        """Dynamic sampling's ``rollout/filtered_*`` metrics (``GroupFilter.metrics``); {} when off."""
        return self._filter.metrics() if self._filter is not None else {}

    @property
    def pass_rate(self) -> float:
        """The share of groups dynamic sampling expects to keep (1 without it)."""
        return self._filter.pass_rate if self._filter is not None else 1.0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume without losing or re-training accepted data (plain
        msgpack/JSON types). Take it after ``mark_trained`` of the checkpointed step."""
        return {
            "format": STATE_FORMAT,
            "protocol": self._proto.export_state(),
            "pending": [[rid, uid] for rid, uid in self._buffer.pending_keys()],
            "position": self._position,
            # waste is a share of everything generated over the run: a restart keeps the counts
            # (a state without them, from an older checkpoint, starts them at 0)
            "tokens": dict(self._tokens),
            # dynamic sampling's counts (filtered groups are not pending: a restart never trains them)
            "filter": self._filter.state_dict() if self._filter is not None else {},
        }

    def checkpoint_saved(self, state: dict[str, Any]) -> None:
        """``state`` (from ``state_dict``) is now the oldest one a restart may resume from: delete the
        journal records it does not need."""
        needed = [int(rid) for rid, _ in state["pending"]] + [int(state["position"]) + 1]
        removed = self._journal.truncate_before(min(needed))
        if removed:
            self._log.debug(
                "journal compacted", records_removed=removed, records_left=len(self._journal)
            )

    def stats(self) -> dict[str, int]:
        """The intake's counters, its buffer's levels and the protocol's duplicates."""
        p = self._proto.stats
        return {
            **self.counts,
            "duplicate_batches": p["duplicate_batches"],
            "duplicate_trajectories": p["duplicate_trajectories"],
            "dropped_stale_groups": self._buffer.dropped_stale,
            "buffered_groups": len(self._buffer),
            "in_flight_groups": self._buffer.in_flight,
            "buffered_batches": self._proto.buffered,
            "journal_records": len(self._journal),
        }

    def timeline_levels(self) -> dict[str, float]:
        """The values the learner's timeline samples (``common.timeline.LEARNER_COUNTERS``): groups
        waiting in the buffer, groups granted and still generating (-1: no admission), and the
        trajectories received so far."""
        return {
            "buffered_groups": len(self._buffer),
            "generating_groups": self._admission.generating,
            "received_trajectories": self.counts["trajectories"],
        }

    def close(self) -> None:
        """Waiting ``next_batch`` calls raise ``IntakeClosed``."""
        self.closed = True
        self.wake()

    def wake(self) -> None:
        """Something changed that a waiting ``next_batch`` must look at."""
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    # -- internals -------------------------------------------------------------------------------
    def _restore(self, state: dict[str, Any] | None) -> None:
        """Replay from the journal what ``state`` (None: the whole journal) had not trained."""
        journal = self._journal
        pending: dict[int, set[str]] = {}
        position = 0
        if state is not None:
            if state.get("format") != STATE_FORMAT:
                raise ValueError(
                    f"intake state of format {state.get('format')!r}, expected {STATE_FORMAT}"
                )
            self._proto.restore_state(state["protocol"])
            position = int(state["position"])
            for k, v in (state.get("tokens") or {}).items():
                if k in self._tokens:
                    self._tokens[k] = int(v)
            if self._filter is not None:
                self._filter.load_state_dict(state.get("filter") or {})
            for rid, uid in state["pending"]:
                pending.setdefault(int(rid), set()).add(uid)
            # Records appended from now on are replayed after a crash.
            journal.advance_to(position + 1)
        # Record id -> group uids to replay (None: all).
        wanted: dict[int, set[str] | None] = {**pending}
        wanted.update((rid, None) for rid in journal.record_ids if rid > position)
        missing = sorted(rid for rid in wanted if rid not in journal)
        if missing:
            raise ValueError(
                f"the intake journal {journal.directory} lacks {len(missing)} records the checkpoint needs "
                f"(ids {missing[:5]}...): it belongs to another run, or it was compacted for a later "
                "checkpoint than the one resumed. Resume from the latest checkpoint, or start a fresh run."
            )
        for rec in journal.records(wanted):
            added = self._buffer.add(
                rec.record_id, rec.trajectories, only=wanted[rec.record_id], carried=True
            )
            n = len(added)
            new = rec.record_id > position  # accepted after the checkpoint: not in its counts
            if new:
                self._tokens["generated"] += sum(g.sampled_tokens for g in added)
            self._proto.replay_batch(rec.peer_id, rec.epoch, rec.seq, rec.trajectories.ids)
            # The filter judges a replayed group as it judged it first (the same trajectories).
            done = self._filter_out(added, count=new)
            for _ in range(len(done) + (not n)):
                self._proto.batch_consumed()
            self.counts["replayed_records"] += 1
            self.counts["replayed_groups"] += n
        self._position = max([position, *wanted])
        self._waste_reported = (self._tokens["generated"], self._tokens["dropped"])
        if wanted:
            self._log.info(
                "replayed the intake journal",
                records=len(wanted),
                groups=len(self._buffer),
                position=position,
                from_state=state is not None,
            )

    def _filter_out(self, groups: list[Group], *, count: bool) -> list[int]:
        """Dynamic sampling: the groups of ``groups`` the filter does not keep leave the buffer;
        returns the records that have no group left. ``count``: book the verdicts (not for groups
        a restored checkpoint's counts already hold)."""
        if self._filter is None:
            return []
        keeps = self._filter.keeps
        return self._buffer.discard([g for g in groups if not keeps(g.trajectories, count=count)])

    def _mixed_pick(
        self, quotas: dict[str, int], policy_version: int, max_staleness: int, *, fill: bool
    ) -> list[Group] | None:
        """``mixed_pick`` of the buffer: what it leaves behind must not be due now (it would be
        dropped after this step) and, with admission, must still be trainable in time."""

        def fits(left: list[Group]) -> bool:
            deadlines = [d for g in left if (d := g.deadline(max_staleness)) is not None]
            if any(due(d, policy_version) for d in deadlines):
                return False
            return self._admission.can_take(deadlines, policy_version)

        queued = self._buffer.by_deadline()
        assert self._mix is not None  # only called for a mix
        self._mix.warn_unknown(queued)
        return mixed_pick(queued, quotas, fill=fill, fits=fits)

    def _more_can_arrive(self) -> bool:
        """Whether waiting can bring more groups: not when the buffer holds all the room there is,
        nor, with admission, when nothing is generating and every server takes grants."""
        buf, proto = self._buffer, self._proto
        if buf.records >= proto.capacity and proto.buffered == buf.records:
            return False
        if self._admission.idle():
            return not set(proto.ready_peers()) <= set(proto.admission_peers())
        return True

    def _drop_stale(self, policy_version: int, max_staleness: int) -> None:
        out = self._buffer.drop_stale(policy_version, max_staleness)
        if out.dropped:
            self._tokens["dropped"] += sum(g.sampled_tokens for g in out.dropped)
            self._log.debug(
                "stale groups dropped",
                groups=len(out.dropped),
                policy_version=policy_version,
                max_staleness=max_staleness,
            )
            self._admission.admit()
        self._free(out.done_records)

    def _can_take(self, n_groups: int, policy_version: int, max_staleness: int) -> bool:
        """With admission: the groups left after taking ``n_groups`` now (earliest deadline first),
        those still generating included, can all be trained in time. Nothing generating: yes (a
        wait could not help)."""
        if self._admission.policy is None:
            return True
        left = [
            d
            for g in self._buffer.by_deadline()[n_groups:]
            if (d := g.deadline(max_staleness)) is not None
        ]
        return self._admission.can_take(left, policy_version)

    def _free(self, records: list[int]) -> None:
        if records:
            self._server.batch_consumed(len(records))

    def _check_starved(self, n_groups: int) -> None:
        """Nothing can arrive (all room holds buffered batches) and nothing in flight will free any;
        or dynamic sampling judged its bound of groups for this step (``FilterGroupsExhausted``)."""
        buf, proto = self._buffer, self._proto
        if self._filter is not None and self._filter.exhausted(len(buf)):
            raise self._filter.exhausted_error(len(buf))
        if not buf.in_flight and buf.records >= proto.capacity and proto.buffered == buf.records:
            raise IntakeStarved(
                f"the intake buffer is full ({buf.records} batches, learner.buffer_batches={proto.capacity}) "
                f"but holds only {len(buf)} fresh groups and a training batch needs {n_groups}: raise "
                "learner.buffer_batches (or ship more groups per batch)"
            )
