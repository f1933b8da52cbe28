"""tools/slurm/agentrl.sbatch with stand-ins for srun, scontrol, hostname and ray first on PATH,
and for bin/doctor and bin/train in a stand-in checkout (AGENTRL_HOME): each logs its argv. Checks
the Ray head and worker commands, the wait on bin/doctor, the training command line, and that Ray
is stopped on every node however the job ends (success, a failed start, a failed run, SIGTERM)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "slurm" / "agentrl.sbatch"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"),
]

STANDINS = {
    # srun drops its own options (the script passes them all as --name=value) and runs the task.
    "srun": 'echo "srun $*" >> "$STANDIN_LOG"\n'
    'while [[ $# -gt 0 && $1 == --* ]]; do shift; done\nexec "$@"\n',
    "scontrol": 'echo "scontrol $*" >> "$STANDIN_LOG"\nprintf "%s\\n" $FAKE_NODES\n',
    "hostname": 'echo "${FAKE_IP:-10.0.0.1} fe80::1"\n',
    # `ray start --block` stays up until it is killed, as the real one does.
    "ray": 'if [[ $1 == get-auth-token ]]; then echo "ray $*" >> "$STANDIN_LOG"; echo tok123; exit; fi\n'
    'echo "ray $* pid=$$ auth=${RAY_AUTH_MODE:-}:${RAY_AUTH_TOKEN:-}" >> "$STANDIN_LOG"\n'
    'if [[ " $* " == *" --block "* ]]; then exec sleep 120; fi\n',
}
CHECKOUT = {
    # Like the real one with --ray-nodes: returns once every node's raylet is up.
    "doctor": 'echo "doctor $*" >> "$STANDIN_LOG"\nnodes=($FAKE_NODES)\n'
    "for _ in $(seq 400); do\n"
    '  (($(grep -c "^ray start" "$STANDIN_LOG") >= ${#nodes[@]})) && break; sleep 0.05\n'
    'done\nexit "${DOCTOR_RC:-0}"\n',
    "train": 'echo "train $*" >> "$STANDIN_LOG"\n'
    'echo "train env ${RAY_ADDRESS:-} ${RAY_AUTH_MODE:-}:${RAY_AUTH_TOKEN:-}" >> "$STANDIN_LOG"\n'
    '[[ -n ${TRAIN_SLEEP:-} ]] && sleep "$TRAIN_SLEEP"\nexit "${TRAIN_RC:-0}"\n',
}


def _write(folder: Path, scripts: dict[str, str]) -> None:
    folder.mkdir(parents=True)
    for name, body in scripts.items():
        path = folder / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    _write(tmp_path / "fakebin", STANDINS)
    _write(tmp_path / "home" / "bin", CHECKOUT)
    return {
        "PATH": f"{tmp_path / 'fakebin'}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "STANDIN_LOG": str(tmp_path / "log"),
        "AGENTRL_HOME": str(tmp_path / "home"),
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_GPUS_ON_NODE": "8",
        "FAKE_NODES": "node1 node2 node3",
        **extra,
    }


def _run(tmp_path: Path, **extra: str) -> tuple[int, list[str]]:
    result = subprocess.run(
        ["bash", str(SCRIPT), "configs/multinode.yaml", "trainer.total_training_steps=2"],
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.returncode, (tmp_path / "log").read_text().splitlines()


def _block_pids(log: list[str]) -> list[int]:
    return [int(line.split("pid=")[1].split()[0]) for line in log if line.startswith("ray start ")]


def _assert_stopped(log: list[str]) -> None:
    """`ray stop` ran once on every node, after everything else, and the --block steps are gone."""
    assert log[-2:] == [
        "srun --overlap --nodes=3 --ntasks=3 --ntasks-per-node=1 ray stop --force",
        f"ray stop --force pid={log[-1].split('pid=')[1]}",
    ]
    for pid in _block_pids(log):
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"ray start --block (pid {pid}) outlived the job"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_starts_ray_waits_trains_and_stops(tmp_path: Path) -> None:
    status, log = _run(tmp_path)
    assert status == 0, log
    assert log[0] == "scontrol show hostnames node[1-3]"
    assert log[1] == "srun --overlap --nodes=1 --ntasks=1 --nodelist=node1 hostname --ip-address"
    srun_starts = sorted(line for line in log if line.startswith("srun") and " start " in line)
    assert srun_starts == [
        "srun --overlap --nodes=1 --ntasks=1 --nodelist=node1 ray start --head --block "
        "--node-ip-address=10.0.0.1 --port=6379 --num-gpus=8",
        "srun --overlap --nodes=1 --ntasks=1 --nodelist=node2 ray start --block "
        "--address=10.0.0.1:6379 --num-gpus=8",
        "srun --overlap --nodes=1 --ntasks=1 --nodelist=node3 ray start --block "
        "--address=10.0.0.1:6379 --num-gpus=8",
    ]
    assert len(_block_pids(log)) == 3
    doctor = log.index("doctor --only ray --ray-address 10.0.0.1:6379 --ray-nodes 3 --ray-wait 300")
    train = log.index(
        "train --config configs/multinode.yaml launch.placement=ray ray.address=10.0.0.1:6379 "
        "learner.bind_address=tcp://0.0.0.0:5555 rollout_server.learner_address=tcp://10.0.0.1:5555 "
        "trainer.total_training_steps=2"
    )
    assert doctor < train
    # One Ray token for every process: the head, the workers, the learner (bin/train) and `stop`.
    assert log.count("ray get-auth-token --generate") == 1
    assert all(
        line.endswith("auth=token:tok123")
        for line in log
        if line.startswith(("ray start", "ray stop"))
    )
    assert "train env 10.0.0.1:6379 token:tok123" in log
    _assert_stopped(log)


def test_ray_auth_mode_of_the_user_is_kept(tmp_path: Path) -> None:
    status, log = _run(tmp_path, RAY_AUTH_MODE="disabled")
    assert status == 0, log
    assert "ray get-auth-token --generate" not in log
    assert "train env 10.0.0.1:6379 disabled:" in log
    _assert_stopped(log)


def test_a_failed_run_still_stops_ray(tmp_path: Path) -> None:
    status, log = _run(tmp_path, TRAIN_RC="3")
    assert status == 3
    assert any(line.startswith("train ") for line in log)
    _assert_stopped(log)


def test_nodes_that_never_join_stop_before_training(tmp_path: Path) -> None:
    status, log = _run(tmp_path, DOCTOR_RC="1", RAY_JOIN_TIMEOUT_S="5")
    assert status == 1
    assert any("--ray-wait 5" in line for line in log)
    assert not any(line.startswith("train ") for line in log)
    _assert_stopped(log)


def test_sigterm_stops_ray(tmp_path: Path) -> None:
    """scancel or the time limit: SLURM sends SIGTERM to every process of the batch step."""
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "configs/multinode.yaml"],
        env=_env(tmp_path, TRAIN_SLEEP="60"),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log_file = tmp_path / "log"
    deadline = time.monotonic() + 30
    while not (log_file.exists() and "train " in log_file.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "train never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    _assert_stopped(log_file.read_text().splitlines())


def test_usage_without_config(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT)], env=_env(tmp_path), capture_output=True, text=True, timeout=30
    )
    assert result.returncode != 0 and "usage: sbatch tools/slurm/agentrl.sbatch" in result.stderr


def test_head_ip_on_loopback_is_refused_before_anything_starts(tmp_path: Path) -> None:
    status, log = _run(tmp_path, FAKE_IP="127.0.1.1")
    assert status == 2
    assert not any(line.startswith(("ray ", "train ")) for line in log)
    status, log = _run(tmp_path / "given", HEAD_IP="10.9.9.9")  # the interface the user names
    assert status == 0 and not any("--ip-address" in line for line in log)
    assert any("--address=10.9.9.9:6379" in line for line in log)
