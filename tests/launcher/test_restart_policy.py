"""bin/train's restart policy: a rollout server that dies is restarted, one that refuses its config
or data (exit 2) is not, since a restart would meet the same."""

from __future__ import annotations

import sys

import pytest
import structlog

from common.config import load_config
from common.rundir import prepare_run_dir
from launcher.plan import Plan, plan_run
from launcher.supervisor import EXIT_FAILED, Supervisor

pytestmark = pytest.mark.integration  # starts child processes


def _plan(job_overrides: list[str]) -> Plan:
    overrides = [*job_overrides, "launch.rollout_servers=1", "launch.max_restarts=2"]
    plan = plan_run(None, overrides, load_config(None, overrides, check_paths=False), None)
    prepare_run_dir(plan.config, plan.run_dir)
    return plan


def _died(plan: Plan, code: int) -> Supervisor:
    sup = Supervisor(plan, structlog.get_logger("test"))
    child = plan.rollouts[0]
    child.argv = [sys.executable, "-c", f"import sys; sys.exit({code})"]
    child.start("test")
    assert child.proc is not None
    child.proc.wait(30)
    return sup


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
        if child.proc is not None:
            child.proc.kill()
            child.proc.wait(30)
