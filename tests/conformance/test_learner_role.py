"""The learner-role suite against the reference learner (in-process and as a child process) and
against learners broken in one rule each, which must fail the check for that rule, readably."""

from __future__ import annotations

import json
import re
import time

import pytest
from conformance_testkit import (
    AcceptsAnyMajor,
    AsksEveryone,
    IgnoresCredits,
    IgnoresStrayResults,
    NeverAcks,
    free_port,
    learner_in_thread,
    reference_learner_process,
    run_cli,
)

from protocol.version import PROTOCOL_VERSION
from tools.conformance import registry, report, runner

pytestmark = pytest.mark.integration

ALL = [c.name for c in registry.checks("learner")]
LINE = re.compile(r"^(PASS|FAIL) (\S+?)(:)?(\s+.*)?$")


def run_suite(address: str, *only: str, timeout: float = 2.0) -> runner.SuiteReport:
    return runner.run(
        runner.SuiteOptions(role="learner", target=address, timeout=timeout, only=list(only))
    )


def failures(rep: runner.SuiteReport) -> dict[str, str]:
    return {r.name: r.reason for r in rep.results if not r.passed}


def test_every_check_passes_against_the_reference_learner() -> None:
    with learner_in_thread() as address:
        rep = run_suite(address)
    assert [r.name for r in rep.results] == ALL
    assert failures(rep) == {}
    credit = next(r for r in rep.results if r.name == "credit_limit")
    assert credit.notes and "rejected" in credit.notes[0]  # enforcement was exercised, not skipped
    val = next(r for r in rep.results if r.name == "validation_request")
    assert (
        val.notes
        and val.notes[0].startswith("request 'ref-")
        and val.details["policy_version"] == 0
    )


def test_validation_request_is_only_noted_when_the_learner_does_not_validate() -> None:
    with learner_in_thread(validate_on_join=False) as address:
        rep = run_suite(address, "validation_request", "validation_unsolicited", timeout=1.0)
    assert failures(rep) == {}
    assert rep.results[0].notes == [
        "not exercised: no VALIDATE_REQUEST within 1.0 s (the learner validates on "
        "its own schedule)"
    ]


def test_a_learner_that_asks_peers_without_the_capability_fails() -> None:
    with learner_in_thread(AsksEveryone) as address:
        rep = run_suite(address, "validation_request")
    reason = failures(rep)["validation_request"]
    assert reason.startswith(
        "a peer whose HELLO did not offer 'validation' was sent VALIDATE_REQUEST(request_id=ref-"
    )


def test_a_learner_that_ignores_stray_results_fails() -> None:
    with learner_in_thread(IgnoresStrayResults) as address:
        rep = run_suite(address, "validation_unsolicited", timeout=1.0)
    reason = failures(rep)["validation_unsolicited"]
    assert reason.startswith(
        "no ERROR UNEXPECTED for a VALIDATE_RESULT nobody asked for within 1.0 s"
    ), reason


def test_cli_against_a_reference_learner_process() -> None:
    """The realistic path: ``python -m protocol.reference learner`` in its own process, default limits
    (the oversize check sends a 256 MiB message), the CLI in another."""
    with reference_learner_process() as address:
        out = run_cli("--target", address, "--role", "learner", "--timeout", "3")
        js = run_cli(
            "--target", address, "--role", "learner", "--json", "--only", "handshake,batch_ack"
        )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [LINE.match(line).group(1, 2) for line in lines[:-1]] == [("PASS", name) for name in ALL]
    assert re.fullmatch(rf"{len(ALL)} passed, 0 failed in \d+\.\d s", lines[-1])
    assert js.returncode == 0, js.stderr
    doc = json.loads(js.stdout)
    assert (doc["passed"], doc["failed"]) == (2, 0)
    assert [c["name"] for c in doc["checks"]] == ["handshake", "batch_ack"]
    assert doc["checks"][0]["details"]["credits"] >= 1


def test_a_learner_that_never_acks_fails_with_what_it_sent_instead() -> None:
    with learner_in_thread(NeverAcks) as address:
        out = run_cli(
            "--target",
            address,
            "--role",
            "learner",
            "--timeout",
            "1",
            "--only",
            "batch_ack",
            "--only",
            "duplicate_batch,hello_required",
        )
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0] == "PASS hello_required"
    assert re.fullmatch(
        r"FAIL batch_ack: +no ACK for batch 1 within 1\.0 s \(received: (nothing|HEARTBEAT.*)\)",
        lines[1],
    ), lines[1]
    assert lines[2].startswith("FAIL duplicate_batch:")
    assert lines[1].index("no ACK") == lines[2].index("no ACK")  # reasons aligned
    assert lines[-1].startswith("1 passed, 2 failed")


