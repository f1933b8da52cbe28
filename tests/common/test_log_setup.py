"""common.logging: JSON lines with the process context, stdlib routing, file output, console."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import structlog

from common.logging import configure_logging, format_from_env, get_logger


@pytest.fixture(autouse=True)
def _restore(restore_logging: None) -> None:
    """Every test here reconfigures logging; put it back afterwards."""


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_component_and_server_id() -> None:
    out = io.StringIO()
    configure_logging("json", "info", component="rollout-server", server_id="s1", stream=out)
    log = get_logger(trajectory_id="t-7", policy_version=3)
    log.info("episode finished", reward=1.0)
    log.debug("hidden at info level")
    # A library logger that propagates to the root. Not vLLM's or Ray's: an earlier test in this
    # process may have imported Ray or started a vLLM engine, which turn their propagation off.
    logging.getLogger("somelib.engine").warning("library says %s", "hi")
    records = lines(out)
    assert len(records) == 2
    first, second = records
    assert first["event"] == "episode finished"
    assert first["component"] == "rollout-server" and first["server_id"] == "s1"
    assert first["trajectory_id"] == "t-7" and first["policy_version"] == 3
    assert first["level"] == "info" and "timestamp" in first
    assert first["logger"] == __name__  # named after the calling module
    assert second == {
        **second,
        "event": "library says hi",
        "logger": "somelib.engine",
        "level": "warning",
        "component": "rollout-server",
        "server_id": "s1",
    }


def test_contextvars_and_exceptions_in_json() -> None:
    out = io.StringIO()
    configure_logging("json", "debug", component="learner", rank=0, stream=out)
    with structlog.contextvars.bound_contextvars(policy_version=5):
        try:
            raise ValueError("bad batch")
        except ValueError:
            get_logger().exception("step failed")
    (record,) = lines(out)
    assert record["policy_version"] == 5 and record["rank"] == 0
    assert "bad batch" in json.dumps(record["exception"])


def test_file_gets_json_while_console_is_readable(tmp_path: Path) -> None:
    out = io.StringIO()
    log_file = tmp_path / "logs" / "learner.jsonl"
    configure_logging("console", "info", component="learner", file=log_file, stream=out)
    get_logger("agentrl.test").info("step done", step=4)
    console = out.getvalue()
    assert "step done" in console and "step=4" in console
    assert not console.lstrip().startswith("{")
    (record,) = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert (
        record["event"] == "step done" and record["step"] == 4 and record["component"] == "learner"
    )


def test_reconfiguring_replaces_only_our_handlers() -> None:
    foreign = logging.NullHandler()
    logging.getLogger().addHandler(foreign)
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", component="a", stream=first)
    configure_logging("json", component="b", stream=second)
    get_logger().warning("once")
    assert first.getvalue() == ""
    assert lines(second)[0]["component"] == "b"
    assert foreign in logging.getLogger().handlers


def test_format_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_LOG_FORMAT", "json")
    assert format_from_env("console") == "json"
    monkeypatch.setenv("AGENTRL_LOG_FORMAT", "nonsense")
    assert format_from_env("console") == "console"
    monkeypatch.delenv("AGENTRL_LOG_FORMAT")
    assert format_from_env("json") == "json"
