"""Validation end to end: the real learner (`bin/learner`: intake + Ray + one FSDP worker) and the
real rollout server (`bin/rollout-server`, tool agent) on the tiny model. The server runs the
scripted engine (`rollout_server.engine=scripted`): validation's coordination is under test, not the
model's samples, and a vLLM server process is tests/rollout/test_server_process.py's. The learner
validates before training and every 2 steps; the server runs the validation set and
answers with metrics only. Checked: val metrics at steps 0, 2 and 4 with the right counts, no
validation episode ever trained on or shipped (trained.jsonl, the server's recording), training
still completes, and the server logged serving the requests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_testkit import read_jsonl, start

from launcher.plan import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
VAL_ROWS, VAL_N = 6, 2


def overrides(tmp: Path, model: Path, data: Path, port: int) -> list[str]:
    address = f"tcp://127.0.0.1:{port}"
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=24",
        "actor_rollout_ref.rollout.max_staleness=1000",
        f"actor_rollout_ref.rollout.val_kwargs.n={VAL_N}",
        "trainer.total_training_steps=4",
        "trainer.test_freq=2",
        "trainer.val_before_train=true",
        "trainer.val_timeout_s=480",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[console,jsonl]",
        f"trainer.run_dir={tmp / 'run'}",
        "trainer.save_freq=-1",
        f"learner.bind_address={address}",
        f"rollout_server.learner_address={address}",
        "rollout_server.server_id=rs0",
        "rollout_server.engine=scripted",
        "rollout_server.record=true",
        "rollout_server.max_concurrent_episodes=8",
        "rollout_server.stats_interval_s=5",
        "transport.heartbeat_interval_s=0.5",
        "transport.heartbeat_timeout_s=10",
    ]


def stop(p: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
    p.wait(timeout=60)


def test_learner_validates_on_the_rollout_server(tiny_model: Path, tmp_path: Path) -> None:
    from rollout_service.recording import read_recording
    from tools.make_tiny_data import make_tiny_data

    data = make_tiny_data(tmp_path / "data", train=32, val=VAL_ROWS)
    over = overrides(tmp_path, tiny_model, data, free_port("127.0.0.1"))
    config = str(ROOT / "configs" / "default.yaml")
    learner_log, server_log = tmp_path / "learner.log", tmp_path / "server.log"
    learner = start([sys.executable, "bin/learner", "--config", config, *over], learner_log)
    server = start([sys.executable, "bin/rollout-server", "--config", config, *over], server_log)
    t0 = time.monotonic()
    try:
        code = learner.wait(timeout=1000)
        tails = f"--- learner\n{learner_log.read_text()[-5000:]}\n--- server\n{server_log.read_text()[-5000:]}"
        assert code == 0, tails
        # the learner said BYE; the server keeps reconnecting until told to stop
        stop(server, signal.SIGTERM)
    finally:
        stop(learner)
        stop(server)
    print(f"learner finished after {time.monotonic() - t0:.0f} s")
    run = tmp_path / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    trained_steps = [m["step"] for m in metrics if "actor/pg_loss" in m]
    assert trained_steps == [1, 2, 3, 4], tails
    val = {m["step"]: m for m in metrics if "val/reward/mean" in m or "val/count" in m}
    assert sorted(val) == [0, 2, 4], tails
    for step, m in val.items():
        assert m["val/count"] == VAL_ROWS * VAL_N, (step, m)
        assert m["val/count/arithmetic"] == VAL_ROWS * VAL_N, (step, m)
        assert "val/reward/mean" in m and "val/reward/mean/arithmetic" in m, (step, m)
        assert 0.0 <= m["val/reward/mean/arithmetic"] <= 1.0
        assert m["val/servers_answered"] == 1 and m["val/servers_missing"] == 0
        assert m["val/shards_missing"] == 0
        assert m["val/policy_version"] == step  # one update per step: version == step
    assert "val/count" not in next(m for m in metrics if m["step"] == 1)  # not a validation step
    # Validation episodes never reach training: not trained on, not even shipped.
    trained = [i for line in read_jsonl(run / "trained.jsonl") for i in line["trajectory_ids"]]
    assert len(trained) == 4 * 2 * 2 and not [i for i in trained if i.startswith("val-")]
    # no checkpoints (save_freq -1): the trained model is still exported, whole
    final = run / "final-hf"
    assert (final / "config.json").is_file() and list(final.glob("*.safetensors")), tails
    shipped = [t for _, batch in read_recording(run / "recordings" / "rs0") for t in batch]
    assert shipped and not [t for t in shipped if t.group_uid.startswith("val-")]
    assert {t.data_source for t in shipped} == {"arithmetic"}
    text = server_log.read_text()
    assert text.count("validation served") >= 3, text[-3000:]
    assert "training done" in learner_log.read_text()
