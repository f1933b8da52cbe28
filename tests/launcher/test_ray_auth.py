"""Joining a cluster the way users start one (`ray start --head`, token authentication on by
default) works without RAY_AUTH_MODE in the environment (common.ray_auth)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # a real `ray start` cluster
OWN_RAY_CLUSTER = True  # tests/conftest.py: runs in the serial pass

REPO = Path(__file__).resolve().parents[2]
JOIN = (
    "import sys; sys.path.insert(0, sys.argv[1]); from learner.workers import init_ray; "
    "init_ray(sys.argv[2], None, log_to_driver=False); import ray; "
    "print('CPU', ray.cluster_resources().get('CPU'))"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.usefixtures("own_ray_cluster")
def test_the_learner_joins_a_cluster_from_ray_start() -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_", "RAY_ADDRESS"))}
    ray_bin = Path(sys.executable).parent / "ray"
    start = ["start", "--head", "--block", f"--port={port}", "--num-cpus=1"]
    head = subprocess.Popen(
        [str(ray_bin), *start, "--include-dashboard=false"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline, out = time.monotonic() + 120, None
        while time.monotonic() < deadline:  # until the head answers
            out = subprocess.run(
                [sys.executable, "-c", JOIN, str(REPO), f"127.0.0.1:{port}"],
                env=env,
                capture_output=True,
                text=True,
                timeout=90,
            )
            if out.returncode == 0 or "InvalidAuthToken" in out.stderr:
                break
            time.sleep(2)
        assert out is not None and out.returncode == 0, out.stderr[-3000:] if out else "no try"
        assert "CPU 1.0" in out.stdout
    finally:
        head.send_signal(signal.SIGTERM)  # --block: stops what it started
        try:
            head.wait(60)
        finally:
            if head.poll() is None:
                os.killpg(head.pid, signal.SIGKILL)
