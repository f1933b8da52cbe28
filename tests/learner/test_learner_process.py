"""The real learner (`bin/learner`: intake + Ray + 2 FSDP workers on gloo) as a child process, fed
by two stand-in rollout servers over real ZeroMQ, in one chained run (one learner start per life,
every assertion on that run): it trains, publishes every version, checkpoints every 3 steps keeping
one, is SIGKILLed after step 5 with its last checkpoint at step 3, and the restarted learner rolls
back to it. Checked: the rollback is marked, versions only go up (on the learner and on every
server), no accepted trajectory is lost or trained twice, no weights file of the dead learner
survives the next start, and the run ends with every step's metrics and one checkpoint."""

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

from launcher.plan import free_port
from learner import trained_log

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
FEEDER = Path(__file__).with_name("feeder.py")
STEP_KEYS = (
    "reward/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "timing/wait_s",
    "timing/update_s",
    "timing/broadcast_s",
    "perf/tokens_per_s",
    "timing/ref_early_s",  # KL loss: the reference forwards the waits ran (learner.early_reference)
    "prepare/ref_early_frac",
)


def write_config(tmp: Path, model: Path, port: int, shm: Path) -> Path:
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
            "ref": {"forward_in_waits": True},
        },
        "data": {"train_files": [str(data)], "train_batch_size": 2},
        "trainer": {
            "total_training_steps": 7,
            "save_freq": 3,
            "max_actor_ckpt_to_keep": 1,
            "n_gpus_per_node": 2,
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
        # a loaded CI machine
        "transport": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10.0},
        "ray": {"num_cpus": 2},
    }
    path = tmp / "learner.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def feed(tmp: Path, name: str, key: str) -> list[Any]:
    return [f[key] for f in read_jsonl(tmp / f"{name}.jsonl") if key in f]


def test_train_checkpoint_sigkill_after_step_5_restart_from_3(
    tiny_model: Path, tmp_path: Path
) -> None:
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
        # 11 groups: 5 steps of 2, and one more that step 6 waits for, so the learner stops after
        # step 5
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
        kill_group(first)  # the learner, its Ray cluster and its workers, no chance to clean up
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
    text = logs[1].read_text()
    assert "global_step_3" in text and "rolled back" in text and "training done" in text

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
    metrics = read_jsonl(run / "metrics.jsonl")
    resumed = [m for m in metrics if "checkpoint/rolled_back_steps" in m]
    assert (
        len(resumed) == 1
        and resumed[0]["step"] == 4
        and resumed[0]["checkpoint/rolled_back_steps"] == 2
    )
    # every step of both lives reports the training metrics
    assert {m["step"] for m in metrics} == set(range(1, 8))
    for m in metrics:
        for key in STEP_KEYS:
            assert key in m, (m["step"], key)
    assert metrics[-1]["actor/kl_loss"] > 0, "the policy moved away from the reference"
    # the reference forwards of groups buffered during a wait ran in it (learner.early_reference)
    early = [m["prepare/ref_early_frac"] for m in metrics]
    assert any(f > 0 for f in early) and all(0 <= f <= 1 for f in early), early

    # versions only go up: on the learner (every step line, undone ones included) and on every
    # server, and every version published reaches the server connected then (0 only if it asked:
    # it announced 0 in HELLO)
    lines = [json.loads(x) for x in (run / "trained.jsonl").read_text().splitlines()]
    versions = [x["policy_version"] for x in lines if "step" in x]
    assert versions == [1, 2, 3, 4, 5, 7, 8, 9, 10], versions
    a, b = feed(tmp_path, "feed_a", "weights"), feed(tmp_path, "feed_b", "weights")
    for got in (a, b):
        assert got == sorted(set(got)), f"a server received versions out of order: {got}"
    assert a in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), a
    assert b[-1] == 10 and b[0] >= 6, b
    assert json.loads((run / "published_version.json").read_text())["highest_published"] == 10

    # each accepted trajectory trained exactly once (the undone steps' lines do not count)
    ids = [i for step in trained.trajectory_ids().values() for i in step]
    assert sorted(trained.steps) == list(range(1, 8))
    assert len(ids) == len(set(ids)) == 28, "a trajectory was trained twice or lost"
    acked = {
        i for name in ("feed_a", "feed_b") for batch in feed(tmp_path, name, "acked") for i in batch
    }
    assert acked == set(ids)

    # checkpoints: the last step's, with its HF export; trainer.max_actor_ckpt_to_keep=1 pruned
    # the rest, the first life's included
    last = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    assert (ckpt / f"global_step_{last}" / "hf" / "model.safetensors").exists()
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == [f"global_step_{last}"]
    assert int(last) >= 6
