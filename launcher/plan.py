"""bin/train's plan: from one config, the run directory and the children it will run.

Design: bin/train validates the config, then plans the learner, `launch.rollout_servers` rollout
servers (shard i of N, server id rs<i>, its own vLLM memory share with
`launch.rollout_gpu_memory_utilization`) and optionally a tool server as separate processes, each
from the same config file and overrides plus a few of its own (the run directory, the shard), so
every process could also be started by hand with the same command line. Ports are bound once: with
`launch.auto_port` a loopback learner (and tool server) binds port 0 and reports the port it got on
the run's event channel (``RUN_DIR/events.jsonl``, `common.run_events`); the supervisor then starts
the rollout servers with that address (`rollout_overrides`). Nothing here starts a process; this
module imports nothing of the supervisor (``launcher/supervisor.py`` imports it).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import ConfigError, load_config
from common.config.launch import launch_issues, rollout_gpus_of, rollout_memory_of
from common.config.loader import override_label, parse_override
from common.epochs import total_steps
from common.peer_auth import TOOL_TOKEN_FILE_NAME
from common.run_events import EVENTS_FILE
from common.rundir import resolve_run_dir
from launcher.children import Child, child_env, cpu_share, python_argv
from launcher.ray_placement import RayChild, RayFleet

if TYPE_CHECKING:  # imported lazily (bin/train --help stays instant)
    from common.config import Config
    from common.config.launch import LaunchConfig
    from launcher.children import Child
    from launcher.ray_placement import RayFleet

ROOT = Path(__file__).resolve().parent.parent
PROCESSES_FILE = "processes.json"
"""RUN_DIR/processes.json: the launch id and every child's pids and log (rewritten on each start)."""
POLL_S = 0.5
TAIL_LINES = 20


@dataclass
class Plan:
    """What one launch runs: the validated config, the run directory and the children."""

    config: Config
    run_dir: Path
    total_steps: int
    launch_id: str
    learner: Child
    rollouts: list[Child]
    tool_server: Child | None = None
    tool_health_url: str | None = None
    """Where the tool server answers GET /health; None until it reports its port (auto port)."""
    overrides: list[str] = field(default_factory=list)
    """The overrides bin/train added for every child."""
    learner_auto_port: bool = False
    """The learner binds port 0: the rollout servers wait for the address it reports."""
    tool_auto_port: bool = False
    """The tool server binds port 0: the rollout servers wait for the URL it reports."""
    tool_remote: bool = False
    """Whether the rollout servers' tools.remote.url is pointed at our tool server."""
    fleet: RayFleet | None = None
    """launch.placement: ray: the rollout servers' placement (they are its `RayChild`ren)."""

    @property
    def children(self) -> list[Child]:
        return [c for c in (self.tool_server, self.learner, *self.rollouts) if c is not None]

    @property
    def events_file(self) -> Path:

        return self.run_dir / EVENTS_FILE


# ---------------------------------------------------------------- planning


def _split_endpoint(address: str) -> tuple[str, str, str]:
    """ "tcp://host:port" -> ("tcp", host, port); host keeps IPv6 brackets."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host, port


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str) -> int:
    """A TCP port free on `host` now, released at once. For tests that must name a port before
    anything binds it; bin/train itself never picks ports (its children bind port 0)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _yaml(value: Any) -> str:
    return json.dumps(value)  # JSON is YAML: quoted strings and lists survive the override parser


def tool_url(host: str, port: int) -> str:
    """The URL at which a tool server bound to host:port answers on this machine."""
    local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    local = f"[{local}]" if ":" in local else local
    return f"http://{local}:{port}"


@dataclass
class LaunchOverrides:
    """What `launch_overrides` decides: the overrides every child gets, and which ports are bound
    at 0 (their real value arrives on the event channel)."""

    overrides: list[str]
    learner_auto_port: bool = False
    tool_auto_port: bool = False
    tool_health_url: str | None = None
    """The tool server's URL when its port is fixed (known up front)."""
    tool_remote: bool = False


def launch_overrides(config: Config, run_dir: Path) -> LaunchOverrides:
    """The overrides every child gets, and which ports bin/train leaves to the children to bind."""
    from urllib.parse import urlsplit

    launch = config.launch
    # trainer.run_dir is a format string
    escaped = str(run_dir).replace("{", "{{").replace("}", "}}")
    out = LaunchOverrides([f"trainer.run_dir={_yaml(escaped)}"])
    if "jsonl" not in config.trainer.logger:  # bin/train follows the run through metrics.jsonl
        out.overrides.append(f"trainer.logger={_yaml([*config.trainer.logger, 'jsonl'])}")
    scheme, host, _ = _split_endpoint(config.learner.bind_address)
    if launch.auto_port and scheme == "tcp" and is_loopback(host):
        # Port 0: the learner binds a free port itself and reports it (never pick, then bind).
        out.overrides.append(f"learner.bind_address={_yaml(f'tcp://{host}:0')}")
        out.learner_auto_port = True
    if launch.tool_server:
        ts = config.tool_server
        if ts.port == 0 or (launch.auto_port and is_loopback(ts.host)):
            out.overrides.append("tool_server.port=0")
            out.tool_auto_port = True
        else:
            out.tool_health_url = tool_url(ts.host, ts.port)
        remote = config.tools.remote.url
        out.tool_remote = remote is None or is_loopback(urlsplit(remote).hostname or "")
        if out.tool_remote and out.tool_health_url is not None:
            out.overrides.append(f"tools.remote.url={_yaml(out.tool_health_url)}")
        if out.tool_remote and ts.token is None and ts.token_file is None:
            # Authenticated both ways by default: the tool server creates the file, the rollout
            # servers (started once it listens) read it, and no secret goes on a command line.
            secret = run_dir / TOOL_TOKEN_FILE_NAME
            out.overrides.append(f"tool_server.token_file={_yaml(str(secret))}")
    return out


