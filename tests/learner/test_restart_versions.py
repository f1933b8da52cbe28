"""Restarting the learner from any checkpoint: versions only go up, rolled-back steps are marked,
nothing is trained twice, and no weights file of a dead learner is left.

Unit tests of the version ledger, the resume rule and trained.jsonl; then the real thing: the learner
(`bin/learner`, one FSDP worker on gloo) with two stand-in rollout servers over real ZeroMQ,
SIGKILLed after step 5 with its last checkpoint at step 3, and restarted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from process_testkit import kill_group, read_jsonl, start, wait_for

from learner import trained_log
from learner.versions import LEDGER, VersionLedger, resume, resumed_version


def step_line(step: int, version: int, ids: list[str]) -> str:
    return json.dumps({"step": step, "policy_version": version, "trajectory_ids": ids}) + "\n"


# -- unit -------------------------------------------------------------------------------------------
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


# -- the real learner ---------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
FEEDER = Path(__file__).with_name("feeder.py")


def write_config(tmp: Path, model: Path, port: int, shm: Path) -> Path:
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    cfg = {
        "actor_rollout_ref": {
            "model": {"path": str(model)},
            "actor": {
                "ppo_mini_batch_size": 4,
                "ppo_micro_batch_size_per_gpu": 4,
                "optim": {"lr": 1e-3},
            },
            "rollout": {"n": 2, "max_staleness": 1000},
        },
        "data": {"train_files": [str(data)], "train_batch_size": 2},
        "trainer": {
            "total_training_steps": 7,
            "save_freq": 3,
            "n_gpus_per_node": 1,
            "device": "cpu",
            "logger": ["jsonl"],
            "run_dir": str(tmp / "run"),
            "experiment_name": "t",
        },
        "learner": {
            "bind_address": f"tcp://127.0.0.1:{port}",
            "buffer_batches": 4,
            "weights_file_dir": str(shm),
        },
        "transport": {
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": 10.0,
        },  # a loaded CI machine
        "ray": {"num_cpus": 1},
    }
    path = tmp / "learner.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def feed(tmp: Path, name: str, key: str) -> list[Any]:
    return [f[key] for f in read_jsonl(tmp / f"{name}.jsonl") if key in f]


@pytest.mark.e2e
def test_sigkill_after_step_5_with_checkpoint_3_then_restart(
    tiny_model: Path, tmp_path: Path
) -> None:
    from launcher.plan import free_port

    port = free_port("127.0.0.1")
    shm = Path(
        tempfile.mkdtemp(
            prefix="restart-test-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        )
    )
    cfg = write_config(tmp_path, tiny_model, port, shm)
    run = tmp_path / "run"
    logs = [tmp_path / n for n in ("learner1.log", "learner2.log", "feed_a.log", "feed_b.log")]

    def feeder(name: str, groups: int, log: Path) -> subprocess.Popen[bytes]:
        return start(
            [
                sys.executable,
                str(FEEDER),
                "--token-file",
                str(tmp_path / "run" / "learner.token"),
                "--connect",
                f"tcp://127.0.0.1:{port}",
                "--model",
                str(tiny_model),
                "--out",
                str(tmp_path / f"{name}.jsonl"),
                "--groups",
                str(groups),
                "--peer-id",
                name,
                "--exit-on-bye",
            ],
            log,
        )

    procs: list[subprocess.Popen[bytes]] = []
    try:
        # 11 groups: 5 steps of 2, and one more that step 6 waits for, so the learner stops after step 5
        procs.append(feed_a := feeder("feed_a", 11, logs[2]))
        procs.append(first := start([sys.executable, "bin/learner", "--config", str(cfg)], logs[0]))
        wait_for(
            lambda: (
                5 in trained_log.read(run / "trained.jsonl").steps
                and 5 in feed(tmp_path, "feed_a", "weights")
                and len(feed(tmp_path, "feed_a", "acked")) == 11
            ),
            300,
            "step 5 applied, 11 batches acked",
            logs,
        )
        time.sleep(1.0)  # step 6 has 1 of its 2 groups: the learner waits
        dead = list(shm.glob(f"agentrl-weights-{first.pid}-*"))
        kill_group(first)
        assert len(dead) == 1 and dead[0].exists(), (
            "the killed learner's weights files are the test's subject"
        )
        ckpt = run / "checkpoints"
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
        assert trained_log.read(run / "trained.jsonl").last_step == 5

        procs.append(
            second := start([sys.executable, "bin/learner", "--config", str(cfg)], logs[1])
        )
        wait_for(
            lambda: "resumed_from" in logs[1].read_text(), 300, "the second learner to start", logs
        )
        assert not dead[0].exists(), "the dead learner's /dev/shm files survived the next start"
        procs.append(feed_b := feeder("feed_b", 3, logs[3]))
        assert second.wait(timeout=300) == 0, logs[1].read_text()[-4000:]
        assert feed_a.wait(timeout=30) == 0 and feed_b.wait(timeout=30) == 0, logs[2].read_text()[
            -3000:
        ]
    finally:
        for p in procs:
            kill_group(p)
        leftovers = sorted(p.name for p in shm.iterdir())
        shutil.rmtree(shm, ignore_errors=True)
    assert leftovers == [], "weights files left after a normal exit"

    # the rollback is marked, and the restored weights got a version above everything published
    trained = trained_log.read(run / "trained.jsonl")
    assert len(trained.rollbacks) == 1
    rb = trained.rollbacks[0]
    assert (rb["from_step"], rb["to_step"], rb["undone_steps"]) == (5, 3, [4, 5])
    assert (rb["checkpoint_version"], rb["highest_published_version"], rb["resumed_version"]) == (
        3,
        5,
        6,
    )
    assert "rolled back" in logs[1].read_text()
    metrics = read_jsonl(run / "metrics.jsonl")
    resumed = [m for m in metrics if "checkpoint/rolled_back_steps" in m]
    assert (
        len(resumed) == 1
        and resumed[0]["step"] == 4
        and resumed[0]["checkpoint/rolled_back_steps"] == 2
    )

    # versions only go up: on the learner (every step line, undone ones included) and on every server
    lines = [json.loads(x) for x in (run / "trained.jsonl").read_text().splitlines()]
    versions = [x["policy_version"] for x in lines if "step" in x]
    assert versions == [1, 2, 3, 4, 5, 7, 8, 9, 10], versions
    a, b = feed(tmp_path, "feed_a", "weights"), feed(tmp_path, "feed_b", "weights")
    for got in (a, b):
        assert got == sorted(set(got)), f"a server received versions out of order: {got}"
    assert a[a.index(5) + 1] == 6, f"server A did not apply the resumed weights first: {a}"
    assert a[-1] == 10 and b[-1] == 10 and b[0] >= 6, (a, b)
    assert json.loads((run / "published_version.json").read_text())["highest_published"] == 10

    # each accepted trajectory trained exactly once (the undone steps' lines do not count)
    ids = [i for step in trained.trajectory_ids().values() for i in step]
    assert sorted(trained.steps) == list(range(1, 8))
    assert len(ids) == len(set(ids)) == 28, "a trajectory was trained twice or lost"
    acked = {
        i for name in ("feed_a", "feed_b") for batch in feed(tmp_path, name, "acked") for i in batch
    }
    assert acked == set(ids)
