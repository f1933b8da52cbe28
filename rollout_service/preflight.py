"""What ``--check`` verifies beyond the config's own validation: names and data.

Design: the config loader checks types, ranges and paths; whether a name exists in a registry, and
whether a data file's rows are usable, is known only to the rollout service. ``check_issues``
answers both without an engine, a model or the network: it reads the first ``PEEK_ROWS`` rows of
every data file (``data.located_rows(limit=...)``, so encoding, row size, layout and field errors
name the file, the line or row and the field; the layouts are ``rollout_service.layouts``), checks the agent types those rows and the config name against the registry
(naming the row or key), then runs the rollout server's own start-up check (``server.check_names``:
reward functions, the agents' tools) and checks the tool options and the rows' own ``reward_fn``. Each problem becomes an ``Issue`` naming its config key, and ``--check`` exits 2 on
any, as the real start would refuse them. Only warnings: a data file missing on this machine (data
may live only on the rollout hosts, so the check reads what is here), and anything wrong with the
validation files (a rollout server starts without them and answers validation requests with the
error). The tool server's check is ``tool_server.tools`` against the tool registry and the
options those tools need.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import rollout_service.rewards as rewards_pkg
from common.config.errors import Issue
from rollout_service.agents import load_builtin_agents
from rollout_service.agents.base import AGENTS
from rollout_service.data import DataError, layout_options, located_rows, sources_from_config
from rollout_service.errors import StartupError
from rollout_service.rewards.base import REWARDS
from rollout_service.server import agent_setup, check_names
from rollout_service.tools import load_builtin_tools
from rollout_service.tools.factory import tool_options

if TYPE_CHECKING:
    from common.config import Config

PEEK_ROWS = 100
"""Rows read from the start of each data file; enough to catch a wrong format or field naming."""


@dataclass
class _Findings:
    issues: list[Issue] = field(default_factory=list)
    warnings: list[Issue] = field(default_factory=list)
    agents: dict[str, str] = field(default_factory=dict)  # agent type -> where it is first named
    rewards: dict[str, str] = field(default_factory=dict)  # reward function named by rows -> where


def _peek(
    data: Any,
    key: str,
    paths: list[str],
    found: _Findings,
    *,
    fatal: bool,
    limit: int | None = PEEK_ROWS,
    local: bool = False,
) -> None:
    """Read the first ``limit`` rows of each file (None: all) and note the agent types and reward
    functions they name. ``fatal`` False: data problems are only warnings (validation files).
    ``local``: the servers run on this machine, so a missing file is a problem, not a warning."""
    problems = found.issues if fatal else found.warnings
    for i, path in enumerate(paths):
        file_key = f"{key}.{i}" if len(paths) > 1 else key
        if not Path(path).is_file():
            if local:  # the servers about to start here read it here
                problems.append(
                    Issue(file_key, f"{path}: no such data file (the rollout servers run here)")
                )
                continue
            # Data may live only on the rollout hosts (like their checkouts of a shared config).
            found.warnings.append(
                Issue(
                    file_key,
                    f"{path}: no such data file on this machine; its "
                    "rows and the names in them are not checked",
                )
            )
            continue
        try:
            rows = located_rows(
                path,
                max_row_bytes=data.max_row_bytes,
                limit=limit,
                options=layout_options(data),
            )
        except DataError as e:
            problems.append(Issue(file_key, str(e)))
            continue
        for where, row in rows:
            if row.get("agent"):
                found.agents.setdefault(row["agent"], f"{path}: {where}: field 'agent'")
            if isinstance(row.get("reward_fn"), str):
                found.rewards.setdefault(row["reward_fn"], f"{path}: {where}: field 'reward_fn'")


def check_issues(
    config: Config, *, limit: int | None = PEEK_ROWS, local: bool = False
) -> tuple[list[Issue], list[Issue]]:
    """(problems a rollout server would refuse at start, warnings) for ``config``: the first
    ``limit`` rows of each data file (None: every row); ``local`` as in `_peek`."""

    data = config.data
    found = _Findings(agents={data.agent_type: "data.agent_type"})
    try:
        sources = sources_from_config(data)
    except DataError as e:
        found.issues.append(Issue("data.train_files", str(e)))
        sources = []
    for j, source in enumerate(sources):
        key = f"data.datasets.{j}" if data.datasets else "data.train_files"
        if source.agent_type:
            found.agents.setdefault(source.agent_type, f"{key}.agent_type")
        _peek(
            data,
            f"{key}.path" if data.datasets else key,
            list(source.paths),
            found,
            fatal=True,
            limit=limit,
            local=local,
        )
    training_agents, training_rewards = dict(found.agents), dict(found.rewards)
    _peek(data, "data.val_files", list(data.val_files), found, fatal=False, limit=limit)

    load_builtin_agents()
    known = ", ".join(AGENTS.names())
    for agent, where in found.agents.items():
        if agent not in AGENTS:
            problem = Issue("", f"{where}: unknown agent type {agent!r}; known: {known}")
            # A validation set's agent only makes validation unavailable; training refuses to start.
            (found.issues if agent in training_agents else found.warnings).append(problem)
    try:  # the rollout server's own check at start: rewards and the tools of the agents
        check_names(config, {a for a in found.agents if a in AGENTS})
    except StartupError as e:
        # One message of "; "-joined problems, each of which may end in "; known: a, b".
        found.issues += [Issue("", problem) for problem in re.split(r"; (?!known: )", str(e))]
    found.issues += _tool_option_issues(config, set(found.agents))
    rewards_pkg.load_builtin_rewards()
    for name, where in sorted(found.rewards.items()):
        if name not in REWARDS:
            problem = Issue(
                "",
                f"{where}: unknown reward function {name!r}; known: {', '.join(REWARDS.names())}",
            )
            (found.issues if name in training_rewards else found.warnings).append(problem)
    return found.issues, found.warnings


def train_check_issues(config: Config) -> tuple[list[Issue], list[Issue]]:
    """``bin/train --check``: every row of every data file (a bad row far into a file would
    otherwise stop each rollout server after the learner and Ray started); a missing file is a
    warning, as it may be made before the run."""
    return check_issues(config, limit=None)


def train_issues(config: Config) -> tuple[list[Issue], list[Issue]]:
    """bin/train's check before it starts anything: `train_check_issues`, and a training file
    missing here is a problem when the servers run on this machine (``launch.placement: local``)."""
    return check_issues(config, limit=None, local=config.launch.placement == "local")


def _tool_option_issues(config: Config, agents: set[str]) -> list[Issue]:
    """Options the in-process tools need from the config (a search corpus), as their factories
    would refuse them at start. Remote tools are the tool server's business."""

    if config.tools.remote.url is not None:
        return []
    names = dict.fromkeys(
        n
        for a in sorted(agents | {"tool_agent"})
        if a in AGENTS
        for n in agent_setup(config, a).tools
    )
    return _option_issues(config, list(names))


def _option_issues(config: Config, names: list[str]) -> list[Issue]:

    issues = []
    for name in names:
        try:
            tool_options(config, name)
        except ValueError as e:
            key, _, message = str(e).partition(": ")
            issues.append(Issue(key, message) if message else Issue("", str(e)))
    return issues


def tool_server_issues(config: Config) -> tuple[list[Issue], list[Issue]]:
    """``tool_server.tools`` against the tool registry and their options (what bin/tool-server
    builds at start)."""

    registry = load_builtin_tools()
    names = config.tool_server.tools
    issues = [
        Issue("tool_server.tools", f"unknown tool {name!r}; known: {', '.join(registry.names())}")
        for name in names
        if name not in registry
    ]
    return issues + _option_issues(config, [n for n in names if n in registry]), []