def rollout_overrides(
    plan: Plan, learner_address: str | None, tool_health_url: str | None
) -> list[str]:
    """What the rollout servers get once the ports bound at 0 are known."""
    out = []
    if plan.learner_auto_port and learner_address is not None:
        out.append(f"rollout_server.learner_address={_yaml(learner_address)}")
    if plan.tool_auto_port and plan.tool_remote and tool_health_url is not None:
        out.append(f"tools.remote.url={_yaml(tool_health_url)}")
    return out


def rollout_args(launch: LaunchConfig, index: int) -> list[str]:
    """What rollout server `index` gets on top of every child's arguments: its shard, its id and,
    with launch.rollout_gpu_memory_utilization, its own share of its GPUs' memory for vLLM."""

    n = launch.rollout_servers
    out = [
        f"rollout_server.shard_index={index}",
        f"rollout_server.shard_count={n}",
        f"rollout_server.server_id=rs{index}",
    ]
    if (fraction := rollout_memory_of(launch, index)) is not None:
        out.append(f"actor_rollout_ref.rollout.gpu_memory_utilization={fraction}")
    return out


def plan_run(
    config_file: str | None, user_overrides: Sequence[str], config: Config, log_format: str | None
) -> Plan:

    run_dir = resolve_run_dir(config).resolve()
    decided = launch_overrides(config, run_dir)
    extra = decided.overrides
    final = load_config(config_file, [*user_overrides, *extra], check_paths=True)
    base = ["--config", config_file] if config_file is not None else []
    if log_format is not None:  # options before the overrides: each child appends its own after
        base += ["--log-format", log_format]
    base += [*user_overrides, *extra]
    launch_id = uuid.uuid4().hex
    logs = run_dir / "logs"

    events = run_dir / EVENTS_FILE

    def child(
        name: str,
        title: str,
        script: str,
        *args: str,
        gpus: list[int] | None = None,
        cpus: list[int] | None = None,
        nice: int = 0,
    ) -> Child:
        return Child(
            name,
            title,
            python_argv(ROOT / "bin" / script, [*base, *args]),
            logs / f"{name}.log",
            child_env(launch_id, gpus, events_file=events, cpus=cpus),
            nice=nice,
        )

    n = final.launch.rollout_servers
    fleet = None
    shards = [rollout_args(final.launch, i) for i in range(n)]
    if final.launch.placement == "ray":
        fleet = RayFleet(final, launch_id)
        fleet.children = [
            RayChild(
                f"rollout-{i}",
                f"rollout server rs{i}",
                python_argv(ROOT / "bin" / "rollout-server", [*base, *shards[i]]),
                logs / f"rollout-{i}.log",
                # Only the run's own variables: the node's environment is the host actor's.
                child_env(launch_id, None, {}, events_file=events),
                fleet=fleet,
                index=i,
            )
            for i in range(n)
        ]
    rollouts: list[Child] = (
        list(fleet.children)
        if fleet is not None
        else [
            child(
                f"rollout-{i}",
                f"rollout server rs{i}",
                "rollout-server",
                *shards[i],
                gpus=rollout_gpus_of(final.launch, i),
                cpus=cpu_share(i, n),
                # CPU run: the learner's step is the critical path (children.yield_cpu)
                nice=final.launch.rollout_cpu_nice if final.trainer.device == "cpu" else 0,
            )
            for i in range(n)
        ]
    )
    return Plan(
        config=final,
        run_dir=run_dir,
        total_steps=total_steps(final),
        launch_id=launch_id,
        learner=child("learner", "learner", "learner", gpus=final.launch.learner_gpus),
        rollouts=rollouts,
        tool_server=child("tool-server", "tool server", "tool-server")
        if final.launch.tool_server
        else None,
        tool_health_url=decided.tool_health_url,
        overrides=extra,
        learner_auto_port=decided.learner_auto_port,
        tool_auto_port=decided.tool_auto_port,
        tool_remote=decided.tool_remote,
        fleet=fleet,
    )


def check_launch(config: Config, config_file: str | None, overrides: Sequence[str]) -> None:
    """Raise ConfigError for every rule the `launch` section breaks against the other sections
    (`common.config.launch.launch_issues`), each blamed on the override that set one of its keys,
    else on the config file, as the loader blames its own issues."""

    issues = launch_issues(config)
    if not issues:
        return
    labels: list[tuple[str, str]] = []
    for text in overrides:
        try:
            labels.append((".".join(parse_override(text)[0]), override_label(text)))
        except ConfigError:  # the loader already accepted every override
            continue

    def blame(issue: Any) -> str | None:
        keys = (issue.key, *issue.related)
        hits = [
            label
            for key, label in labels
            if any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in keys)
        ]
        return hits[-1] if hits else config_file

    raise ConfigError(issues).with_sources(blame)
