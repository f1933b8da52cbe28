"""Command-line front end shared by bin/learner, bin/rollout-server and bin/tool-server.

Design: the entrypoints are thin; this module parses arguments, loads and validates the config,
prepares the run directory and logging, then imports the process's `run(config, run_dir)` from a
dotted "module:function" string. Everything heavy (torch, vLLM, Ray) is imported only by that
target, and pydantic only after argument parsing, so `--help` is instant and `--check` validates
a config on a machine without any engine installed.

Exit status: 0 success, 2 bad usage or invalid configuration (message on stderr), 1 the run
failed, 74 the disk is full (`common.disk_full`: one line naming the path), 130 interrupted; a run
target may also return its own integer status.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from common import disk_full  # stdlib only

if TYPE_CHECKING:  # imported lazily at run time, see the module docstring
    from common.config import Config

LEARNER_TARGET = "learner.app:run"
ROLLOUT_SERVER_TARGET = "rollout_service.app:run"
TOOL_SERVER_TARGET = "rollout_service.tool_server:run"
LEARNER_PREFLIGHT = "learner.sinks:preflight_issues"  # metric sinks whose package is missing
ROLLOUT_PREFLIGHT = "rollout_service.preflight:check_issues"
TRAIN_ROLLOUT_PREFLIGHT = "rollout_service.preflight:train_issues"  # bin/train's: every data row
TRAIN_CHECK_PREFLIGHT = "rollout_service.preflight:train_check_issues"  # its --check
TOOL_SERVER_PREFLIGHT = "rollout_service.preflight:tool_server_issues"

Resolver = Callable[["Config"], dict[str, Any]]
"""Fills runtime values (a server id) into the config before it is saved; returns the fields that
identify this process, which go into every log record and name its run subdirectory."""


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The argument parser common to both entrypoints."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="Overrides use dotted keys and YAML values, e.g. "
        "trainer.total_training_steps=10 trainer.logger=[console,jsonl] ray.address=null",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="YAML config file (default: built-in defaults)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate the config (model path included; for rollout servers and bin/train also the "
        "agent, tool and reward names and the first rows of every data file), print it resolved "
        "as YAML and exit",
    )
    parser.add_argument(
        "--log-format",
        choices=("console", "json"),
        help="log format (default: $AGENTRL_LOG_FORMAT, else logging.format)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser


def main(
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    target: str,
    component: str,
    resolve: Resolver | None = None,
    check_paths: bool = True,
    preflight: str | None = None,
) -> int:
    """Parse `argv`, validate the config, then run `target` ("module:function"); returns the exit status.
    `check_paths` False skips the filesystem checks (model directory, key files) for a process
    that never reads them. `preflight` ("module:function", see `check_preflight`) is what `--check`
    verifies beyond the config: the names and data files this process would refuse at start."""
    # intermixed: an option after the overrides (`bin/learner a=b --log-format json`) is still one
    args = build_parser(prog, description).parse_intermixed_args(argv)

    from common.config import ConfigError, dump_config, load_config
    from common.logging import configure_logging, format_from_env, get_logger
    from common.rundir import prepare_run_dir, resolve_run_dir

    try:
        config = load_config(args.config, args.overrides, check_paths=check_paths)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.check:
        print_aliases(config)
        if preflight is not None and (status := check_preflight(preflight, config)):
            return status
        sys.stdout.write(dump_config(config))
        return 0

    context = resolve(config) if resolve is not None else {}
    run_dir = resolve_run_dir(config)
    if context:
        # One of several processes of its kind (rollout servers) sharing the run directory: each
        # gets its own subdirectory so their saved configs and logs do not overwrite each other.
        run_dir = run_dir / component / "-".join(str(v) for v in context.values())
    prepare_run_dir(config, run_dir)
    configure_logging(
        args.log_format or format_from_env(config.logging.format),
        config.logging.level,
        component=component,
        file=run_dir / "logs" / f"{component}.jsonl",
        **context,
    )
    log = get_logger("common.cli")
    log.info("starting", target=target, config_file=args.config, run_dir=str(run_dir))
    try:
        result = load_target(target)(config, run_dir)
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
    except KeyboardInterrupt:
        log.warning("interrupted")
        return 130
    except ConfigError as exc:  # found only at start (a checkpoint that does not fit the config)
        print(exc, file=sys.stderr)
        log.error("stopped: the configuration does not fit", error=str(exc))
        return 2
    except Exception as e:
        if (full := disk_full.find(e)) is not None:  # an operator's problem, not a bug: no trace
            log.error("stopped: the disk is full", error=disk_full.describe(full))
            return disk_full.EXIT_DISK_FULL
        log.exception("run failed")
        return 1
    log.info("finished", status=result if isinstance(result, int) else 0)
    return result if isinstance(result, int) else 0


def print_aliases(config: Config) -> None:
    """At ``--check``: what each foreign key (AgentFly's ``agent.*``, verl keys named differently
    here; ``common.config.aliases``) became, one line each on stderr."""
    for applied in config.applied_aliases:
        print(f"alias: {applied.describe()}", file=sys.stderr)


def check_preflight(target: str, config: Config) -> int:
    """Run a preflight check, `target(config) -> (issues, warnings)`; print what it found on
    stderr. Returns 2 when there are issues (the real start would refuse them), else 0."""
    issues, warnings = load_target(target)(config)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for issue in issues:
        print(issue, file=sys.stderr)
    return 2 if issues else 0


def load_target(target: str) -> Callable[..., Any]:
    """Import "package.module:function" and return the function."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"run target must look like 'package.module:function' (got {target!r})")
    function = getattr(importlib.import_module(module_name), attr)
    if not callable(function):
        raise TypeError(f"run target {target!r} is not callable")
    return function  # type: ignore[no-any-return]


