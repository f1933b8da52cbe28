"""bin/train with `launch.placement: ray` (launcher/ray_placement.py).

Unit tests without Ray: the config rules, the plan's placed children, and the host's process
handling driven through `stop_all` / `kill_tree` as the supervisor drives it. Then the real thing
(slow): a 2-node cluster simulated on this machine (`ray.cluster_utils.Cluster`, one custom
resource per node so the 2 rollout servers land on different nodes), bin/train for 2 steps with
one server SIGKILLed and restarted on its bundle: every step done, every trajectory trained once,
no process, actor or placement group of the run left.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

OWN_RAY_CLUSTER = True  # tests/conftest.py: runs in the serial pass
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "tools"))

import test_train as train_runs  # noqa: E402  # pyright: ignore[reportMissingImports]  (bin/train's job helpers)

from launcher.children import (  # noqa: E402
    RemoteChild,
    kill_tree,
    live_group_members,
    stop_all,
    sweep,
)
from launcher.ray_placement import ServerHost  # noqa: E402

BASE = ["actor_rollout_ref.model.path=m", "data.train_files=t.jsonl", "trainer.logger=[console]"]


def test_placement_is_local_by_default_and_ray_refuses_fixed_gpus() -> None:
    from common.config import load_config
    from common.config.launch import launch_issues

    cfg = load_config(None, BASE, check_paths=False)
    assert cfg.launch.placement == "local" and not launch_issues(cfg)
    cfg = load_config(
        None,
        [*BASE, "launch.placement=ray", "launch.rollout_gpus=[[0]]", "launch.learner_gpus=[1]"],
        check_paths=False,
    )
    keys = {i.key for i in launch_issues(cfg)}
    assert {"launch.rollout_gpus", "launch.learner_gpus"} <= keys
    cfg = load_config(
        None,
        [*BASE, "launch.placement=ray", "launch.ray_server_resources={rollout_host: 1}"],
        check_paths=False,
    )
    assert cfg.launch.ray_server_resources == {"rollout_host": 1.0} and not launch_issues(cfg)


def test_plan_places_the_rollout_servers_only(tmp_path: Path) -> None:
    from common.config import load_config
    from launcher.children import LAUNCH_ID_ENV
    from launcher.plan import plan_run
    from launcher.ray_placement import RayChild

    (tmp_path / "t.jsonl").write_text("")
    over = [
        f"actor_rollout_ref.model.path={tmp_path}",
        f"data.train_files={tmp_path / 't.jsonl'}",
        "trainer.logger=[console]",
        f"trainer.run_dir={tmp_path / 'run'}",
        "launch.placement=ray",
    ]
    cfg = load_config(None, over, check_paths=False)
    plan = plan_run(None, over, cfg, None)
    assert plan.fleet is not None and plan.fleet.children == plan.rollouts
    assert all(isinstance(c, RayChild) for c in plan.rollouts)
    assert not isinstance(plan.learner, RayChild)
    rs1 = plan.rollouts[1]
    assert "rollout_server.server_id=rs1" in rs1.argv and "rollout_server.shard_count=2" in rs1.argv
    assert rs1.log == tmp_path / "run" / "logs" / "rollout-1.log"
    # Only the run's own variables travel: the node's environment (PATH, Ray's GPUs) is kept.
    assert rs1.env[LAUNCH_ID_ENV] == plan.launch_id and "PATH" not in rs1.env
    local = plan_run(None, over[:-1], load_config(None, over[:-1], check_paths=False), None)
    assert local.fleet is None and not any(isinstance(c, RemoteChild) for c in local.rollouts)


@dataclass
class HostedChild(RemoteChild):
    """A RemoteChild whose host is a ServerHost in this process (what the actor runs, sans Ray)."""

    host: ServerHost = field(default_factory=ServerHost)

    def start(self, note: str) -> None:
        self.pids.append(self.host.start(self.argv, self.env, str(self.log), note))

    @property
    def pid(self) -> int | None:
        return self.pids[-1] if self.pids else None

    def returncode(self) -> int | None:
        return self.host.poll()

    def terminate(self) -> None:
        self.host.terminate()

    def kill_group(self, timeout: float = 10.0) -> list[int]:
        return self.host.kill_group(timeout)


def hosted(tmp: Path, name: str, code: str) -> HostedChild:
    argv = [sys.executable, "-c", code]
    return HostedChild(name, name, argv, tmp / f"{name}.log", {"AGENTRL_TEST": "1"})


@pytest.mark.e2e
def test_stop_all_and_kill_tree_reach_remote_children(tmp_path: Path) -> None:
    # A grandchild in the group that ignores SIGTERM: only the group kill ends it.
    stubborn = (
        "import signal, subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)']); "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(300)"
    )
    polite = "import time; print('up', flush=True); time.sleep(300)"
    a, b = hosted(tmp_path, "a", stubborn), hosted(tmp_path, "b", polite)
    for c in (a, b):
        c.start("start")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
        "up" in c.log.read_text() and len(live_group_members([c.pid])[c.pid]) >= 1  # type: ignore[index, list-item]
        for c in (a, b)
    ):
        time.sleep(0.1)
    while len(live_group_members([a.pid])[a.pid]) < 2 and time.monotonic() < deadline:  # type: ignore[index, list-item]
        time.sleep(0.1)
    assert "bin/train: start" in a.log.read_text() and a.returncode() is None
    start = time.monotonic()
    killed = stop_all([a, b], grace=1.0)
    assert time.monotonic() - start < 15
    assert b.returncode() == -signal.SIGTERM and "b" not in killed  # it obeyed SIGTERM
    assert a.returncode() == -signal.SIGKILL and len(killed["a"]) == 2  # leader + grandchild
    assert not live_group_members([a.pids[-1]])[a.pids[-1]]
    # kill_tree (the restart path) kills the whole group at once.
    c = hosted(tmp_path, "c", stubborn)
    c.start("start")
    while c.pid is not None and len(live_group_members([c.pid])[c.pid]) < 2:
        time.sleep(0.1)
    kill_tree(c)
    assert c.returncode() == -signal.SIGKILL and not live_group_members([c.pids[-1]])[c.pids[-1]]


# ---------------------------------------------------------------- a simulated 2-node cluster


@pytest.mark.e2e
@pytest.mark.timeout(480)
@pytest.mark.usefixtures("own_ray_cluster")
def test_two_node_cluster_restarts_a_killed_server(tmp_path: Path, assets) -> None:  # type: ignore[no-untyped-def]
    import ray
    from ray.cluster_utils import Cluster

    from learner import trained_log

    node = {"num_cpus": 2, "resources": {"rollout_host": 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    jobs: list[Any] = []
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        args = [
            *train_runs.overrides(tmp_path, servers=2, steps=2),
            "launch.placement=ray",
            f"ray.address={json.dumps(cluster.address)}",
            "launch.ray_server_resources={rollout_host: 1}",
            "launch.ray_strategy=STRICT_SPREAD",
            "launch.max_restarts=1",
            train_runs.SCRIPTED,
        ]
        j = train_runs.Job(tmp_path, train_runs.job_config(tmp_path, assets), args)
        jobs.append(j)
        # Killed as soon as it runs, not once it has connected: rs0 alone can train both steps
        # before a slow rs1 connects, and the run would end before the kill (CI, stop 32). The
        # learner is not ready for tens of seconds after this, so the restart always happens
        # inside the run; a kill after the first step is test_train's.
        j.wait_for(lambda: "rollout server rs1 started" in j.output(), 300, "rs1 to start")
        children = j.processes()["children"]
        nodes = {children[f"rollout-{i}"]["node"] for i in (0, 1)}  # type: ignore[index]
        assert len(nodes) == 2, nodes  # one server per node
        where = children["rollout-1"]["node"]  # type: ignore[index]
        os.kill(children["rollout-1"]["pid"], signal.SIGKILL)  # type: ignore[index]
        code = j.wait_exit(300)
        out = j.output()
        assert code == 0, out[-5000:]
        assert j.steps() == [1, 2]
        assert "rollout server rs1 died" in out and "restarting (1/1)" in out
        children = j.processes()["children"]
        assert children["rollout-1"]["restarts"] == 1 and len(children["rollout-1"]["pids"]) == 2  # type: ignore[index]
        assert children["rollout-1"]["node"] == where  # restarted in its own bundle  # type: ignore[index]
        log = (j.run / "logs" / "rollout-1.log").read_text()
        assert log.count("(Ray) -----") == 2 and "restart 1 after killed by SIGKILL" in log
        ids = [
            t
            for step in trained_log.read(j.run / "trained.jsonl").trajectory_ids().values()
            for t in step
        ]
        assert len(ids) == 2 * 2 * 2 and len(set(ids)) == len(ids)  # steps x groups x n, once each
        j.assert_nothing_left()
        ray.init(address=cluster.address, log_to_driver=False)
        deadline = time.monotonic() + 30  # the actors and the placement group are gone
        while ray.available_resources() != ray.cluster_resources() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray.available_resources() == ray.cluster_resources()
    finally:
        for job in jobs:
            job.kill()
            for pid in job.seen:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if (job.run / "processes.json").exists():  # placed servers are no descendants of it
                sweep(job.processes()["launch_id"])
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tools.make_tiny_data import make_tiny_data
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("assets")
    return make_tiny_model(root / "model"), make_tiny_data(root / "data", train=64, val=8)


@pytest.mark.e2e
def test_without_an_address_the_learner_joins_bin_trains_cluster(tmp_path: Path, assets) -> None:  # type: ignore[no-untyped-def]
    """No ray.address, no RAY_ADDRESS: bin/train starts a local cluster, places the server on it,
    and the learner joins it (Ray's token authentication included); all of it gone at the end."""
    env_address = os.environ.pop("RAY_ADDRESS", None)
    args = [
        *train_runs.overrides(tmp_path, servers=1, steps=1),
        "launch.placement=ray",
        "ray.num_cpus=3",
        train_runs.SCRIPTED,
    ]
    j = train_runs.Job(tmp_path, train_runs.job_config(tmp_path, assets), args)
    try:
        code = j.wait_exit(300)
        out = j.output()
        assert code == 0, out[-5000:]
        assert j.steps() == [1] and "rollout server rs0 placed" in out
        # the cluster bin/train started (the learner failing to join it fails the run)
        assert "local (" in out
        j.assert_nothing_left()
    finally:
        j.kill()
        if env_address is not None:
            os.environ["RAY_ADDRESS"] = env_address


@pytest.mark.e2e
def test_a_fleet_the_cluster_cannot_hold_fails_at_once(tmp_path: Path, assets) -> None:  # type: ignore[no-untyped-def]
    """No address anywhere: bin/train starts a local cluster; a bundle no node has fails the run
    after launch.connect_timeout_s, saying what it asked and what the cluster has."""
    env_address = os.environ.pop("RAY_ADDRESS", None)
    args = [
        *train_runs.overrides(tmp_path, servers=2, steps=2),
        "launch.placement=ray",
        "launch.ray_server_resources={no_such_node: 1}",
        "launch.connect_timeout_s=3",
        "ray.num_cpus=2",
    ]
    j = train_runs.Job(tmp_path, train_runs.job_config(tmp_path, assets), args)
    try:
        code = j.wait_exit(120)
        out = j.output()
        assert code == 1, out[-5000:]
        assert "could not place 2 rollout servers" in out and "no_such_node" in out
        assert "learner started" not in out  # nothing starts before the fleet is placed
        j.assert_nothing_left()
    finally:
        j.kill()
        if env_address is not None:
            os.environ["RAY_ADDRESS"] = env_address
