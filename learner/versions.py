"""Policy versions that only go up over a run, across learner restarts from any checkpoint.

Design: a version names one set of weights for the whole run. Rollout servers refuse a version that
is not newer than the one they hold, trajectories carry the versions that generated them, and
staleness is a difference of versions. A learner resumed from a checkpoint older than its last
published version must therefore never publish the versions it published after that checkpoint
again: they would name other weights than the ones servers hold and label trajectories with.

- Every version is written durably to ``RUN_DIR/published_version.json`` before it is published
  (``VersionLedger.record``, one small fsync per step), so the highest version ever published
  survives any kill, SIGKILL included.
- At start (``resume``), with ``c`` the checkpoint's version (0 for none) and ``h`` the highest
  version published in this run directory (the ledger; for a run directory older than the ledger,
  trained.jsonl): the restored weights are published as ``c`` when nothing above ``c`` was published
  (a plain restart, servers may already hold ``c``), else as ``h + 1``, and the counter goes on
  from there. Each version still names one set of weights (two versions may name the same weights:
  ``c`` and ``h + 1``), so servers accept the resumed weights and nothing is misattributed.
- Versions ``c+1 .. h`` now name weights of a discarded branch. Trajectories generated with them
  keep their labels (their rollout logprobs are those weights', so importance weights stay right).
  The ledger records each restart's alias ``(h + 1, c)`` durably, and the learner judges the age of
  what it accepted before the restart by the updates between the weights (``protocol.lineage``):
  data of ``c`` or older is as old as it was, data of the discarded branch as far as the path back
  to ``c``. So the journaled groups within ``max_staleness`` are trained, not dropped as collateral
  of the restart, and none is trained as fresher than it is.
- The steps trained after the checkpoint are undone by the restart: a rollback record in
  trained.jsonl (``learner.trained_log``), a warning, and ``checkpoint/rolled_back_steps`` with the
  first step's metrics. The intake journal replays their trajectories, which the resumed run trains
  once more (the lost updates never reached the checkpointed model).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.fileio import atomic_write_bytes
from common.logging import get_logger
from learner import trained_log
from protocol.lineage import Lineage

LEDGER = "published_version.json"


class VersionLedger:
    """The highest policy version ever published from ``run_dir`` (-1: none yet)."""

    def __init__(self, run_dir: Path, *, durable: bool = True) -> None:
        self.path = Path(run_dir) / LEDGER
        self.durable = durable
        self.highest = -1
        self.lineage = Lineage()
        if self.path.exists():
            doc = json.loads(self.path.read_text())
            self.highest = int(doc["highest_published"])
            self.lineage = Lineage(tuple((int(r), int(c)) for r, c in doc.get("aliases", [])))

    def _write(self) -> None:
        doc = {
            "highest_published": self.highest,
            "aliases": [list(a) for a in self.lineage.aliases],
        }
        atomic_write_bytes(self.path, json.dumps(doc).encode() + b"\n", durable=self.durable)

    def record(self, version: int) -> None:
        """Call before publishing ``version``: from then on no restart reuses it."""
        if version > self.highest:
            self.highest = version
            self._write()

    def resumed(self, resumed: int, restored: int) -> None:
        """A restart publishes the weights of ``restored`` as ``resumed`` (durably, before use)."""
        lineage = self.lineage.resumed(resumed, restored)
        if lineage != self.lineage:
            self.lineage = lineage
            self.highest = max(self.highest, resumed - 1)
            self._write()


def resumed_version(checkpoint_version: int, highest_published: int) -> int:
    """The version the restored weights are published as (see the module docstring)."""
    return checkpoint_version if highest_published <= checkpoint_version else highest_published + 1


@dataclass(frozen=True)
class Resume:
    version: int  # the restored weights' version; the counter goes on from it
    rollback: dict[str, Any] | None  # the record written to trained.jsonl, if steps were undone

    def metrics(self) -> dict[str, float]:
        """For the first step's metrics."""
        if self.rollback is None:
            return {}
        r = self.rollback
        return {
            "checkpoint/rolled_back_steps": float(r["from_step"] - r["to_step"]),
            "checkpoint/skipped_versions": float(r["resumed_version"] - r["checkpoint_version"]),
        }


def resume(
    run_dir: Path,
    ledger: VersionLedger,
    *,
    step: int,
    checkpoint_version: int,
    checkpoint: Path | None,
) -> Resume:
    """Pick the version to publish the restored weights as (``step``/``checkpoint_version``: the
    checkpoint's, 0/0 without one) and mark the steps trained after it as rolled back."""
    path = Path(run_dir) / trained_log.TRAINED_IDS
    log = trained_log.read(path)
    highest = max(ledger.highest, log.highest_version)
    version = resumed_version(checkpoint_version, highest)
    ledger.resumed(version, checkpoint_version)
    if log.last_step <= step:
        return Resume(version, None)
    undone = sorted(s for s in log.steps if s > step)
    record = {
        "from_step": log.last_step,
        "to_step": step,
        "undone_steps": undone,
        "undone_trajectories": sum(len(log.steps[s]["trajectory_ids"]) for s in undone),
        "highest_published_version": highest,
        "checkpoint_version": checkpoint_version,
        "resumed_version": version,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    trained_log.append_rollback(path, record)
    get_logger("learner").warning(
        "rolled back: the steps trained after the checkpoint are undone",
        from_step=record["from_step"],
        to_step=step,
        highest_published_version=highest,
        resumed_version=version,
        checkpoint=record["checkpoint"],
    )
    return Resume(version, record)
