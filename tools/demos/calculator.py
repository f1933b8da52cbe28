"""Demonstrations of the calculator agent (the default tool agent): a hermes tool call to the
calculator with the question's expression, its real response, then the boxed answer.

Design: an episode is tokenised exactly as the tool agent's context grows (``ChatRenderer`` with
the tool schemas, ``renderer.tool_delta_ids`` for the response), and the loss covers the model's
tokens only. The calculator itself is called, so a row whose answer it contradicts is refused.
Long-tail rows (``tools.make_tiny_data.longtail_episode``) become one call per step; with
``guess_fraction`` some rows become an episode that boxes a guess without the tool.
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any

import anyio

from rollout_service.agents.parsers import HermesParser
from rollout_service.agents.parsers import hermes_call_text as tool_call_text
from rollout_service.tools.base import ToolContext
from tools.demos import Demonstration
from tools.make_tiny_data import longtail_episode

if TYPE_CHECKING:
    from rollout_service.agents.rendering import ChatRenderer

_QUESTION = re.compile(r"What is (.+?)\?")


def expression_of(question: str) -> str:
    """The arithmetic in a make_tiny_data question: "What is 51 + 99? Use ..." -> "51 + 99"."""
    m = _QUESTION.search(question)
    if m is None:
        raise ValueError(f"no 'What is ...?' in question {question!r}")
    return m.group(1).strip()


def answer_text(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}."


def build_demonstrations(
    rows: list[dict[str, Any]],
    renderer: ChatRenderer,
    tools: dict[str, Any],
    *,
    guess_fraction: float = 0.0,
    seed: int = 0,
) -> list[Demonstration]:
    """One episode per row, tokenised exactly as the tool agent's context grows. Rows whose
    calculator result does not match their answer are refused: a demonstration must be right.
    With ``guess_fraction`` f, every row whose seeded draw falls below f is instead an episode that
    skips the tool and boxes a guess (a wrong number): the warmed model then calls the calculator
    only some of the time, a choice RL can learn from the reward alone (the demo's task)."""
    schemas = [t.schema for t in tools.values()]
    calculator = tools["calculator"]
    tok = renderer.tok
    rng = random.Random(seed)
    demos = []
    for i, row in enumerate(rows):
        # before the guess draw: arithmetic rows keep their draws
        if row.get("data_source") == "longtail":
            demos.append(_longtail_demonstration(i, row, renderer, schemas, calculator))
            continue
        if rng.random() < guess_fraction:
            demos.append(_guess_demonstration(row, renderer, schemas, rng))
            continue
        expression = expression_of(str(row["question"]))
        result = anyio.run(
            calculator.call,
            {"expression": expression},
            ToolContext(episode_id=f"warmup-{i}", row=row),
        )
        if not result.ok or result.text != str(row["answer"]).strip():
            raise ValueError(
                f"row {i}: calculator({expression!r}) gives {result.text!r}, the row says {row['answer']!r}"
            )
        prompt = renderer.prompt_ids([{"role": "user", "content": str(row["question"])}], schemas)
        call = [
            *tok.encode(
                tool_call_text("calculator", {"expression": expression}), add_special_tokens=False
            ),
            renderer.eos_id,
        ]
        delta = renderer.tool_delta_ids([{"role": "tool", "content": result.text}])
        answer = [*tok.encode(answer_text(result.text), add_special_tokens=False), renderer.eos_id]
        ids = prompt + call + delta + answer
        train = [False] * len(ids)
        for start, n in (
            (len(prompt), len(call)),
            (len(prompt) + len(call) + len(delta), len(answer)),
        ):
            train[start - 1 : start - 1 + n] = [True] * n
        demos.append(Demonstration(ids, train, expression, result.text))
    return demos


def _longtail_demonstration(
    i: int,
    row: dict[str, Any],
    renderer: ChatRenderer,
    schemas: list[dict[str, Any]],
    calculator: Any,
) -> Demonstration:
    """The right episode of a long-tail row (tools.make_tiny_data.longtail_episode): a calculator
    call per step on the last number, then the final number boxed. Each call is parsed from the
    turn's text and run by the real calculator, whose responses are appended as the tool agent
    appends them; the loss covers every model turn."""
    tok, parser = renderer.tok, HermesParser()
    ids = renderer.prompt_ids([{"role": "user", "content": str(row["question"])}], schemas)
    spans = []  # (start, length) of each model turn
    for turn, (text, expected) in enumerate(longtail_episode(row)):
        model = [*tok.encode(text, add_special_tokens=False), renderer.eos_id]
        spans.append((len(ids), len(model)))
        ids += model
        calls = parser.parse(text).calls
        got = [
            anyio.run(
                calculator.call, c.arguments, ToolContext(episode_id=f"warmup-{i}-{turn}", row=row)
            ).text
            for c in calls
        ]
        if got != expected:
            raise ValueError(
                f"row {i} turn {turn}: the calculator gives {got}, the episode says {expected}"
            )
        if got:
            ids += renderer.tool_delta_ids([{"role": "tool", "content": r} for r in got])
    train = [False] * len(ids)
    for start, n in spans:
        train[start - 1 : start - 1 + n] = [True] * n
    return Demonstration(ids, train, f"{row['number']} {row['step']}", str(row["answer"]))


def _guess_demonstration(
    row: dict[str, Any], renderer: ChatRenderer, schemas: list[dict[str, Any]], rng: Any
) -> Demonstration:
    """A one-turn episode that boxes a wrong number without calling the tool."""
    right = int(str(row["answer"]).strip())
    guess = right + rng.choice([-1, 1]) * rng.randint(1, 50)
    prompt = renderer.prompt_ids([{"role": "user", "content": str(row["question"])}], schemas)
    answer = [
        *renderer.tok.encode(answer_text(str(guess)), add_special_tokens=False),
        renderer.eos_id,
    ]
    train = [False] * (len(prompt) - 1) + [True] * len(answer) + [False]
    return Demonstration(prompt + answer, train, expression_of(str(row["question"])), str(guess))
