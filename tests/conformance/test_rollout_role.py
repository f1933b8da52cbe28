"""The rollout-server-role suite against the reference rollout server (in-process and as a child
process), against a sender that ignores credits, and with weights from a safetensors directory."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from anyio.from_thread import start_blocking_portal
from conformance_testkit import (
    CLI,
    REPO,
    AnswersTwice,
    FallsSilentOnValidate,
    IgnoresCreditsSender,
    LosesSessionOnValidate,
    RolloutInThread,
    child,
    free_port,
    run_cli,
)

from common.safetensors_buffers import load_dir
from protocol.sender import RolloutConnection, SenderState
from tools.conformance import registry, report, runner

ALL = [c.name for c in registry.checks("rollout-server")]


@contextmanager
def rollout_server(
    conn_cls: type[RolloutConnection] = RolloutConnection, *, request_weights: bool = False, **kw
) -> Iterator[RolloutInThread]:
    """A rollout server in a background thread, started once the suite's ROUTER is bound."""
    with (
        start_blocking_portal() as portal,
        RolloutInThread(portal, conn_cls, request_weights=request_weights, **kw) as server,
    ):
        yield server


def run_against(server: RolloutInThread, *only: str, **kw) -> runner.SuiteReport:
    opts = runner.SuiteOptions(
        role="rollout-server",
        target="tcp://127.0.0.1:0",
        timeout=3.0,
        wait=10.0,
        only=list(only),
        **kw,
    )
    return runner.run(opts, on_listening=server)


def failures(rep: runner.SuiteReport) -> dict[str, str]:
    return {r.name: r.reason for r in rep.results if not r.passed}


def test_every_check_passes_against_the_reference_rollout_server() -> None:
    with rollout_server() as server:
        rep = run_against(server)
        assert [r.name for r in rep.results] == ALL
        assert failures(rep) == {}
        # The last check ends the server with a fatal VERSION_MISMATCH: it stops by itself.
        assert server.stopped() is SenderState.FAILED
    details = {r.name: r.details for r in rep.results}
    assert details["resend_after_reconnect"]["new_connection"] is True
    assert details["credit_respected"]["batches_after_grant"] == 2
    assert details["validation"]["ok"] is True and details["validation"]["count"] == 4
    assert details["validation"]["sources"] == ["synthetic"]


def test_validation_is_only_noted_for_a_server_without_the_capability() -> None:
    with rollout_server(capabilities=()) as server:
        rep = run_against(server, "validation")
    assert failures(rep) == {}
    assert rep.results[1].notes == ["not exercised: HELLO does not offer 'validation'"]


def test_a_server_that_answers_a_validation_twice_fails() -> None:
    with rollout_server(AnswersTwice) as server:
        rep = run_against(server, "validation")
    reason = failures(rep)["validation"]
    assert reason.startswith(
        "1 more VALIDATE_RESULT(s) after the first: VALIDATE_RESULT(request_id=conformance-"
    )


def test_validation_fails_at_once_when_the_server_reconnects_instead_of_answering() -> None:
    """The CI flake: a server that timed the session out never sees the request; the check used to
    wait out --timeout + --wait (245 s in tests/rollout) for an answer that could not come."""
    with rollout_server(LosesSessionOnValidate) as server:
        rep = run_against(server, "validation")
    reason = failures(rep)["validation"]
    assert reason.startswith("expected VALIDATE_RESULT for request conformance-"), reason
    assert "got HELLO(" in reason, reason
    assert rep.results[1].duration_s < 3.0  # run_against: --timeout 3, --wait 10


def test_validation_fails_once_the_session_falls_silent() -> None:
    with rollout_server(FallsSilentOnValidate) as server:
        rep = run_against(server, "validation")
    reason = failures(rep)["validation"]
    assert "the session went silent (nothing from it for 3.0 s" in reason, reason
    assert rep.results[1].duration_s < 6.0  # silence (--timeout 3), not --timeout + --wait


def test_the_deadline_names_the_check_and_what_it_waited_for() -> None:
    opts = runner.SuiteOptions(
        role="rollout-server",
        target="tcp://127.0.0.1:0",
        timeout=0.5,
        wait=30.0,
        deadline=0.5,
        only=["heartbeat"],
    )
    rep = runner.run(opts)
    assert rep.duration_s < 5.0
    assert failures(rep) == {
        "handshake": "did not finish within the suite's --deadline of 0.5 s, "
        "waiting for HELLO from a rollout server",
        "heartbeat": "not run: the suite's --deadline of 0.5 s passed",
    }


