"""The shipped agent configs end to end, as real processes: for each of configs/tiny_statelm.yaml,
tiny_code.yaml and tiny_mixed.yaml (with bin/tool-server), bin/learner and bin/rollout-server
run on the tiny model and generated data; the learner accepts the streamed trajectories (no
protocol violation), trains two steps and exits 0; the recording shows the configured agents and
data sources; every child stops cleanly."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from launcher.plan import free_port
from rollout_service.recording import read_recording
from tools.make_tiny_data import make_tiny_data

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *cmd], cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def stop(proc: subprocess.Popen, log: Path) -> None:
    children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) in (0, 130), log.read_text()[-3000:]
    _, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, f"left behind by {log.name}: {[p.pid for p in alive]}"


# The agents' configs, data and recordings are under test, not the model: every config runs on
# the scripted engine (a fixed answer, rollout_service/engine/scripted.py). A rollout server process
# generating with vLLM is tests/rollout/test_server_process.py's and tools/test_replay_process.py's.
CONFIGS = ["tiny_statelm", "tiny_code", "tiny_mixed"]


@pytest.mark.parametrize("name", CONFIGS)
def test_agent_config_streams_to_a_learner(tmp_path: Path, tiny_model: Path, name: str) -> None:
    data = make_tiny_data(tmp_path / "data", train=32, val=4, agents=True)
    port = free_port("127.0.0.1")
    common = [
        f"--config={REPO / 'configs' / f'{name}.yaml'}",
        f"actor_rollout_ref.model.path={tiny_model}",
        f"trainer.run_dir={tmp_path / 'run'}",
        f"learner.bind_address=tcp://127.0.0.1:{port}",
        f"rollout_server.learner_address=tcp://127.0.0.1:{port}",
        "trainer.logger=[jsonl]",
        "transport.heartbeat_interval_s=0.5",
        "transport.heartbeat_timeout_s=10",
        "rollout_server.engine=scripted",
    ]
    # The configs name runs/tiny-data/...: point every data path at this test's data.
    text = (REPO / "configs" / f"{name}.yaml").read_text()
    for i, path in enumerate(re.findall(r"path: runs/tiny-data/(\S+)", text)):
        common.append(f"data.datasets.{i}.path=[{data / path}]")
    if "val_files:" in text:
        common.append("data.val_files=[]")
    tool_server = None
    if name == "tiny_mixed":
        tool_port = free_port("127.0.0.1")
        common += [
            f"tools.search.corpus={data / 'qa' / 'corpus.jsonl'}",
            f"tool_server.port={tool_port}",
            f"tools.remote.url=http://127.0.0.1:{tool_port}",
        ]
        tool_server = start(["bin/tool-server", *common], tmp_path / "tool.log")
        deadline = time.monotonic() + 60
        while "tool server listening" not in (tmp_path / "tool.log").read_text():
            assert tool_server.poll() is None and time.monotonic() < deadline, (
                tmp_path / "tool.log"
            ).read_text()
            time.sleep(0.2)
    learner = start(["bin/learner", *common], tmp_path / "learner.log")
    server = start(
        ["bin/rollout-server", *common, "rollout_server.server_id=rs0"], tmp_path / "rollout.log"
    )
    try:
        rc = learner.wait(420)
        assert rc == 0, (tmp_path / "learner.log").read_text()[-4000:] + (
            tmp_path / "rollout.log"
        ).read_text()[-3000:]
    finally:
        for proc, log in (
            (learner, "learner.log"),
            (server, "rollout.log"),
            (tool_server, "tool.log"),
        ):
            if proc is not None:
                stop(proc, tmp_path / log)

    run = tmp_path / "run"
    stats = json.loads((run / "intake_stats.json").read_text())
    assert stats["violations"] == 0 and stats["trajectories"] > 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]

    trajs = [t for _, batch in read_recording(run / "recordings" / "rs0") for t in batch]
    kinds = Counter((t.agent_type, t.data_source) for t in trajs)
    for t in trajs:
        assert (
            len(t.response_ids)
            == len(t.response_mask)
            == len(t.rollout_logprobs)
            == len(t.versions)
        )
        assert (t.rollout_logprobs[t.response_mask == 0] == 0).all()
    expected = {
        "tiny_statelm": {("statelm", "longdoc")},
        "tiny_code": {("code", "code")},
        "tiny_mixed": {("tool_agent", "arithmetic"), ("tool_agent", "qa"), ("code", "code")},
    }[name]
    assert set(kinds) == expected, kinds
    # What the agents did reaches the step metrics (0 is fine for an untrained model), counted on
    # each episode's final trajectory only.
    acting = {
        "tiny_statelm": ["agent/snapshots_per_episode", "agent/deletions_per_episode"],
        "tiny_code": ["agent/sandbox_runs_per_episode", "agent/sandbox_errors_per_episode"],
        "tiny_mixed": ["agent/sandbox_runs_per_episode", "agent/tool_calls_by_source/code"],
    }[name]
    for m in steps:
        for key in ["agent/episodes", "agent/tool_calls_per_episode", *acting]:
            assert isinstance(m.get(key), float) and m[key] >= 0, (key, sorted(m))
    assert all(t.actions == {} for t in trajs if t.is_snapshot)
    assert all("tool_calls" in t.actions for t in trajs if not t.is_snapshot)
    if name == "tiny_mixed":  # 4/3/3 prompts per batch of 10, so about that share of trajectories
        assert kinds[("tool_agent", "arithmetic")] > kinds[("code", "code")] / 2
        assert any(k.startswith("batch/count/qa") for m in steps for k in m), steps[0].keys()
