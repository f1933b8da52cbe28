"""bin/train's restart policy: a rollout server or tool server that dies is restarted, one that
refuses its config or data (exit 2) is not, since a restart would meet the same. The tool server
comes back on the port it reported, and rollout servers' restarts wait until it answers again."""

from __future__ import annotations

import sys
import time

import pytest
import structlog

from common.config import load_config
from common.rundir import prepare_run_dir
from launcher.children import Child
from launcher.plan import Plan, plan_run
from launcher.supervisor import EXIT_FAILED, Supervisor

pytestmark = pytest.mark.integration  # starts child processes


def _plan(job_overrides: list[str], *extra: str) -> Plan:
    overrides = [*job_overrides, "launch.rollout_servers=1", "launch.max_restarts=2", *extra]
    plan = plan_run(None, overrides, load_config(None, overrides, check_paths=False), None)
    prepare_run_dir(plan.config, plan.run_dir)
    return plan


def _died(plan: Plan, code: int, child: Child | None = None) -> Supervisor:
    sup = Supervisor(plan, structlog.get_logger("test"))
    child = child if child is not None else plan.rollouts[0]
    _exit_with(child, code)
    return sup


def _exit_with(child: Child, code: int) -> None:
    child.argv = [sys.executable, "-c", f"import sys; sys.exit({code})"]
    child.start("test")
    assert child.proc is not None
    child.proc.wait(30)


def _reap(*children: Child | None) -> None:
    for child in children:
        if child is not None and child.proc is not None:
            child.proc.kill()
            child.proc.wait(30)


def test_a_server_that_refuses_its_config_is_not_restarted(job_overrides: list[str]) -> None:
    plan = _plan(job_overrides)
    sup = _died(plan, 2)
    child = plan.rollouts[0]
    assert sup._check_rollout(child) == EXIT_FAILED
    assert child.restarts == 0
    assert sup.failure is not None and "refused its config or data" in sup.failure[0]


def test_a_server_that_dies_is_restarted(job_overrides: list[str]) -> None:
    plan = _plan(job_overrides)
    sup = _died(plan, 1)
    child = plan.rollouts[0]
    try:
        assert sup._check_rollout(child) is None
        assert child.restarts == 1 and sup.failure is None
    finally:
        _reap(child)


def test_a_tool_server_that_refuses_its_config_is_not_restarted(job_overrides: list[str]) -> None:
    plan = _plan(job_overrides, "launch.tool_server=true")
    ts = plan.tool_server
    assert ts is not None
    sup = _died(plan, 2, ts)
    assert sup._check_tool_server(ts) == EXIT_FAILED
    assert ts.restarts == 0
    assert sup.failure is not None and "refused its config or data" in sup.failure[0]


def test_a_dead_tool_server_comes_back_on_its_port(job_overrides: list[str]) -> None:
    """Exit 0 is a death too (a SIGTERM ends it so); the restart binds the port the rollout
    servers were given, and a rollout server that dies meanwhile waits for it to answer."""
    plan = _plan(job_overrides, "launch.tool_server=true")
    ts, rs = plan.tool_server, plan.rollouts[0]
    assert ts is not None and plan.tool_auto_port and "tool_server.port=0" in ts.argv
    sup = _died(plan, 0, ts)
    sup.connections.tool_port = 40123  # what its "tool listening" event said
    try:
        assert sup._check_tool_server(ts) is None
        assert ts.restarts == 1 and ts.argv[-1] == "tool_server.port=40123" and len(ts.pids) == 2
        assert sup.tool_restarted_at is not None and sup.failure is None
        _exit_with(rs, 1)
        assert sup._check_rollout(rs) is None and rs.restarts == 0  # held: no tool server yet
        sup._tool_server_ready = lambda: True  # type: ignore[method-assign]
        assert sup._tool_server_back(ts, sup.tool_restarted_at) is None
        assert sup.tool_restarted_at is None
        assert sup._check_rollout(rs) is None and rs.restarts == 1
    finally:
        _reap(ts, rs)


def test_a_tool_server_that_does_not_come_back_ends_the_run(job_overrides: list[str]) -> None:
    plan = _plan(job_overrides, "launch.tool_server=true", "launch.connect_timeout_s=5")
    ts = plan.tool_server
    assert ts is not None
    sup = Supervisor(plan, structlog.get_logger("test"))
    sup._tool_server_ready = lambda: False  # type: ignore[method-assign]
    assert sup._tool_server_back(ts, time.monotonic()) is None  # it may still be starting
    assert sup._tool_server_back(ts, time.monotonic() - 6) == EXIT_FAILED
    assert sup.failure is not None and "within 5 s of its restart" in sup.failure[0]
