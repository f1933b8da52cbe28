"""bin/train: a whole training job on this machine from one config, supervised until it ends.

Design: bin/train validates the config, then starts the learner, `launch.rollout_servers` rollout
servers (shard i of N, server id rs<i>) and optionally a tool server as separate processes, each
from the same config file and overrides plus a few of its own (the run directory, free loopback
ports, the shard), so every process could also be started by hand with the same command line.
Children log to ``RUN_DIR/logs/<name>.log``; bin/train itself shows only progress, per-step lines
and errors. It never sleeps to wait for a peer: it polls the files the children write (the learner's
JSON log says which rollout servers joined; metrics.jsonl says which steps finished).

Ending: the learner exiting 0 with every step done is success; the children are stopped (see
`learner.launch_children.stop_all`), the curves are drawn and a summary printed (exit 0). A dead
rollout server is restarted on its shard (its cursor and spool resume it) up to
`launch.max_restarts` times; the learner or the tool server dying, restarts running out, the
rollout servers not connecting within `launch.connect_timeout_s`, or a step count short of the
total stop everything (exit 1, naming the process and its log). SIGINT/SIGTERM stop everything
(exit 130); a second one skips the grace period.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily (bin/train --help stays instant)
    from common.config import Config
    from learner.launch_children import Child

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
    overrides: list[str] = field(default_factory=list)
    """The overrides bin/train added for every child."""

    @property
    def children(self) -> list[Child]:
        return [c for c in (self.tool_server, self.learner, *self.rollouts) if c is not None]


# ---------------------------------------------------------------- planning


def _split_endpoint(address: str) -> tuple[str, str, str]:
    """"tcp://host:port" -> ("tcp", host, port); host keeps IPv6 brackets."""
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
    """A TCP port free on `host` now (released at once: the child binds it moments later)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _yaml(value: Any) -> str:
    return json.dumps(value)  # JSON is YAML: quoted strings and lists survive the override parser


def launch_overrides(config: Config, run_dir: Path) -> tuple[list[str], str | None]:
    """The overrides every child gets, and the URL at which the tool server (if any) answers."""
    from urllib.parse import urlsplit

    launch = config.launch
    escaped = str(run_dir).replace("{", "{{").replace("}", "}}")  # trainer.run_dir is a format string
    out = [f"trainer.run_dir={_yaml(escaped)}"]
    if "jsonl" not in config.trainer.logger:  # bin/train follows the run through metrics.jsonl
        out.append(f"trainer.logger={_yaml([*config.trainer.logger, 'jsonl'])}")
    scheme, host, _ = _split_endpoint(config.learner.bind_address)
    if launch.auto_port and scheme == "tcp" and is_loopback(host):
        address = f"tcp://{host}:{free_port(host)}"
        out += [f"learner.bind_address={_yaml(address)}", f"rollout_server.learner_address={_yaml(address)}"]
    health_url = None
    if launch.tool_server:
        ts = config.tool_server
        port = ts.port
        if port == 0 or (launch.auto_port and is_loopback(ts.host)):
            port = free_port(ts.host)
            out.append(f"tool_server.port={port}")
        local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(ts.host, ts.host)
        local = f"[{local}]" if ":" in local else local
        health_url = f"http://{local}:{port}"
        remote = config.tools.remote.url
        if remote is None or is_loopback(urlsplit(remote).hostname or ""):
            out.append(f"tools.remote.url={_yaml(health_url)}")
    return out, health_url


