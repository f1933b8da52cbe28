"""The real learner (`bin/learner`: intake + Ray + 2 FSDP workers on gloo) as a child process, fed by
a stand-in rollout server over real ZeroMQ: it trains, publishes every version, checkpoints, and a
SIGKILL mid-run followed by a restart loses no accepted trajectory and trains none twice."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from process_testkit import kill_group, read_jsonl, start, wait_for

from launcher.plan import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
FEEDER = Path(__file__).with_name("feeder.py")


def write_config(tmp: Path, model: Path, port: int, **trainer: Any) -> Path:
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    cfg = {
        "actor_rollout_ref": {
            "model": {"path": str(model)},
            "actor": {
                "ppo_mini_batch_size": 4,
                "ppo_micro_batch_size_per_gpu": 2,
                "use_kl_loss": True,
                "optim": {"lr": 1e-3},
            },
            "rollout": {"n": 2, "max_staleness": 1000},
        },
        "data": {"train_files": [str(data)], "train_batch_size": 2},
        "trainer": {
            "total_training_steps": 4,
            "n_gpus_per_node": 2,
            "device": "cpu",
            "logger": ["jsonl"],
            "run_dir": str(tmp / "run"),
            "experiment_name": "t",
            **trainer,
        },
        "learner": {"bind_address": f"tcp://127.0.0.1:{port}", "buffer_batches": 4},
        "transport": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0},
        "ray": {"num_cpus": 2},
    }
    path = tmp / "learner.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def trained_by_step(run: Path) -> dict[int, list[str]]:
    from learner import trained_log

    return trained_log.read(
        run / "trained.jsonl"
    ).trajectory_ids()  # steps a restart undid left out


def test_learner_trains_publishes_and_checkpoints(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    cfg = write_config(tmp_path, tiny_model, port, save_freq=2, max_actor_ckpt_to_keep=1)
    run = tmp_path / "run"
    feed_log, learner_log = tmp_path / "feeder.log", tmp_path / "learner.log"
    learner = start([sys.executable, "bin/learner", "--config", str(cfg)], learner_log)
    feeder = start(
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
            str(tmp_path / "feed.jsonl"),
            "--groups",
            "8",
            "--exit-on-bye",
        ],
        feed_log,
    )
    try:
        assert learner.wait(timeout=240) == 0, learner_log.read_text()[-4000:]
        assert feeder.wait(timeout=30) == 0, feed_log.read_text()[-3000:]
    finally:
        kill_group(learner)
        kill_group(feeder)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["policy/version"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        for key in (
            "reward/mean",
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/entropy",
            "actor/grad_norm",
            "timing/wait_s",
            "timing/update_s",
            "timing/broadcast_s",
            "perf/tokens_per_s",
        ):
            assert key in m, key
    assert metrics[-1]["actor/kl_loss"] > 0, "the policy moved away from the reference"
    feed = read_jsonl(tmp_path / "feed.jsonl")
    # every new version reaches the server (version 0 only if it asked: it announced 0 in HELLO)
    assert [f["weights"] for f in feed if "weights" in f] in ([1, 2, 3, 4], [0, 1, 2, 3, 4])
    trained = trained_by_step(run)
    ids = [i for step in sorted(trained) for i in trained[step]]
    assert len(ids) == 16 and len(set(ids)) == 16
    ckpt = run / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (ckpt / "global_step_4" / "hf" / "model.safetensors").exists()
    assert not (ckpt / "global_step_2").exists()  # trainer.max_actor_ckpt_to_keep=1
    assert "training done" in learner_log.read_text()


def test_sigkill_and_resume_loses_nothing_and_trains_nothing_twice(
    tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port("127.0.0.1")
    cfg = write_config(tmp_path, tiny_model, port, save_freq=1, total_training_steps=6)
    run = tmp_path / "run"
    logs = [tmp_path / "learner1.log", tmp_path / "learner2.log", tmp_path / "feeder.log"]
    feeder = start(
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
            str(tmp_path / "feed.jsonl"),
            "--groups",
            "12",
            "--exit-on-bye",
        ],
        logs[2],
    )
    first = start([sys.executable, "bin/learner", "--config", str(cfg)], logs[0])
    try:
        latest = run / "checkpoints" / "latest_checkpointed_iteration.txt"
        wait_for(
            lambda: latest.exists() and int(latest.read_text()) >= 2, 240, "checkpoint 2", logs
        )
        kill_group(first)  # the learner, its Ray cluster and its workers, no chance to clean up
        killed_at = int(latest.read_text())
        acked_before = {i for f in read_jsonl(tmp_path / "feed.jsonl") for i in f.get("acked", [])}
        second = start([sys.executable, "bin/learner", "--config", str(cfg)], logs[1])
        assert second.wait(timeout=240) == 0, logs[1].read_text()[-4000:]
        assert feeder.wait(timeout=30) == 0, logs[2].read_text()[-3000:]
    finally:
        kill_group(first)
        kill_group(feeder)
        if "second" in locals():
            kill_group(second)
    text = logs[1].read_text()
    assert "resumed_from" in text and f"global_step_{killed_at}" in text
    metrics = read_jsonl(run / "metrics.jsonl")
    final = {m["step"]: m for m in metrics}  # steps after the checkpoint ran twice: last wins
    assert sorted(final) == [1, 2, 3, 4, 5, 6]
    versions = [final[s]["policy/version"] for s in range(1, 7)]
    # after the checkpoint: above every version published before the kill (learner/versions.py)
    assert versions[:killed_at] == list(range(1, killed_at + 1)) and versions == sorted(
        set(versions)
    )
    trained = trained_by_step(run)
    ids = [i for step in sorted(trained) for i in trained[step]]
    assert len(ids) == len(set(ids)) == 24, "a trajectory was trained twice or lost"
    acked = {i for f in read_jsonl(tmp_path / "feed.jsonl") for i in f.get("acked", [])}
    assert acked_before <= set(ids), "accepted before the crash, never trained"
    assert acked == set(ids)
