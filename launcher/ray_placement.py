"""`launch.placement: ray`: bin/train's rollout servers placed on a Ray cluster's nodes.

Design: one placement group holds a bundle per rollout server (`launch.ray_server_cpus`, GPUs,
custom resources; `launch.ray_strategy`, SPREAD by default), and in each bundle a small actor,
`ServerHost`, starts the server as a process of its own session on that node, with the same
command line, log file (RUN_DIR/logs, so RUN_DIR must be shared) and event channel as a local one.
The server still talks to the learner over ZeroMQ; Ray only places, signals and kills. Seen from
the supervisor a placed server is a `RayChild` (`launcher.children.RemoteChild`): the restart
policy (`launch.max_restarts`), `stop_all` and `kill_tree` are the local ones, their signals going
through the host. The actor holds the bundle's resources, so Ray sets the server's
CUDA_VISIBLE_DEVICES. `RayFleet.close` kills the actors and removes the group after `stop_all`
stopped the servers: an actor's death alone would leave its server running (it leads its own
session), so the servers are always stopped first.

The cluster is `ray.address`, else ``RAY_ADDRESS``, else a local one bin/train starts; unless
`ray.address` names it, the learner is pointed at it with ``ray.address``, so the job uses one
cluster.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.multicast import multicast_env
from common.ray_auth import join, start_local
from launcher.children import RemoteChild, live_group_members

if TYPE_CHECKING:
    from common.config import Config

ROOT = Path(__file__).resolve().parent.parent
CALL_TIMEOUT_S = 60.0
"""Bound on one call to a host actor (a start, a poll); a poll that times out counts as running."""


class PlacementError(RuntimeError):
    """The cluster cannot place the fleet (the message says what it asked and what there is)."""


# ---------------------------------------------------------------- on the node


class ServerHost:
    """Ray actor on a rollout server's node: starts the server as the leader of a new session
    (its vLLM engine shares the group), reports its exit, signals it and kills its group."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def node(self) -> tuple[str, str, str]:
        """(host name, IP, Ray node id) of where it runs."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return socket.gethostname(), ray.util.get_node_ip_address(), node_id

    def start(self, argv: list[str], env: dict[str, str], log: str, note: str) -> int:
        path = Path(log)
        path.parent.mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        with path.open("ab") as out:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write(f"----- bin/train: {note} at {stamp} on {host} (Ray) -----\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},  # the node's environment (Ray's GPUs) plus the run's
                start_new_session=True,
            )
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill_group(self, timeout: float) -> list[int]:
        if self.proc is None:
            return []
        pgid = self.proc.pid  # a session leader's group id is its pid
        members = live_group_members([pgid])[pgid]
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + timeout
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        while live_group_members([pgid])[pgid] and time.monotonic() < deadline:
            time.sleep(0.1)
        return members


# ---------------------------------------------------------------- in bin/train


@dataclass
class RayChild(RemoteChild):
    """A rollout server placed by `RayFleet` in bundle `index`; restarts reuse the bundle."""

    fleet: RayFleet | None = None
    index: int = 0
    _pid: int | None = field(default=None, init=False)
    _code: int | None = field(default=None, init=False)
    """Its exit status once seen (a dead process stays dead; polls stop)."""

    @property
    def _fleet(self) -> RayFleet:
        assert self.fleet is not None, "a RayChild is started by its fleet"
        return self.fleet

    def start(self, note: str) -> None:
        fleet = self._fleet
        host = fleet.host(self.index)
        pid = fleet.call(host.start.remote(self.argv, self.env, str(self.log), note))
        self._pid, self._code = int(pid), None
        self.pids.append(self._pid)

    @property
    def pid(self) -> int | None:
        return self._pid

    def returncode(self) -> int | None:
        if self._pid is None or self._code is not None:
            return self._code
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            code = self._fleet.call(self._fleet.host(self.index).poll.remote())
        except GetTimeoutError:
            return None  # a slow node is not a dead server
        except RayActorError:  # the actor (or its node) died, and the server with it
            self._fleet.forget(self.index)
            code = -signal.SIGKILL
        if code is not None:
            self._code = int(code)
        return self._code

    def terminate(self) -> None:
        if self.returncode() is None:
            self._fleet.try_call(lambda h: h.terminate.remote(), self.index)

    def kill_group(self, timeout: float = 10.0) -> list[int]:
        if self._pid is None:
            return []
        killed = self._fleet.try_call(
            lambda h: h.kill_group.remote(timeout), self.index, CALL_TIMEOUT_S + timeout
        )
        self.returncode()
        return list(killed or [])


@dataclass
class RayFleet:
    """The placement group and host actors of one launch's rollout servers."""

    config: Config
    launch_id: str
    children: list[RayChild] = field(default_factory=list)
    hosts: dict[int, Any] = field(default_factory=dict)
    group: Any = None
    connected: bool = False
    elsewhere: list[RayChild] = field(default_factory=list)
    """The servers placed on another node than bin/train's (they need a reachable learner)."""

    def open(self, log: Any, interrupted: Callable[[], bool]) -> str | None:
        """Connect to the cluster, place the fleet and its hosts. Returns the address the learner
        must be given (ray.address) when the config names none, else None."""
        import ray
        from ray.util.placement_group import placement_group

        launch = self.config.launch
        address = self.config.ray.address or os.environ.get("RAY_ADDRESS") or None
        paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
        runtime_env = {
            "env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p), **multicast_env()}
        }
        if address:
            join(address, runtime_env=runtime_env, log_to_driver=False)  # `ray start`'s token too
        else:  # "local": a cluster of our own, never one a `ray start` left on the machine
            start_local(
                num_cpus=self.config.ray.num_cpus,
                include_dashboard=False,
                runtime_env=runtime_env,
                log_to_driver=False,
            )
        self.connected = True
        # The learner reads ray.address only: pointed at the cluster found here unless configured.
        used = address or ray.get_runtime_context().gcs_address
        learner_joins = None if self.config.ray.address else used
        total = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        gpus = launch.ray_server_gpus
        if gpus is None:
            tp = self.config.actor_rollout_ref.rollout.tensor_model_parallel_size
            gpus = float(tp) if total.get("GPU", 0) > 0 else 0.0
        bundle = {"CPU": launch.ray_server_cpus, "GPU": gpus, **launch.ray_server_resources}
        bundle = {k: v for k, v in bundle.items() if v > 0}
        if not bundle:
            raise PlacementError(
                "a rollout server's Ray bundle is empty: set launch.ray_server_cpus, "
                "launch.ray_server_gpus or launch.ray_server_resources"
            )
        n = len(self.children)
        log.info(
            "placing rollout servers on the Ray cluster",
            address=address or f"local ({learner_joins})",
            nodes=len(nodes),
            bundle=bundle,
            strategy=launch.ray_strategy,
        )
        self.group = placement_group(
            [dict(bundle) for _ in range(n)],
            strategy=launch.ray_strategy,
            name=f"agentrl-rollout-{self.launch_id[:12]}",
        )
        ready, deadline = self.group.ready(), time.monotonic() + launch.connect_timeout_s
        while not ray.wait([ready], timeout=1.0)[0]:  # in steps: a Ctrl-C is not held up
            if interrupted():
                raise PlacementError("interrupted while placing the rollout servers")
            if time.monotonic() > deadline:
                raise PlacementError(
                    f"the Ray cluster could not place {n} rollout servers of {bundle} each "
                    f"({launch.ray_strategy}) within {launch.connect_timeout_s:g} s "
                    f"(launch.connect_timeout_s); the cluster has {dict(total)} on {len(nodes)} "
                    "node(s): change launch.ray_server_cpus / ray_server_gpus / ray_server_resources "
                    "/ ray_strategy or add nodes"
                )
        here = ray.util.get_node_ip_address()
        for child in self.children:
            hostname, ip, node_id = self.call(self.host(child.index).node.remote())
            child.node = f"{hostname} ({ip}, Ray node {node_id[:12]})"
            log.info(f"{child.title} placed", node=child.node)
            if ip != here:
                self.elsewhere.append(child)
        return learner_joins

    def host(self, index: int) -> Any:
        """Bundle `index`'s host actor, created on first use (again after it died)."""
        if index not in self.hosts:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = self.group.bundle_specs[index]
            opts: dict[str, Any] = {
                "num_cpus": bundle.get("CPU", 0),
                "num_gpus": bundle.get("GPU", 0),
                "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=index
                ),
                "max_restarts": 0,
            }
            self.hosts[index] = ray.remote(ServerHost).options(**opts).remote()
        return self.hosts[index]

    def forget(self, index: int) -> None:
        self.hosts.pop(index, None)

    def call(self, ref: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        import ray

        return ray.get(ref, timeout=timeout)

    def try_call(self, method: Any, index: int, timeout: float = CALL_TIMEOUT_S) -> Any:
        """`method(host)` on a live host, None when the host is gone (stopping goes on)."""
        from ray.exceptions import GetTimeoutError, RayActorError

        if index not in self.hosts:
            return None
        try:
            return self.call(method(self.hosts[index]), timeout)
        except (RayActorError, GetTimeoutError):
            return None

    def close(self, log: Any) -> None:
        """Kill the host actors, remove the placement group, disconnect (after `stop_all`)."""
        if not self.connected:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        for handle in self.hosts.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception as e:  # best effort: the job's end kills them too
                log.warning("could not kill a rollout host actor", error=f"{type(e).__name__}: {e}")
        self.hosts.clear()
        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception as e:
                log.warning(
                    "could not remove the placement group", error=f"{type(e).__name__}: {e}"
                )
        ray.shutdown()
        self.connected = False
