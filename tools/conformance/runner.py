"""Running one role's checks against a target, one ``Result`` per check.

Learner role: each check gets a fresh ``LearnerTarget`` (its own sockets and peer_ids), closed
after it whatever happened, so a failing check leaks nothing into the next. Rollout-server role:
one ``FakeLearner`` for the whole run, checks in registry order; ``handshake`` always runs because
every other check needs its session, and a violation the fake learner's reader records while a
check runs (a batch beyond its credits, an undecodable message) fails that check. Every check also
runs under a generous safety limit on top of its own deadlines, cut to what is left of
``--deadline`` (the whole run's budget) when one is given, so a caller with its own timeout (CI)
gets a report naming the check and what it waited for instead of a killed process. An exception
other than ``CheckFailed`` is reported as an error of the suite, not of the endpoint under test.
"""

from __future__ import annotations

import asyncio
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from common.identity import wire_identities
from protocol.messages import Identity
from tools.conformance import reach, registry, wire
from tools.conformance.fake_learner import FakeLearner
from tools.conformance.peer import LearnerTarget
from tools.conformance.registry import Check, CheckContext, CheckFailed, Result, Role


@dataclass
class SuiteOptions:
    role: Role
    target: str
    timeout: float = 5.0  # per expected reply
    only: list[str] = field(default_factory=list)  # check names; empty: all
    wait: float = 30.0  # rollout-server: how long to wait for the server's first HELLO
    weights_from: str | None = None  # rollout-server: directory of *.safetensors to transfer
    model_dir: str | None = None  # learner: HELLO carries this model's and tokenizer's identity
    token: str | None = None  # learner: presented at the handshake (transport.auth: token)
    deadline: float | None = None  # seconds for the whole run; None: only per-check safety limits


@dataclass
class SuiteReport:
    role: Role
    target: str
    address: str  # what the suite bound or connected to (differs from target for port 0)
    results: list[Result]
    duration_s: float

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def failed(self) -> int:
        return len(self.results) - self.passed


def select(role: Role, only: list[str]) -> list[Check]:
    """The checks to run, in order; ValueError names unknown ones."""
    all_checks = registry.checks(role)
    names = [c.name for c in all_checks]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown} for role {role}; known: {', '.join(names)}")
    if not only:
        return all_checks
    keep = set(only) | ({"handshake"} if role == "rollout-server" else set())
    return [c for c in all_checks if c.name in keep]


def _safety_limit(opts: SuiteOptions) -> float:
    return 120.0 + 20 * opts.timeout + opts.wait


def _limit(opts: SuiteOptions, end: float) -> tuple[float, str]:
    """The next check's time limit (s) and how a reason names it: the safety limit, or what is
    left before the run's ``end`` (monotonic) if that comes first."""
    safety, left = _safety_limit(opts), end - time.monotonic()
    if left < safety:
        return left, f"the suite's --deadline of {opts.deadline:g} s"
    return safety, f"the suite's safety limit of {safety:.0f} s"


def _not_run(check: Check, opts: SuiteOptions) -> Result:
    return Result(
        check.name, False, f"not run: the suite's --deadline of {opts.deadline:g} s passed"
    )


async def _run_one(check: Check, ctx: CheckContext, limit: float, limit_name: str) -> Result:
    ctx.reset_report()
    started = time.monotonic()
    passed, reason, details = True, "", {}
    try:
        await asyncio.wait_for(check.func(ctx), limit)
    except CheckFailed as e:
        passed, reason = False, e.reason
    except TimeoutError:
        waiting = f", waiting for {ctx.waiting_for}" if ctx.waiting_for else ""
        passed, reason = False, f"did not finish within {limit_name}{waiting}"
    except Exception as e:
        passed, reason = False, f"error in the conformance suite itself: {type(e).__name__}: {e}"
        details["traceback"] = traceback.format_exc()
    return Result(
        check.name,
        passed,
        reason,
        list(ctx.notes),
        round(time.monotonic() - started, 3),
        {**ctx.details, **details},
    )


def _identities(model_dir: str | None) -> tuple[Identity, Identity]:
    if model_dir is None:
        return wire.DEFAULT_MODEL, wire.DEFAULT_TOKENIZER

    return wire_identities(model_dir)


async def run_suite(
    opts: SuiteOptions,
    *,
    on_listening: Callable[[str], None] | None = None,
    on_result: Callable[[Result], None] | None = None,
) -> SuiteReport:
    """Run the selected checks. ``on_listening(address)``: rollout role, once the ROUTER is bound."""
    checks = select(opts.role, opts.only)
    started = time.monotonic()
    end = started + opts.deadline if opts.deadline is not None else math.inf
    results: list[Result] = []

    def done(r: Result) -> None:
        results.append(r)
        if on_result is not None:
            on_result(r)

    zctx = zmq.asyncio.Context()
    try:
        if opts.role == "learner":
            model, tokenizer = _identities(opts.model_dir)
            # a malformed address is a set-up error, not 13 failures
            probe = zctx.socket(zmq.DEALER)
            try:
                probe.connect(opts.target)
            finally:
                probe.close(linger=0)
            address = opts.target
            unreachable = await reach.diagnose(
                zctx, opts.target, opts.token, min(reach.PROBE_S, max(opts.timeout, 1.0))
            )
            for check in checks:
                limit, limit_name = _limit(opts, end)
                if limit <= 0:
                    done(_not_run(check, opts))
                    continue
                if unreachable is not None:  # the first check says why; none of them can pass
                    first = check is checks[0]
                    done(
                        Result(
                            check.name, False, unreachable if first else "not run: " + unreachable
                        )
                    )
                    continue
                ctx = LearnerTarget(
                    zctx,
                    opts.target,
                    timeout=opts.timeout,
                    model=model,
                    tokenizer=tokenizer,
                    token=opts.token,
                )
                try:
                    done(await _run_one(check, ctx, limit, limit_name))
                finally:
                    await ctx.aclose()
        else:
            fl = FakeLearner(
                zctx,
                opts.target,
                timeout=opts.timeout,
                wait=opts.wait,
                weights_from=opts.weights_from,
            )
            address = fl.address
            await fl.start()
            try:
                if on_listening is not None:
                    on_listening(address)
                for check in checks:
                    limit, limit_name = _limit(opts, end)
                    if limit <= 0:
                        done(_not_run(check, opts))
                        continue
                    before = len(fl.violations)
                    r = await _run_one(check, fl, limit, limit_name)
                    new = fl.violations[before:]
                    if new:
                        r.details["violations"] = new
                        if r.passed:
                            more = f" (and {len(new) - 1} more)" if len(new) > 1 else ""
                            r.passed, r.reason = False, new[0] + more
                    done(r)
            finally:
                await fl.aclose()
    finally:
        zctx.destroy(linger=500)  # closes whatever a failed set-up left open, then terminates
    return SuiteReport(
        opts.role, opts.target, address, results, round(time.monotonic() - started, 3)
    )


def run(opts: SuiteOptions, **kw: Callable) -> SuiteReport:
    return asyncio.run(run_suite(opts, **kw))
