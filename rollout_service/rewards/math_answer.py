"""The ``math`` reward: is the model's final answer mathematically equal to the reference?

Design: the answer is taken from the finish/answer tool if the episode used one, else from the
last ``\\boxed{...}`` (braces matched, so ``\\boxed{\\frac{1}{2}}`` survives), else the last number
in the response. Equivalence is decided by math-verify (LaTeX/expression parsing into sympy, so
``\\frac12``, ``0.5`` and ``1/2`` agree) with a normalised string/number comparison as the
fallback. math-verify runs in a worker thread (sympy can be slow) with its signal-based timeouts
off, since signals only work in the main thread; the thread is abandoned past ``VERIFY_TIMEOUT_S``
and the fallback decides. math-verify is imported lazily: it pulls in sympy and antlr.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

import anyio
import anyio.to_thread

from rollout_service.rewards.base import REWARDS, EpisodeView, RewardResult

VERIFY_TIMEOUT_S = 5.0
MAX_ANSWER_CHARS = 400  # longer "answers" are not worth giving to sympy (antlr is slow on them)

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), matching nested braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: the response was cut off inside the box


def extract_answer(view: EpisodeView) -> tuple[str | None, str]:
    """The answer and where it came from: final_answer, boxed, last_number or none."""
    if view.final_answer is not None and view.final_answer.strip():
        return view.final_answer.strip(), "final_answer"
    boxed = last_boxed(view.response_text)
    if boxed is not None and boxed.strip():
        return boxed.strip(), "boxed"
    numbers = _NUMBER.findall(view.response_text)
    if numbers:
        return numbers[-1], "last_number"
    return None, "none"


def normalize(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\[,!;: ]|\\left|\\right", "", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"(\d),(\d{3})\b", r"\1\2", text)  # thousands separators
    return re.sub(r"\s+", "", text).rstrip(".").lower()


def _as_number(text: str) -> Fraction | float | None:
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?\d+)/(-?\d+)", text)
    try:
        if m:
            num, den = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            return Fraction(int(num), int(den))
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def fallback_equal(pred: str, gold: str) -> bool:
    """Normalised string equality, or numeric equality to a relative 1e-6."""
    p, g = normalize(pred), normalize(gold)
    if p == g:
        return True
    pn, gn = _as_number(p), _as_number(g)
    if pn is None or gn is None:
        return False
    return math.isclose(float(pn), float(gn), rel_tol=1e-6, abs_tol=1e-9)


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    # A bare LaTeX answer ("\sqrt{2}/2") is only found inside math delimiters.
    for candidate in (f"${text}$", text, f"\\boxed{{{text}}}"):
        parsed = parse(candidate, parsing_timeout=None)  # type: ignore[arg-type]
        if parsed:
            return parsed
    return []


def verify_equal(pred: str, gold: str) -> bool:
    """math-verify's verdict; blocking, for a worker thread."""
    from math_verify import verify

    gold_parsed, pred_parsed = _parse(gold), _parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


async def _verify(pred: str, gold: str) -> tuple[bool, str]:
    with anyio.move_on_after(VERIFY_TIMEOUT_S):
        try:
            ok = await anyio.to_thread.run_sync(verify_equal, pred, gold, abandon_on_cancel=True)
            return ok, ""
        except Exception as e:  # math-verify is a heuristic parser; its failures are not ours
            return False, f"math_verify: {type(e).__name__}: {e}"[:200]
    return False, "math_verify timed out"


@REWARDS.register("math")
async def math_reward(view: EpisodeView, row: dict[str, Any]) -> RewardResult:
    gold = row.get("answer")
    pred, source = extract_answer(view)
    extras: dict[str, float | int | str | bool] = {
        "acc": 0.0,
        "has_answer": float(pred is not None),
        "answer_source": source,
    }
    if gold is None or str(gold).strip() == "":
        extras["reason"] = "row has no reference answer"
        return RewardResult(0.0, extras)
    if pred is None:
        extras["reason"] = "no answer found in the response"
        return RewardResult(0.0, extras)
    pred, gold_text = pred[:MAX_ANSWER_CHARS], str(gold)[:MAX_ANSWER_CHARS]
    correct = fallback_equal(pred, gold_text)
    if not correct:
        correct, note = await _verify(pred, gold_text)
        if note:
            extras["reason"] = note
    extras["acc"] = float(correct)
    return RewardResult(float(correct), extras)
