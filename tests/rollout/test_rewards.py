"""Built-in rewards: math answer extraction and equivalence, SQuAD QA F1/EM, code tests."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_service.rewards import REWARDS, EpisodeView, load_builtin_rewards
from rollout_service.rewards.math_answer import last_boxed
from rollout_service.rewards.qa import normalize_answer, overlap

pytestmark = pytest.mark.anyio


def episode(text: str = "", final_answer: str | None = None) -> EpisodeView:
    return EpisodeView(
        response_text=text, final_answer=final_answer, messages=[], termination="stop", num_turns=1
    )


async def score(name: str, view: EpisodeView, row: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    res = await REWARDS.get(name)(view, row)
    return res.score, res.extras


def test_builtin_rewards_are_registered() -> None:
    assert {"math", "qa_f1", "qa_em", "code"} <= set(load_builtin_rewards().names())


def test_last_boxed_matches_nested_braces() -> None:
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\frac{1}{2") is None  # cut off inside the box
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    ("text", "final", "gold"),
    [
        (r"so the answer is \boxed{\frac{1}{2}}.", None, "0.5"),
        ("I computed 17 and then 42.", None, "42"),
        ("thinking...", r"\dfrac{\sqrt{2}}{2}", r"\frac{\sqrt2}{2}"),
        (r"\boxed{1,000}", None, "1000"),
        (r"\boxed{\pi/2}", None, r"\frac{\pi}{2}"),
        (r"\boxed{2\sqrt{2}}", None, r"\sqrt{8}"),
        (r"the boxed one wins: \boxed{3} not 4", None, "3"),
    ],
)
async def test_math_correct(text: str, final: str | None, gold: str) -> None:
    s, extras = await score("math", episode(text, final), {"answer": gold})
    assert s == 1.0 and extras["acc"] == 1.0 and extras["has_answer"] == 1.0


async def test_math_final_answer_wins_over_the_text() -> None:
    s, extras = await score("math", episode(r"\boxed{7}", final_answer="8"), {"answer": "8"})
    assert s == 1.0 and extras["answer_source"] == "final_answer"


@pytest.mark.parametrize(
    ("text", "gold"),
    [(r"\boxed{3}", "4"), (r"\boxed{\frac{1}{3}}", "0.33"), ("the answer is 41", "42")],
)
async def test_math_wrong(text: str, gold: str) -> None:
    s, extras = await score("math", episode(text), {"answer": gold})
    assert s == 0.0 and extras["acc"] == 0.0 and extras["has_answer"] == 1.0


@pytest.mark.parametrize(
    ("view", "row", "reason"),
    [
        (episode("no digits here"), {"answer": "1"}, "no answer"),
        (episode(r"\boxed{1}"), {}, "no reference"),
        (episode(r"\boxed{1}"), {"answer": None}, "no reference"),
        (episode(r"\boxed{" + "(" * 3000 + "}"), {"answer": "1"}, ""),
    ],
)
async def test_math_odd_input_scores_zero_without_raising(
    view: EpisodeView, row: dict[str, Any], reason: str
) -> None:
    s, extras = await score("math", view, row)
    assert s == 0.0
    assert reason in str(extras.get("reason", ""))


def test_squad_normalisation() -> None:
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a pear and THE fig.") == "apple pear and fig"


def test_overlap_f1() -> None:
    o = overlap("the big red barn", "red barn")
    assert o.precision == pytest.approx(2 / 3) and o.recall == 1.0 and o.f1 == pytest.approx(0.8)
    assert o.em == 0.0
    assert overlap("Yes", "no").f1 == 0.0
    assert overlap("no", "no way").f1 == 0.0  # yes/no only match themselves
    assert overlap("yes.", "YES").em == 1.0


async def test_qa_f1_takes_the_best_reference() -> None:
    s, extras = await score(
        "qa_f1",
        episode(final_answer="the Eiffel Tower in Paris"),
        {"answer": ["Paris", "Eiffel Tower"]},
    )
    assert s == pytest.approx(2 * (2 / 4) * 1 / (2 / 4 + 1))
    assert extras["recall"] == 1.0 and extras["em"] == 0.0


async def test_qa_em_with_normalisation_and_answer_tag() -> None:
    s, extras = await score(
        "qa_em", episode("reasoning\n<answer>The Beatles.</answer>"), {"answer": ["beatles"]}
    )
    assert s == 1.0 and extras["f1"] == 1.0 and extras["answer_source"] == "answer_tag"
    s, _ = await score("qa_em", episode(final_answer="Rolling Stones"), {"answer": "The Beatles"})
    assert s == 0.0


async def test_qa_missing_reference_or_answer() -> None:
    s, extras = await score("qa_f1", episode("x"), {})
    assert s == 0.0 and "no reference" in str(extras["reason"])
    s, extras = await score("qa_f1", episode(""), {"answer": "x"})
    assert s == 0.0 and "no answer" in str(extras["reason"])


GOOD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


@pytest.mark.integration
async def test_code_passes() -> None:
    s, extras = await score("code", episode(GOOD), {"tests": TESTS})
    assert s == 1.0 and extras["passed"] == 1.0 and extras["timed_out"] == 0.0


@pytest.mark.integration
async def test_code_from_final_answer_and_string_tests() -> None:
    s, _ = await score(
        "code",
        episode(final_answer="def add(a, b):\n    return a + b"),
        {"tests": "\n".join(TESTS)},
    )
    assert s == 1.0


@pytest.mark.integration
async def test_code_fails_wrong_solution() -> None:
    wrong = GOOD.replace("a + b", "a - b")
    s, extras = await score("code", episode(wrong), {"tests": TESTS})
    assert s == 0.0 and extras["passed"] == 0.0 and "AssertionError" in str(extras["reason"])


@pytest.mark.integration
async def test_code_early_exit_does_not_pass() -> None:
    cheat = "```python\nimport os\nos._exit(0)\n```"
    s, _ = await score("code", episode(cheat), {"tests": ["assert False"]})
    assert s == 0.0


@pytest.mark.integration
async def test_code_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_service.rewards import code as code_reward
    from rollout_service.sandbox import SandboxLimits

    monkeypatch.setattr(code_reward, "LIMITS", SandboxLimits(timeout_s=1.0))
    s, extras = await score("code", episode("```python\nwhile True: pass\n```"), {"tests": TESTS})
    assert s == 0.0 and extras["timed_out"] == 1.0 and extras["reason"] == "timeout"


@pytest.mark.parametrize(
    ("view", "row"),
    [
        (episode("no code"), {"tests": TESTS}),
        (episode(GOOD), {}),
        (episode(GOOD), {"tests": [1, 2]}),
    ],
)
async def test_code_odd_input_scores_zero(view: EpisodeView, row: dict[str, Any]) -> None:
    s, extras = await score("code", view, row)
    assert s == 0.0 and extras["reason"]
