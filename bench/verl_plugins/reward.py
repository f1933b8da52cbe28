"""Our math reward as a verl reward function (``reward.custom_reward_function.path``).

verl passes the decoded response, tool outputs included (they are part of its response tokens,
masked out of the loss); ours scores the assistant turns only. The answer is the last ``\\boxed{}``
either way (tool outputs hold no box), compared with the same checks as ``math_reward``
(``fallback_equal``, then math-verify). Ours also falls back to the response's last number when
there is no box; here that number could be a tool output, so a response without a box scores 0.
"""

from __future__ import annotations

from typing import Any

from rollout_service.rewards.math_answer import (
    MAX_ANSWER_CHARS,
    fallback_equal,
    last_boxed,
    verify_equal,
)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    **kwargs: Any,
) -> float:
    pred = last_boxed(solution_str)
    if pred is None or not pred.strip() or ground_truth is None:
        return 0.0
    pred, gold = pred.strip()[:MAX_ANSWER_CHARS], str(ground_truth)[:MAX_ANSWER_CHARS]
    if fallback_equal(pred, gold):
        return 1.0
    try:
        return float(verify_equal(pred, gold))
    except Exception:  # math-verify is a heuristic parser: its failure is a miss
        return 0.0
