"""Validation on the learner side: when to validate, one round of requests, and its metrics.

Design: the rollout servers run the validation set (each its shard, ``rollout_service.validation``)
and answer with metrics only; the learner asks every connected server that offers validation
(``Validations.validate``, the learner link's validation part), waits for their answers, merges them weighted by counts
(``protocol.validation.merge``) and logs them at the current step next to the training metrics
(``val/reward/mean``, ``val/reward/mean/<source>``, ``val/count/<source>``, ...). The trainer blocks
while it waits, as verl does (the intake keeps receiving training batches meanwhile), for at most
``trainer.val_timeout_s``; then it logs what arrived, says which servers did not answer, and goes on.
A server that leaves while asked is reported as lost at once (the protocol's ValidationAbandoned),
so a dead server never costs the full timeout. A server that joins while a round is open is asked
too, and once every asked server answered, a round whose answers leave shards of the validation set
uncovered (the servers say which shard of how many they ran) waits up to
``trainer.val_shard_wait_s`` more for their servers: before the first step, one server's engine is
often still loading when the first one answers, and a round without it measures half the set
(``val/shards_missing`` says what was left out).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import anyio
import structlog

from common.timeline import VALIDATE_SPAN, TimelineWriter, Track
from protocol.driver import LearnerServer
from protocol.events import PeerJoined, ValidationAbandoned, ValidationReceived
from protocol.messages import SourceMetrics, ValidateResult
from protocol.validation import merge, total


def due(step: int, test_freq: int) -> bool:
    """Whether the step just finished is a validation step (``test_freq`` <= 0: never)."""
    return test_freq > 0 and step > 0 and step % test_freq == 0


@dataclass
class ValidationRound:
    """One request to the servers connected when it was sent, and what came back."""

    request_id: str
    policy_version: int
    asked: list[str] = field(default_factory=list)
    results: dict[str, ValidateResult] = field(default_factory=dict)  # peer -> its answer
    lost: dict[str, str] = field(default_factory=dict)  # peer -> why it left before answering
    started: float = field(default_factory=time.monotonic)
    deadline: float = float("inf")  # monotonic time after which nobody more is asked
    duration_s: float = 0.0
    _changed: anyio.Event | None = field(default=None, repr=False)

    @property
    def outstanding(self) -> list[str]:
        """Asked peers that neither answered nor left."""
        return [p for p in self.asked if p not in self.results and p not in self.lost]

    def ask_more(self, peers: list[str]) -> None:
        """``peers`` (joined while the round is open) were asked too; one asked before and lost
        is outstanding again."""
        for peer in peers:
            self.lost.pop(peer, None)
            self.results.pop(peer, None)
            if peer not in self.asked:
                self.asked.append(peer)
        self._wake()

    @property
    def shards_missing(self) -> int:
        """Shards of the validation set no ok answer covered, where the answers agree on how many
        shards there are (0 when they disagree or none arrived: nothing to judge by)."""
        ok = [r for r in self.results.values() if r.ok]
        counts = {r.shard_count for r in ok}
        if len(counts) != 1:
            return 0
        return counts.pop() - len({r.shard_index for r in ok})

    def answered(self, peer: str, result: ValidateResult) -> None:
        if peer in self.asked:
            self.results[peer] = result
            self._wake()

    def left(self, peer: str, reason: str) -> None:
        if peer in self.asked and peer not in self.results:
            self.lost[peer] = reason
            self._wake()

    async def wait(self, *, covered: bool = False) -> None:
        """Until every asked peer answered or left and, with ``covered``, every shard is covered
        (cancel it to stop waiting)."""
        while self.outstanding or (covered and self.shards_missing):
            self._changed = self._changed or anyio.Event()
            await self._changed.wait()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    @property
    def sources(self) -> dict[str, SourceMetrics]:
        return merge(self.results.values())

    @property
    def failed(self) -> dict[str, str]:
        """Peers that answered ok=false, with their reasons."""
        return {p: r.error for p, r in self.results.items() if not r.ok}


class Validations:
    """The learner link's validation part: the rounds open on ``server``, fed the link's events.
    Validation answers carry no trajectories: they never touch the buffer, the journal or the
    credits."""

    def __init__(self, server: LearnerServer, log: structlog.stdlib.BoundLogger) -> None:
        self._server, self._proto, self._log = server, server.proto, log
        self._rounds: dict[str, ValidationRound] = {}  # requests being waited for
        self._joined: anyio.Event | None = None  # set when a rollout server joins
        self._closed = False

    async def validate(
        self,
        policy_version: int,
        *,
        timeout_s: float,
        request_id: str | None = None,
        shard_wait_s: float = 0.0,
    ) -> ValidationRound:
        """Ask every connected rollout server that offers validation to validate ``policy_version``
        (or newer) and wait until each answered or left, at most ``timeout_s`` in all. With no rollout
        server connected at all (before the first step), first wait within the same budget for one to
        join; servers that do not offer validation (protocol 1.0) are not asked. Servers that join
        while the round is open are asked too, and when the answers leave shards of the validation
        set uncovered, the round waits up to ``shard_wait_s`` more (within ``timeout_s``) for their
        servers to join and answer. The round is returned with whatever arrived; answers after it
        returned are ignored."""
        deadline = time.monotonic() + timeout_s
        rnd = ValidationRound(
            request_id or f"v{policy_version}-{uuid.uuid4().hex[:8]}", policy_version
        )
        with anyio.move_on_after(timeout_s):
            while not self._proto.ready_peers() and not self._closed:
                self._joined = self._joined or anyio.Event()
                await self._joined.wait()
        left = deadline - time.monotonic()
        if left > 0 and not self._closed:
            self._rounds[rnd.request_id] = rnd
            # The duration is the run's, not the wait for a server to join.
            rnd.started = time.monotonic()
            rnd.deadline = deadline
            try:
                rnd.asked = self._server.request_validation(
                    rnd.request_id, policy_version, timeout_s=left
                )
                self._log.info(
                    "validation requested",
                    request=rnd.request_id,
                    policy_version=policy_version,
                    servers=rnd.asked,
                    timeout_s=round(left, 1),
                )
                with anyio.move_on_after(left):
                    await rnd.wait()
                    if rnd.shards_missing and shard_wait_s > 0:
                        self._log.info(
                            "validation waits for the servers of uncovered shards",
                            request=rnd.request_id,
                            shards_missing=rnd.shards_missing,
                            wait_s=shard_wait_s,
                        )
                        with anyio.move_on_after(shard_wait_s):
                            await rnd.wait(covered=True)
            finally:
                del self._rounds[rnd.request_id]
        rnd.duration_s = time.monotonic() - rnd.started
        return rnd

    def on_joined(self, ev: PeerJoined) -> None:
        """A server joined: a round waiting for one goes on, and every open round asks it too
        (request_validation asks only peers not yet asked for that request)."""
        if self._joined is not None:
            self._joined.set()
            self._joined = None
        now = time.monotonic()
        for rnd in self._rounds.values():
            if rnd.deadline > now:
                asked = self._server.request_validation(
                    rnd.request_id, rnd.policy_version, timeout_s=rnd.deadline - now
                )
                if asked:
                    rnd.ask_more(asked)
                    self._log.info(
                        "validation requested", request=rnd.request_id, servers=asked, joined=True
                    )

    def on_result(self, ev: ValidationReceived) -> None:
        r = ev.result
        if (rnd := self._rounds.get(r.request_id)) is not None:
            rnd.answered(ev.peer_id, r)
        self._log.info(
            "validation result",
            peer=ev.peer_id,
            request=r.request_id,
            ok=r.ok,
            episodes=r.count,
            policy_version=r.policy_version,
            error=r.error or None,
            late=rnd is None,
        )

    def on_abandoned(self, ev: ValidationAbandoned) -> None:
        if (rnd := self._rounds.get(ev.request_id)) is not None:
            rnd.left(ev.peer_id, ev.reason)
            self._log.warning(
                "a rollout server left before its validation result",
                peer=ev.peer_id,
                request=ev.request_id,
                why=ev.reason,
            )

    def close(self) -> None:
        """The link is closing: nobody will join or answer any more."""
        self._closed = True
        for rnd in self._rounds.values():
            for peer in rnd.outstanding:
                rnd.left(peer, "the intake closed")
        if self._joined is not None:
            self._joined.set()
            self._joined = None


async def validate_policy(
    validations: Validations,
    version: int,
    step: int,
    *,
    timeout_s: float,
    shard_wait_s: float,
    timeline: TimelineWriter,
    log: structlog.stdlib.BoundLogger,
) -> dict[str, float]:
    """The trainer's validation after ``step``: one round on policy ``version`` (bounded by
    ``timeout_s``, trainer.val_timeout_s), its span on the timeline and a log line naming the
    servers that did not answer; the ``val/...`` metrics of what arrived."""
    started = time.time()
    rnd = await validations.validate(
        version,
        timeout_s=timeout_s,
        request_id=f"step{step}-{uuid.uuid4().hex[:6]}",
        shard_wait_s=shard_wait_s,
    )
    metrics = validation_metrics(rnd)
    timeline.span(Track.STEP, VALIDATE_SPAN, started, time.time(), step=step)
    missing = {
        **rnd.lost,
        **dict.fromkeys(rnd.outstanding, "no answer within trainer.val_timeout_s"),
    }
    log.info(
        "validation",
        step=step,
        policy_version=version,
        servers=len(rnd.asked),
        episodes=int(metrics["val/count"]),
        reward=metrics.get("val/reward/mean"),
        seconds=round(rnd.duration_s, 1),
        missing=missing or None,
        failed=rnd.failed or None,
        shards_missing=rnd.shards_missing or None,
    )
    if not rnd.asked:
        log.warning(
            "validation skipped: no rollout server connected within trainer.val_timeout_s, or "
            "none offers validation",
            step=step,
        )
    elif not metrics["val/count"] and not missing:
        log.warning(
            "validation ran no episode: do the rollout servers have data.val_files?",
            step=step,
        )
    return metrics


def validation_metrics(rnd: ValidationRound) -> dict[str, float]:
    """The round as ``val/...`` metrics: per data source and over all of them, plus bookkeeping."""
    sources = rnd.sources
    out: dict[str, float] = {
        "val/servers_asked": float(len(rnd.asked)),
        "val/servers_answered": float(sum(r.ok for r in rnd.results.values())),
        "val/servers_failed": float(len(rnd.failed)),
        "val/servers_missing": float(len(rnd.outstanding) + len(rnd.lost)),
        "val/shards_missing": float(rnd.shards_missing),
        "val/duration_s": rnd.duration_s,
        "val/policy_version": float(rnd.policy_version),
    }
    if not sources:
        out["val/count"] = 0.0
        return out
    for suffix, m in [("", total(sources.values())), *((f"/{s}", m) for s, m in sources.items())]:
        out |= _source_metrics(m, suffix)
    return out


def _source_metrics(m: SourceMetrics, suffix: str) -> dict[str, float]:
    out = {f"val/count{suffix}": float(m.count)}
    if not m.count:
        return out
    out |= {
        f"val/reward/mean{suffix}": m.reward_mean,
        f"val/response/length_mean{suffix}": m.response_length_mean,
        f"val/episode/turns_mean{suffix}": m.turns_mean,
    }
    for term, n in m.terminations.items():
        out[f"val/episode/termination/{term}{suffix}"] = n / m.count
    for key, mean in m.extras_mean.items():
        out[f"val/extras/{key}/mean{suffix}"] = mean
    return out
