"""The ``code`` reward: does the model's program pass the row's tests?

Design: the program (the finish/answer tool's answer, else the last fenced Python block of the
response) and the tests (``row["tests"]``, else ``row["extra_info"]["tests"]``: one string of
asserts or a list of them) run as one file in the sandbox. Passing means the file ran to its end:
it must exit 0 *and* print a random sentinel appended after the tests, so code that calls
``sys.exit(0)`` or ``os._exit(0)`` before the tests run does not pass. Score 1.0 or 0.0; a
timeout or kill is a failure.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from rollout_service.rewards.base import REWARDS, EpisodeView, RewardResult
from rollout_service.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(timeout_s=10.0)

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(view: EpisodeView) -> str | None:
    """The program: a fenced block (python-tagged preferred) or the whole final answer."""
    for text in (view.final_answer, view.response_text):
        if not text or not text.strip():
            continue
        blocks = _FENCE.findall(text)
        tagged = [body for lang, body in blocks if lang]
        if tagged or blocks:
            return (tagged or [body for _, body in blocks])[-1]
        if text is view.final_answer:
            return text
    return None


def _tests(row: dict[str, Any]) -> str | None:
    tests = row.get("tests")
    extra = row.get("extra_info")
    if tests is None and isinstance(extra, dict):  # a verl row keeps its extras in extra_info
        tests = extra.get("tests")
    if isinstance(tests, str) and tests.strip():
        return tests
    if isinstance(tests, list | tuple) and tests and all(isinstance(t, str) for t in tests):
        return "\n".join(tests)
    return None


@REWARDS.register("code")
async def code_reward(view: EpisodeView, row: dict[str, Any]) -> RewardResult:
    extras: dict[str, float | int | str | bool] = {"passed": 0.0, "timed_out": 0.0}
    code, tests = extract_code(view), _tests(row)
    if tests is None:
        extras["reason"] = "row has no tests (a string or a list of strings)"
        return RewardResult(0.0, extras)
    if code is None:
        extras["reason"] = "no code found in the response"
        return RewardResult(0.0, extras)
    sentinel = secrets.token_hex(16)
    program = f"{code}\n\n# --- tests ---\n{tests}\n\nprint({sentinel!r})\n"
    res = await run_python(program, limits=LIMITS)
    passed = res.ok and sentinel in res.stdout
    extras.update(passed=float(passed), timed_out=float(res.timed_out))
    if not passed:
        extras["reason"] = (
            res.killed_reason or (res.stderr.strip().splitlines() or ["did not finish"])[-1][:200]
        )
    return RewardResult(float(passed), extras)