def test_a_learner_that_accepts_another_major_version_fails_version_mismatch() -> None:
    with learner_in_thread(AcceptsAnyMajor) as address:
        rep = run_suite(address, "version_mismatch", "handshake")
    ours = f"{PROTOCOL_VERSION.major}.{PROTOCOL_VERSION.minor}"
    theirs = f"{PROTOCOL_VERSION.major + 1}.{PROTOCOL_VERSION.minor}"
    assert failures(rep) == {
        "version_mismatch": f"HELLO with protocol {theirs} was accepted (WELCOME, protocol "
        f"{ours}): expected ERROR VERSION_MISMATCH"
    }
    assert report.line(rep.results[1], 16).startswith(
        f"FAIL version_mismatch: HELLO with protocol {theirs}"
    )


def test_a_learner_that_ignores_credits_fails_credit_limit() -> None:
    with learner_in_thread(IgnoresCredits) as address:
        rep = run_suite(address, "credit_limit")
    reason = failures(rep)["credit_limit"]
    assert reason.startswith("batch 1 was ACKed although the learner had granted no credit for it")


def test_a_strict_learner_rejects_exactly_the_excess_of_a_burst() -> None:
    """A stalled trainer (nothing consumed) and capacity == credits: the window cannot refill, so
    of a burst of credits+1 exactly the last batch is beyond it."""
    with learner_in_thread(capacity=3, max_credits_per_peer=3, consume=False) as address:
        rep = run_suite(address, "credit_limit")
    assert failures(rep) == {}
    assert rep.results[0].details["rejected"] == [4]


def test_nothing_listening_fails_the_handshake_quickly() -> None:
    t0 = time.monotonic()
    target = f"tcp://127.0.0.1:{free_port()}"
    out = run_cli(
        "--target", target, "--role", "learner", "--timeout", "0.5", "--only", "handshake"
    )
    assert out.returncode == 1
    assert out.stdout.splitlines()[0] == (
        f"FAIL handshake: nothing is listening at {target} (connection refused)"
    )
    assert time.monotonic() - t0 < 10


def test_usage_errors_and_help() -> None:
    t0 = time.monotonic()
    h = run_cli("--help")
    assert h.returncode == 0 and "--wait" in h.stdout and "rollout-server" in h.stdout
    assert time.monotonic() - t0 < 5  # no zmq/numpy/protocol import before parsing
    bad = run_cli("--target", "tcp://127.0.0.1:1", "--role", "learner", "--only", "nope")
    assert bad.returncode == 2 and "unknown check(s) ['nope']" in bad.stderr
    listed = run_cli("--role", "learner", "--list")
    assert [line.split()[0] for line in listed.stdout.splitlines()] == ALL


@pytest.mark.parametrize("role", ["learner", "rollout-server"])
def test_every_check_has_a_summary(role: str) -> None:
    assert all(c.summary for c in registry.checks(role))


def test_missing_or_wrong_credentials_are_named_within_seconds() -> None:
    import asyncio

    import zmq.asyncio

    from protocol.zmq_transport import ZmqServerChannel
    from tools.conformance import reach

    async def probe() -> tuple[str | None, str | None, str | None]:
        zctx = zmq.asyncio.Context()
        learner = ZmqServerChannel("tcp://127.0.0.1:0", token="s3cret", context=zctx)
        try:
            return (
                await reach.diagnose(zctx, learner.address, None),
                await reach.diagnose(zctx, learner.address, "wrong"),
                await reach.diagnose(zctx, learner.address, "s3cret"),
            )
        finally:
            learner.close()
            zctx.destroy(linger=0)

    t0 = time.monotonic()
    none, wrong, right = asyncio.run(probe())
    assert none is not None and "expects credentials" in none and "--token-file" in none
    assert wrong is not None and "another token" in wrong and "--token-file" in wrong
    assert right is None
    assert time.monotonic() - t0 < 5


def test_authentication_passes_with_the_token_and_fails_a_learner_that_lets_any_key_in() -> None:
    """The check presents wrong credentials (a client key not the token's, a wrong learner key,
    none, the token in the clear) and then the token's keys. A learner holding the token's server
    key but letting any client key in fails it, naming that case."""
    token = "c" * 64
    with learner_in_thread(token=token) as address:
        ok = runner.run(
            runner.SuiteOptions(
                role="learner", target=address, timeout=2.0, only=["authentication"], token=token
            )
        )
    assert failures(ok) == {} and "got nothing" in ok.results[0].notes[0]
    with learner_in_thread(token=token, any_client_key=True) as address:
        bad = runner.run(
            runner.SuiteOptions(
                role="learner", target=address, timeout=2.0, only=["authentication"], token=token
            )
        )
    reason = failures(bad)["authentication"]
    assert "a client key not derived from the token" in reason
    assert "pinning another learner key" not in reason and "PLAIN" not in reason
