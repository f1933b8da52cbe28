"""Restarting the learner from any checkpoint: versions only go up, rolled-back steps are marked,
nothing is trained twice, and no weights file of a dead learner is left.

Unit tests of the version ledger, the resume rule and trained.jsonl. The real thing (the learner
SIGKILLed after step 5 with its last checkpoint at step 3, and restarted) is the chained run of
test_learner_process.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from learner import trained_log
from learner.versions import LEDGER, VersionLedger, resume, resumed_version


def step_line(step: int, version: int, ids: list[str]) -> str:
    return json.dumps({"step": step, "policy_version": version, "trajectory_ids": ids}) + "\n"


def test_resumed_version_is_new_only_when_a_later_one_was_published() -> None:
    assert resumed_version(3, -1) == 3  # nothing recorded (a run directory older than the ledger)
    assert resumed_version(3, 3) == 3  # killed after the checkpoint, before the next publish
    assert resumed_version(3, 5) == 6  # v4 and v5 named weights the restart discards
    assert resumed_version(0, 7) == 8  # no checkpoint at all, or a fresh run in a used directory


def test_the_ledger_keeps_the_highest_version_durably(tmp_path: Path) -> None:
    ledger = VersionLedger(tmp_path)
    assert ledger.highest == -1
    for v in (0, 1, 2, 1):
        ledger.record(v)
    assert ledger.highest == 2 and VersionLedger(tmp_path).highest == 2
    assert json.loads((tmp_path / LEDGER).read_text()) == {"highest_published": 2, "aliases": []}


def test_resume_marks_the_undone_steps_and_skips_their_versions(tmp_path: Path) -> None:
    path = tmp_path / trained_log.TRAINED_IDS
    path.write_text("".join(step_line(s, s, [f"t{s}a", f"t{s}b"]) for s in range(1, 6)))
    ledger = VersionLedger(tmp_path)
    ledger.record(5)
    r = resume(
        tmp_path, ledger, step=3, checkpoint_version=3, checkpoint=tmp_path / "global_step_3"
    )
    assert r.version == 6
    assert r.rollback is not None and r.rollback["from_step"] == 5 and r.rollback["to_step"] == 3
    assert r.rollback["undone_steps"] == [4, 5] and r.rollback["undone_trajectories"] == 4
    assert r.metrics() == {"checkpoint/rolled_back_steps": 2.0, "checkpoint/skipped_versions": 3.0}
    log = trained_log.read(path)
    assert sorted(log.steps) == [1, 2, 3] and log.rollbacks == [r.rollback]
    # the resumed run trains steps 4 and 5 again: each id counts once, and a second restart from
    # the same checkpoint skips the versions published since
    trained_log.append_step(path, 4, 7, ["t4a", "t4b"])
    ledger.record(7)
    again = resume(tmp_path, VersionLedger(tmp_path), step=3, checkpoint_version=3, checkpoint=None)
    assert again.version == 8 and again.rollback is not None and again.rollback["from_step"] == 4
    ids = [i for s in trained_log.read(path).trajectory_ids().values() for i in s]
    assert len(ids) == len(set(ids)) == 6


def test_a_plain_restart_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / trained_log.TRAINED_IDS
    path.write_text("".join(step_line(s, s, [f"t{s}"]) for s in range(1, 4)))
    ledger = VersionLedger(tmp_path)
    ledger.record(3)
    r = resume(tmp_path, ledger, step=3, checkpoint_version=3, checkpoint=None)
    assert r.version == 3 and r.rollback is None and r.metrics() == {}
    assert "rollback" not in path.read_text()


def test_versions_of_runs_older_than_the_ledger_come_from_trained_jsonl(tmp_path: Path) -> None:
    (tmp_path / trained_log.TRAINED_IDS).write_text(
        "".join(step_line(s, s, [f"t{s}"]) for s in range(1, 6))
    )
    r = resume(tmp_path, VersionLedger(tmp_path), step=3, checkpoint_version=3, checkpoint=None)
    assert r.version == 6


def test_a_torn_last_line_is_skipped_and_ended_before_the_next(tmp_path: Path) -> None:
    path = tmp_path / trained_log.TRAINED_IDS
    path.write_text(step_line(1, 1, ["a"]) + step_line(2, 2, ["b"]) + '{"step": 3, "policy_ver')
    assert sorted(trained_log.read(path).steps) == [1, 2]
    r = resume(tmp_path, VersionLedger(tmp_path), step=1, checkpoint_version=1, checkpoint=None)
    assert r.version == 3 and r.rollback is not None and r.rollback["undone_steps"] == [2]
    assert path.read_text().splitlines()[2] == '{"step": 3, "policy_ver'
    assert sorted(trained_log.read(path).steps) == [1]
