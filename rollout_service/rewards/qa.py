"""The ``qa_f1`` and ``qa_em`` rewards: SQuAD-style answer overlap.

Design: prediction and references are normalised the SQuAD way (lowercase, punctuation and the
articles a/an/the removed, whitespace collapsed); F1 is the token-overlap F1, EM exact equality
of the normalised strings. A yes/no/noanswer answer only matches the same word (token overlap
would give partial credit to "no" against "yes no"). ``row["answer"]`` may be one string or a
list of acceptable answers: the best match counts. The prediction comes from the finish/answer
tool, else the last ``<answer>...</answer>`` or ``\\boxed{}``, else the response's last line.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rollout_service.rewards.base import REWARDS, EpisodeView, RewardResult
from rollout_service.rewards.math_answer import last_boxed

_SPECIAL = {"yes", "no", "noanswer"}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


@dataclass(frozen=True)
class Overlap:
    f1: float
    precision: float
    recall: float
    em: float


def overlap(prediction: str, gold: str) -> Overlap:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    em = float(pred == ref)
    if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
        return Overlap(0.0, 0.0, 0.0, em)
    pred_tokens, ref_tokens = pred.split(), ref.split()
    common = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if common == 0:
        return Overlap(0.0, 0.0, 0.0, em)
    precision, recall = common / len(pred_tokens), common / len(ref_tokens)
    return Overlap(2 * precision * recall / (precision + recall), precision, recall, em)


def extract_prediction(view: EpisodeView) -> tuple[str | None, str]:
    if view.final_answer is not None and view.final_answer.strip():
        return view.final_answer, "final_answer"
    tags = _ANSWER_TAG.findall(view.response_text)
    if tags:
        return tags[-1], "answer_tag"
    boxed = last_boxed(view.response_text)
    if boxed is not None:
        return boxed, "boxed"
    lines = [line for line in view.response_text.splitlines() if line.strip()]
    return (lines[-1], "last_line") if lines else (None, "none")


def _golds(row: dict[str, Any]) -> list[str]:
    answer = row.get("answer")
    if answer is None:
        return []
    if isinstance(answer, list | tuple):
        return [str(a) for a in answer if a is not None]
    return [str(answer)]


def best_overlap(view: EpisodeView, row: dict[str, Any]) -> tuple[Overlap | None, dict[str, Any]]:
    pred, source = extract_prediction(view)
    extras: dict[str, Any] = {
        "f1": 0.0,
        "em": 0.0,
        "precision": 0.0,
        "recall": 0.0,
        "answer_source": source,
    }
    golds = _golds(row)
    if not golds:
        extras["reason"] = "row has no reference answer"
        return None, extras
    if pred is None:
        extras["reason"] = "no answer found in the response"
        return None, extras
    best = max((overlap(pred, g) for g in golds), key=lambda o: (o.f1, o.em))
    em = max(overlap(pred, g).em for g in golds)  # EM may come from another reference than F1
    extras.update(f1=best.f1, em=em, precision=best.precision, recall=best.recall)
    return Overlap(best.f1, best.precision, best.recall, em), extras


@REWARDS.register("qa_f1")
async def qa_f1_reward(view: EpisodeView, row: dict[str, Any]) -> RewardResult:
    best, extras = best_overlap(view, row)
    return RewardResult(best.f1 if best else 0.0, extras)


@REWARDS.register("qa_em")
async def qa_em_reward(view: EpisodeView, row: dict[str, Any]) -> RewardResult:
    best, extras = best_overlap(view, row)
    return RewardResult(best.em if best else 0.0, extras)
