"""The local Ray cluster the learner starts (`init_ray` without an address) listens on loopback
only: no endpoint of it, the metrics exporters of the dashboard agent, autoscaler and dashboard
head included, answers on another interface; nor do the learner's ranks, whose process group of 2
(gloo) is up while the endpoints are read (`learner.rendezvous`: a file store on one machine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from test_fsdp_workers import settings

OWN_RAY_CLUSTER = True  # tests/conftest.py: runs in the serial pass

pytestmark = pytest.mark.integration

LOOPBACK = ("127.", "::1", "::ffff:127.")


def ray_processes(ray: Any) -> list[psutil.Process]:
    """This test process's descendants (raylet, GCS, agents, workers) and every process that
    names the cluster's session directory (the autoscaler monitor and dashboard head)."""
    session = ray._private.worker._global_node.get_session_dir_path()
    me = psutil.Process()
    found = {p.pid: p for p in me.children(recursive=True)}
    for p in psutil.process_iter(["cmdline"]):
        if any(session in part for part in p.info["cmdline"] or []):
            found[p.pid] = p
    return list(found.values())


def test_every_endpoint_of_the_local_cluster_is_on_loopback(
    ray_cluster: Any, tiny_model: Path
) -> None:
    from learner.workers import WorkerGroup

    group = WorkerGroup(settings(tiny_model), 2)
    try:
        anyio.run(group.start)
        listening = _listening(ray_cluster)
    finally:
        group.shutdown()
    names = {name for _, _, name in listening}
    assert "ray::TrainWorker" in names, f"the ranks were not read: {listening}"
    assert len(listening) >= 3, f"found too few of Ray's endpoints to judge: {listening}"
    exposed = [x for x in listening if not x[0].startswith(LOOPBACK)]
    assert not exposed, f"endpoints on other interfaces: {exposed}"


def _listening(ray_cluster: Any) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening socket of the cluster's processes."""
    listening: list[tuple[str, int, str]] = []
    for p in ray_processes(ray_cluster):
        try:
            name = p.name()
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == "LISTEN"]
    return listening
