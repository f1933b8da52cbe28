"""Tiny local datasets for tests and the demo: arithmetic questions with exact answers.

Design: generated, never downloaded, deterministic for a seed. Rows use the dataset format the
rollout server reads (``question``, ``answer``, ``data_source``; optional ``agent``), written as
JSONL, so the real loading code runs on them. The questions invite the calculator tool, which is
what the demo's tool agent learns to call.

The ``longtail`` set (bench/e2e.py's default workload) is a long-tailed multi-turn tool task: a
row asks to add (or subtract) ``operand`` ``steps`` times from ``start``, one step per turn; each
turn first thinks by counting down the steps left ("Think: 3 2 1 0.") and then calls the
calculator for the new value; at "Think: 0." the value is boxed. ``steps`` is drawn per row from a
lognormal (``LongTailSpec``), so an episode's turns (steps + 1) and its tokens (the thinking of a
turn grows with the steps left) have a heavy tail: p99 / median >= 8. Every rule is local (the
countdown decrements, a turn's first count is one less than the previous turn's, the value comes
from the last tool response), so a tiny model learns the format from a short warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.fileio import atomic_write_bytes

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice(sorted(OPS))
        rows.append({"question": f"What is {a} {op} {b}? Use the calculator, then give the answer as \\boxed{{N}}.",
                     "answer": str(OPS[op](a, b)), "data_source": "arithmetic"})
    return rows


@dataclass(frozen=True)
class LongTailSpec:
    """Per-row draw of the long-tail set: steps = round(lognormal(ln steps_median, steps_sigma)),
    clipped to 1..steps_max.

    With the defaults an episode has median 3 turns, p90 9, p99 27 (steps + 1; 4,000 rows), and its
    response tokens (each turn thinks by counting down the steps left, so tokens grow about as
    steps squared) median ~120, p99 ~2,000: most episodes are short and a few are ten or more
    times longer, as in agentic and reasoning RL, where the number of tool calls and the length of
    the reasoning vary by an order of magnitude between the tasks of one batch."""

    steps_median: float = 2.0
    steps_sigma: float = 1.1
    steps_max: int = 31


LONGTAIL_TASK = ("Apply the step to the value, one step per turn: first think by counting down the steps left "
                 "to 0, then call the calculator for the new value (value step). When no steps are left, give "
                 "the value as \\boxed{N}.")
"""The fixed part of every long-tail question, first: the warm-up computes a prefix all its
demonstrations share once per step, so only the row's numbers cost per example."""


def make_longtail_rows(n: int, seed: int, spec: LongTailSpec = LongTailSpec()) -> list[dict[str, Any]]:
    """Rows of the long-tail set (module docstring); the answer is ``start op steps * operand``."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        steps = min(spec.steps_max, max(1, round(rng.lognormvariate(math.log(spec.steps_median), spec.steps_sigma))))
        op, operand = rng.choice("+-"), rng.randint(2, 9)
        start = rng.randint(10, 99) + (steps * operand if op == "-" else 0)  # never below 10
        answer = start + steps * operand if op == "+" else start - steps * operand
        question = f"{LONGTAIL_TASK} Value {start}, step {op} {operand}, steps {steps}."
        rows.append({"question": question, "answer": str(answer), "data_source": "longtail", "start": start,
                     "op": op, "operand": operand, "steps": steps})
    return rows


def longtail_episode(row: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The right episode of a long-tail row: (assistant text, the tool responses that follow it)
    per turn, the last turn without tools. Turn i (of steps + 1) thinks "Think: L L-1 ... 0." for
    the L = steps + 1 - i steps left, then calls the calculator for the new value; at "Think: 0."
    it boxes the value. tools/warmup.py demonstrates it (calling the real calculator); the tests
    measure the set's budgets with it."""
    from tools.warmup import tool_call_text

    start, op, operand, steps = int(row["start"]), str(row["op"]), int(row["operand"]), int(row["steps"])
    turns: list[tuple[str, list[str]]] = []
    value = start
    for left in range(steps, -1, -1):
        thought = "Think: " + " ".join(str(j) for j in range(left, -1, -1)) + ".\n"
        if left == 0:
            turns.append((thought + f"The answer is \\boxed{{{value}}}.", []))
            break
        nxt = value + operand if op == "+" else value - operand
        turns.append((thought + tool_call_text("calculator", {"expression": f"{value} {op} {operand}"}), [str(nxt)]))
        value = nxt
    return turns


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8"), durable=False)


def make_tiny_data(out_dir: str | Path, *, train: int = 256, val: int = 32, seed: int = 0,
                   agents: bool = False, longtail: bool = False) -> Path:
    """Arithmetic train.jsonl / val.jsonl; with ``agents``, also the longdoc/, code/ and qa/ sets
    of tools.make_agent_data (StateLM, code agent, search); with ``longtail``, longtail/."""
    out = Path(out_dir)
    write_jsonl(out / "train.jsonl", make_rows(train, seed))
    write_jsonl(out / "val.jsonl", make_rows(val, seed + 1))
    if longtail:
        make_longtail_data(out / "longtail", train=train, val=val, seed=seed)
    if agents:
        from tools.make_agent_data import make_agent_data

        make_agent_data(out, seed=seed)
    return out


def make_longtail_data(out_dir: str | Path, *, train: int = 256, val: int = 32, seed: int = 0) -> Path:
    """The long-tail set: ``out_dir``/train.jsonl and val.jsonl."""
    out = Path(out_dir)
    write_jsonl(out / "train.jsonl", make_longtail_rows(train, seed))
    write_jsonl(out / "val.jsonl", make_longtail_rows(val, seed + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make-tiny-data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for train.jsonl, val.jsonl and the agent sets")
    ap.add_argument("--train", type=int, default=256, help="training rows")
    ap.add_argument("--val", type=int, default=32, help="validation rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-agents", action="store_true",
                    help="skip the longdoc/, code/ and qa/ sets (StateLM, code agent, search)")
    ap.add_argument("--no-longtail", action="store_true", help="skip the longtail/ set (bench/e2e.py's workload)")
    args = ap.parse_args(argv)
    out = make_tiny_data(args.out, train=args.train, val=args.val, seed=args.seed, agents=not args.no_agents,
                         longtail=not args.no_longtail)
    print(f"wrote {out / 'train.jsonl'} ({args.train} rows) and {out / 'val.jsonl'} ({args.val} rows)")
    if not args.no_longtail:
        print(f"wrote {out}/longtail (multi-turn calculator chains with long-tailed lengths: bench/e2e.py)")
    if not args.no_agents:
        print(f"wrote {out}/longdoc, {out}/code and {out}/qa (with corpus.jsonl) for the agent configs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
