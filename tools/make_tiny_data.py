"""Tiny local datasets for tests and the demo: arithmetic questions with exact answers.

Design: generated, never downloaded, deterministic for a seed. Rows use the dataset format the
rollout server reads (``question``, ``answer``, ``data_source``; optional ``agent``), written as
JSONL, so the real loading code runs on them. The questions invite the calculator tool, which is
what the demo's tool agent learns to call.

The ``longtail`` set (bench/e2e.py's default workload) is a long-tailed multi-turn tool task: a
row adds (or subtracts) a number ``steps`` times, one calculator call per turn, and the tool
carries the count: the number packs the value and the steps left (value * 100 + steps left), so a
step is one addition (``+ 499``: value + 5, one step less) and the episode ends when the number
ends in 00, with that number boxed. ``steps`` is drawn per row from a lognormal
(``LongTailSpec``), so an episode's turns (steps + 1) and tokens have a heavy tail: p99 / median
>= 8. Every rule is local (copy the last tool response, append the step, stop at 00), so a tiny
model learns the format from a short warm-up and follows long chains to their end.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.fileio import write_jsonl

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice(sorted(OPS))
        rows.append(
            {
                "question": f"What is {a} {op} {b}? Use the calculator, then give the answer as \\boxed{{N}}.",
                "answer": str(OPS[op](a, b)),
                "data_source": "arithmetic",
            }
        )
    return rows


@dataclass(frozen=True)
class LongTailSpec:
    """Per-row draw of the long-tail set: steps = round(lognormal(ln steps_median, steps_sigma)),
    clipped to 1..steps_max.

    With the defaults an episode has median 3 turns, p90 9, p99 27 (steps + 1; 4,000 rows), and
    its response tokens (~37 a turn: the call and the tool's response) median ~95, p99 ~1,000:
    most episodes are short and a few are ten times longer, as in agentic and reasoning RL, where
    the number of tool calls and the length of the reasoning vary by an order of magnitude between
    the tasks of one batch."""

    steps_median: float = 2.0
    steps_sigma: float = 1.1
    steps_max: int = 31


PACK = 100
"""A number packs its value and the steps left as value * PACK + steps left (steps_max < PACK)."""
LONGTAIL_TASK = (
    "A number packs a value and the steps left as value * 100 + steps left. Each turn, apply the "
    "step to the number with one calculator call. When the number ends in 00, no steps are left: "
    "give it as \\boxed{N}."
)
"""The fixed part of every long-tail question, first: the warm-up computes a prefix all its
demonstrations share once per step, so only the row's numbers cost per example."""


def make_longtail_rows(
    n: int, seed: int, spec: LongTailSpec = LongTailSpec()
) -> list[dict[str, Any]]:
    """Rows of the long-tail set (module docstring): ``number`` = value * PACK + steps and the
    ``step`` (``+ operand * PACK - 1`` or ``- (operand * PACK + 1)``) that applies one step; the
    answer is the value after ``steps`` steps, times PACK."""
    if spec.steps_max >= PACK:
        raise ValueError(f"steps_max must be below {PACK}")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        steps = min(
            spec.steps_max,
            max(1, round(rng.lognormvariate(math.log(spec.steps_median), spec.steps_sigma))),
        )
        op, operand = rng.choice("+-"), rng.randint(2, 9)
        value = rng.randint(10, 99) + (steps * operand if op == "-" else 0)  # never below 10
        step = f"+ {operand * PACK - 1}" if op == "+" else f"- {operand * PACK + 1}"
        number = value * PACK + steps
        final = (value + steps * operand if op == "+" else value - steps * operand) * PACK
        question = f"{LONGTAIL_TASK} Number {number}, step {step}."
        rows.append(
            {
                "question": question,
                "answer": str(final),
                "data_source": "longtail",
                "number": number,
                "step": step,
                "steps": steps,
            }
        )
    return rows


def longtail_episode(row: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The right episode of a long-tail row: (assistant text, the tool responses that follow it)
    per turn, the last turn without tools. Each of the ``steps`` turns calls the calculator on
    "<the last number> <step>"; once the number ends in 00 the last turn boxes it. Every turn
    copies the number of the tool response just before it, and stopping is a look at its last two
    digits: rules a tiny model learns from a short warm-up, whatever the episode's length.
    tools/warmup.py demonstrates it (calling the real calculator); the tests measure the set's
    budgets with it."""
    # lazy: this module is bin/make-tiny-data's command line, whose --help stays instant
    from rollout_service.agents.parsers import hermes_call_text

    number, step, steps = int(row["number"]), str(row["step"]), int(row["steps"])
    sign, amount = step.split()
    turns: list[tuple[str, list[str]]] = []
    for _ in range(steps):
        nxt = number + int(amount) if sign == "+" else number - int(amount)
        turns.append(
            (hermes_call_text("calculator", {"expression": f"{number} {step}"}), [str(nxt)])
        )
        number = nxt
    turns.append((f"The answer is \\boxed{{{number}}}.", []))
    return turns


def make_tiny_data(
    out_dir: str | Path,
    *,
    train: int = 256,
    val: int = 32,
    seed: int = 0,
    agents: bool = False,
    longtail: bool = False,
) -> Path:
    """Arithmetic train.jsonl / val.jsonl; with ``agents``, also the longdoc/, code/ and qa/ sets
    of tools.make_agent_data (StateLM, code agent, search); with ``longtail``, longtail/."""
    out = Path(out_dir)
    write_jsonl(out / "train.jsonl", make_rows(train, seed))
    write_jsonl(out / "val.jsonl", make_rows(val, seed + 1))
    if longtail:
        make_longtail_data(out / "longtail", train=train, val=val, seed=seed)
    if agents:
        # lazy: this module is bin/make-tiny-data's command line, whose --help stays instant
        from tools.make_agent_data import make_agent_data

        make_agent_data(out, seed=seed)
    return out


LONGTAIL_WARMUP = LongTailSpec(steps_median=6.0, steps_sigma=0.8)
"""The warm-up's rows: more long chains than the workload (median 6 steps, 18% of 13 or more), so
that the warmed model copies every count of steps left, not only the common small ones, and
follows the workload's rare long episodes to their end (the model learns the format here; the RL
rows keep ``LongTailSpec``'s distribution)."""


def make_longtail_data(
    out_dir: str | Path, *, train: int = 256, val: int = 32, seed: int = 0
) -> Path:
    """The long-tail set: ``out_dir``/train.jsonl and val.jsonl, and warmup.jsonl for tools/warmup.py
    (``LONGTAIL_WARMUP``)."""
    out = Path(out_dir)
    write_jsonl(out / "train.jsonl", make_longtail_rows(train, seed))
    write_jsonl(out / "val.jsonl", make_longtail_rows(val, seed + 1))
    write_jsonl(out / "warmup.jsonl", make_longtail_rows(train, seed + 2, LONGTAIL_WARMUP))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="make-tiny-data", description=(__doc__ or "").split("\n\n")[0]
    )
    ap.add_argument(
        "--out", required=True, help="directory for train.jsonl, val.jsonl and the agent sets"
    )
    ap.add_argument("--train", type=int, default=256, help="training rows")
    ap.add_argument("--val", type=int, default=32, help="validation rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-agents",
        action="store_true",
        help="skip the longdoc/, code/ and qa/ sets (StateLM, code agent, search)",
    )
    ap.add_argument(
        "--no-longtail",
        action="store_true",
        help="skip the longtail/ set (bench/e2e.py's workload)",
    )
    args = ap.parse_args(argv)
    out = make_tiny_data(
        args.out,
        train=args.train,
        val=args.val,
        seed=args.seed,
        agents=not args.no_agents,
        longtail=not args.no_longtail,
    )
    print(
        f"wrote {out / 'train.jsonl'} ({args.train} rows) and {out / 'val.jsonl'} ({args.val} rows)"
    )
    if not args.no_longtail:
        print(
            f"wrote {out}/longtail (multi-turn calculator chains with long-tailed lengths: bench/e2e.py)"
        )
    if not args.no_agents:
        print(
            f"wrote {out}/longdoc, {out}/code and {out}/qa (with corpus.jsonl) for the agent configs"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