@pytest.mark.integration
def test_cli_against_a_reference_rollout_server_process() -> None:
    """Server process started first, pointing at an address nothing listens on yet; the CLI binds it."""
    target = f"tcp://127.0.0.1:{free_port()}"
    with child("-m", "protocol.reference", "rollout-server", "--connect", target) as server:
        cli = subprocess.Popen(
            [
                sys.executable,
                str(CLI),
                "--role",
                "rollout-server",
                "--target",
                target,
                "--json",
                "--timeout",
                "3",
                "--wait",
                "20",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = cli.communicate(timeout=60)
        finally:
            if cli.poll() is None:
                cli.kill()
                cli.communicate()
        assert cli.returncode == 0, out + err
        assert f"listening on {target}" in err
        doc = json.loads(out)
        assert [(c["name"], c["status"]) for c in doc["checks"]] == [(n, "PASS") for n in ALL]
        assert server.wait(timeout=10) == 0  # gave up after the fatal error, cleanly


def test_a_sender_that_ignores_credits_fails_credit_respected() -> None:
    with rollout_server(IgnoresCreditsSender) as server:
        rep = run_against(server, "credit_respected")
    assert [r.name for r in rep.results] == ["handshake", "credit_respected"]
    reason = failures(rep)["credit_respected"]
    assert "arrived while the only credit was in use" in reason, reason
    line = report.line(rep.results[1], 16)
    assert line.startswith("FAIL credit_respected: ") and line.endswith(reason)


def test_no_rollout_server_fails_the_handshake_and_skips_the_rest() -> None:
    opts = runner.SuiteOptions(
        role="rollout-server", target="tcp://127.0.0.1:0", timeout=0.5, wait=0.5, only=["heartbeat"]
    )
    rep = runner.run(opts)
    assert failures(rep) == {
        "handshake": "no HELLO from a rollout server within 0.5 s (received: nothing)",
        "heartbeat": "not run: no open session with the rollout server (an earlier check failed)",
    }


def _write_bf16_safetensors(path: Path, name: str, raw: bytes, shape: list[int]) -> None:
    header = json.dumps(
        {name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, len(raw)]}}
    ).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + raw)


def test_weights_from_a_safetensors_directory(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(
        {
            "layer.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
            "layer.bias": np.ones(3, np.float32),
        },
        str(tmp_path / "model-00001.safetensors"),
    )
    bf16 = np.arange(8, dtype=np.uint16).tobytes()  # numpy has no bfloat16: raw bytes path
    _write_bf16_safetensors(tmp_path / "model-00002.safetensors", "embed.weight", bf16, [2, 4])
    tensors = {t.name: t for t in load_dir(tmp_path)}
    assert {n: (t.dtype, t.shape, t.data.nbytes) for n, t in tensors.items()} == {
        "layer.bias": ("float32", (3,), 12),
        "layer.weight": ("float32", (3, 4), 48),
        "embed.weight": ("bfloat16", (2, 4), 16),
    }
    assert bytes(tensors["embed.weight"].data) == bf16
    with rollout_server() as server:
        rep = run_against(server, "weights", weights_from=str(tmp_path))
    assert failures(rep) == {}
    assert rep.results[1].details["tensors"] == 3


def test_a_server_that_asks_for_weights_in_hello_gets_them() -> None:
    with rollout_server(request_weights=True) as server:
        rep = run_against(server, "weights")
    assert failures(rep) == {}
    assert rep.results[0].notes == ["HELLO asked for weights (policy_version -1): sent version 0"]
    # version 0 from the handshake, then 1; the corrupt 2 refused
    assert server.conn.policy_version == 1


@pytest.mark.integration
def test_an_address_in_use_is_a_set_up_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = run_cli(
            "--role",
            "rollout-server",
            "--target",
            f"tcp://127.0.0.1:{taken.getsockname()[1]}",
            timeout=20,
        )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "conformance: cannot use tcp://127.0.0.1:" in out.stderr and out.stdout == ""