def plan_run(config_file: str | None, user_overrides: Sequence[str], config: Config,
             log_format: str | None) -> Plan:
    from common.config import load_config
    from common.config.launch import rollout_gpus_of
    from common.rundir import resolve_run_dir
    from learner.launch_children import Child, child_env, python_argv

    run_dir = resolve_run_dir(config).resolve()
    extra, health_url = launch_overrides(config, run_dir)
    final = load_config(config_file, [*user_overrides, *extra], check_paths=True)
    base = ["--config", config_file] if config_file is not None else []
    base += [*user_overrides, *extra]
    if log_format is not None:
        base += ["--log-format", log_format]
    launch_id = uuid.uuid4().hex
    logs = run_dir / "logs"

    def child(name: str, title: str, script: str, *args: str, gpus: list[int] | None = None) -> Child:
        return Child(name, title, python_argv(ROOT / "bin" / script, [*base, *args]), logs / f"{name}.log",
                     child_env(launch_id, gpus))

    n = final.launch.rollout_servers
    rollouts = [child(f"rollout-{i}", f"rollout server rs{i}", "rollout-server", f"rollout_server.shard_index={i}",
                      f"rollout_server.shard_count={n}", f"rollout_server.server_id=rs{i}",
                      gpus=rollout_gpus_of(final.launch, i)) for i in range(n)]
    if final.trainer.total_training_steps:
        total = final.trainer.total_training_steps
    else:  # learner.trainer imports torch: only when the steps must be counted
        from learner.trainer import total_steps

        total = total_steps(final)
    return Plan(config=final, run_dir=run_dir, total_steps=total, launch_id=launch_id,
                learner=child("learner", "learner", "learner", gpus=final.launch.learner_gpus), rollouts=rollouts,
                tool_server=child("tool-server", "tool server", "tool-server") if final.launch.tool_server else None,
                tool_health_url=health_url, overrides=extra)


def check_launch(config: Config, config_file: str | None, overrides: Sequence[str]) -> None:
    """Raise ConfigError for every rule the `launch` section breaks against the other sections
    (`common.config.launch.launch_issues`), each blamed on the override that set one of its keys,
    else on the config file, as the loader blames its own issues."""
    from common.config import ConfigError
    from common.config.launch import launch_issues
    from common.config.loader import override_label, parse_override

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
        hits = [label for key, label in labels
                if any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in keys)]
        return hits[-1] if hits else config_file

    raise ConfigError(issues).with_sources(blame)


# ---------------------------------------------------------------- the command


def main(argv: Sequence[str] | None = None) -> int:
    from common.cli import build_parser

    parser = build_parser(
        "train",
        "Run a whole training job on this machine: the learner, launch.rollout_servers rollout "
        "servers (and a tool server with launch.tool_server=true), all from one config and one run "
        "directory; shows progress, restarts rollout servers that die, stops everything on "
        "Ctrl-C, and draws RUN_DIR/training_curves.png at the end.",
    )
    args = parser.parse_args(argv)

    from common.config import ConfigError, dump_config, load_config
    from common.logging import configure_logging, format_from_env, get_logger
    from common.rundir import prepare_run_dir

    try:
        config = load_config(args.config, args.overrides, check_paths=True)
        check_launch(config, args.config, args.overrides)
        if args.check:
            from common.cli import ROLLOUT_PREFLIGHT, TOOL_SERVER_PREFLIGHT, check_preflight

            # The names and data the rollout servers (and the tool server) would refuse at start.
            preflights = [ROLLOUT_PREFLIGHT, *([TOOL_SERVER_PREFLIGHT] if config.launch.tool_server else [])]
            if status := max(check_preflight(p, config) for p in preflights):
                return status
            sys.stdout.write(dump_config(config))
            return 0
        plan = plan_run(args.config, args.overrides, config, args.log_format)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    prepare_run_dir(plan.config, plan.run_dir)
    configure_logging(args.log_format or format_from_env(plan.config.logging.format),
                      plan.config.logging.level, component="train",
                      file=plan.run_dir / "logs" / "train.jsonl")
    from learner.launch_supervisor import Supervisor

    try:
        return Supervisor(plan, get_logger("learner.launch")).run()
    except KeyboardInterrupt:  # a Ctrl-C after the children were stopped (while plotting)
        return 130
