"""Validation on the learner side: when to validate, one round of requests, and its metrics.

Design: the rollout servers run the validation set (each its shard, ``rollout_service.validation``)
and answer with metrics only; the learner asks every connected server that offers validation
(``Intake.validate``), waits for their answers, merges them weighted by counts
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
from dataclasses import dataclass, field

import anyio

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
