"""RUN_DIR/trained.jsonl: which trajectories each step trained on, and which steps a restart undid.

Design: one JSON line per trained step, ``{"step", "policy_version", "trajectory_ids"}``, appended
after the step (for replay checks and for proving exactly-once training across restarts). A learner
resumed from a checkpoint older than its last trained step appends a rollback record first,
``{"rollback": {"from_step": 5, "to_step": 3, ...}}``: the lines of steps above ``to_step`` written
before it belong to updates that were lost with the crash. Their trajectories are trained again by
the resumed run (the intake journal replays them), so ``effective`` (the lines a rollback did not
undo) lists every trajectory id at most once while the file keeps the whole history. A SIGKILL can
tear the last line: readers skip a line that is not JSON, and an append first ends it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRAINED_IDS = "trained.jsonl"


@dataclass
class TrainedLog:
    """What trained.jsonl says: the steps that count (a rollback's undone steps removed)."""

    steps: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> its line
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    highest_version: int = -1  # of every step line, undone ones included (they were published)

    @property
    def last_step(self) -> int:
        return max(self.steps, default=0)

    def trajectory_ids(self) -> dict[int, list[str]]:
        return {s: list(line["trajectory_ids"]) for s, line in sorted(self.steps.items())}


def read(path: Path) -> TrainedLog:
    log = TrainedLog()
    if not path.exists():
        return log
    for raw in path.read_text().splitlines():
        try:
            line = json.loads(raw)
        except ValueError:  # torn by a kill mid-write
            continue
        if not isinstance(line, dict):
            continue
        if "rollback" in line:
            to = int(line["rollback"]["to_step"])
            log.steps = {s: v for s, v in log.steps.items() if s <= to}
            log.rollbacks.append(line["rollback"])
        elif "step" in line:
            log.steps[int(line["step"])] = (
                line  # no rollback record (older runs): the later line counts
            )
            log.highest_version = max(log.highest_version, int(line.get("policy_version", -1)))
    return log


def append_step(path: Path, step: int, policy_version: int, trajectory_ids: list[str]) -> None:
    _append(
        path, {"step": step, "policy_version": policy_version, "trajectory_ids": trajectory_ids}
    )


def append_rollback(path: Path, record: dict[str, Any]) -> None:
    """Durably: a crash right after the resume must not lose the mark."""
    _append(path, {"rollback": record}, durable=True)


def _append(path: Path, line: dict[str, Any], *, durable: bool = False) -> None:
    with open(path, "ab+") as f:
        if f.tell():
            f.seek(-1, os.SEEK_END)
            # a torn last line: keep it on its own line, where readers skip it
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(line) + "\n").encode())
        if durable:
            f.flush()
            os.fsync(f.fileno())