def learner_main(argv: Sequence[str] | None = None) -> int:
    """bin/learner: the Ray + FSDP learner."""
    return main(
        argv,
        prog="learner",
        description="Run the learner: receives trajectories from rollout servers, trains the "
        "policy with Ray + FSDP and streams new weights back.",
        target=LEARNER_TARGET,
        component="learner",
        preflight=LEARNER_PREFLIGHT,
    )


def rollout_server_main(argv: Sequence[str] | None = None) -> int:
    """bin/rollout-server: a standalone vLLM rollout server."""
    return main(
        argv,
        prog="rollout-server",
        description="Run a rollout server: a vLLM engine running agent loops whose trajectories "
        "stream to the learner.",
        target=ROLLOUT_SERVER_TARGET,
        component="rollout-server",
        resolve=resolve_rollout_server,
        preflight=ROLLOUT_PREFLIGHT,
    )


def resolve_rollout_server(config: Config) -> dict[str, Any]:
    """Fix the rollout server's id (configured or `<hostname>-<pid>`); it identifies the process."""
    # Fixed once here so the saved config, the log fields and the wire all use the same id.
    server = config.rollout_server
    server.server_id = server.resolved_server_id()
    return {"server_id": server.server_id}


def tool_server_main(argv: Sequence[str] | None = None) -> int:
    """bin/tool-server: serves tools over HTTP to rollout servers (tools.remote.url)."""
    return main(
        argv,
        prog="tool-server",
        description="Run a tool server: serves the tools named in tool_server.tools (sandboxed "
        "python, search, ...) over HTTP for rollout servers that set tools.remote.url.",
        target=TOOL_SERVER_TARGET,
        component="tool-server",
        resolve=resolve_tool_server,
        check_paths=False,  # the tool host shares the config file but not the model or the keys
        preflight=TOOL_SERVER_PREFLIGHT,
    )


def resolve_tool_server(config: Config) -> dict[str, Any]:
    """Name this tool server `<hostname>-<pid>`: its run subdirectory and a field of its logs,
    so it does not overwrite the learner's saved config when they share a run directory."""
    import os
    import socket

    return {"server_id": f"{socket.gethostname()}-{os.getpid()}"}
