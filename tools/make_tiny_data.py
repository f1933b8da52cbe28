"""Tiny local datasets for tests and the demo: arithmetic questions with exact answers.

Design: generated, never downloaded, deterministic for a seed. Rows use the dataset format the
rollout server reads (``question``, ``answer``, ``data_source``; optional ``agent``), written as
JSONL, so the real loading code runs on them. The questions invite the calculator tool, which is
what the demo's tool agent learns to call.

The ``longtail`` set (bench/e2e.py's default workload) is a long-tailed multi-turn tool task: a
row asks to add (or subtract) ``operand`` ``steps`` times from ``start``, one step per turn, each
turn thinking for ``think`` counts and then calling the calculator twice, for the value and for
the steps left; the answer is boxed once the steps left reach 0. ``steps`` and ``think`` are drawn
per row from lognormals (``LongTailSpec``), so an episode's turns (steps + 1) and its tokens
(about 80 per turn: calls, tool responses, thinking) have a heavy tail: p99 / median >= 8.
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
    """Per-row draws of the long-tail set: round(lognormal(ln median, sigma)), clipped.

    With the defaults an episode has median 3 turns, p90 9, p99 27 (steps + 1; 4,000 rows): most
    episodes are short and a few are ten times longer, as in agentic and reasoning RL, where the
    number of tool calls and the length of the reasoning vary by an order of magnitude between
    tasks of one batch. ``think`` is the thinking budget of every turn of a row."""

    steps_median: float = 2.0
    steps_sigma: float = 1.1
    steps_max: int = 31
    think_median: float = 2.0
    think_sigma: float = 0.8
    think_max: int = 9  # a countdown of single digits: "Think: 3 2 1 0."


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def make_longtail_rows(n: int, seed: int, spec: LongTailSpec = LongTailSpec()) -> list[dict[str, Any]]:
    """Rows of the long-tail set (module docstring); the answer is ``start op steps * operand``."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        steps = _lognormal_int(rng, spec.steps_median, spec.steps_sigma, 1, spec.steps_max)
        think = _lognormal_int(rng, spec.think_median, spec.think_sigma, 0, spec.think_max)
        op, operand = rng.choice("+-"), rng.randint(2, 19)
        start = rng.randint(10, 99) + (steps * operand if op == "-" else 0)  # never below 10
        answer = start + steps * operand if op == "+" else start - steps * operand
        verb = "Add" if op == "+" else "Subtract"
        question = (f"Start at {start}. {verb} {operand}, {steps} times. Each turn: think {think}, then call the "
                    f"calculator for the value ({start} {op} {operand}) and for the steps left ({steps} - 1). "
                    f"When no steps are left, give the value as \\boxed{{N}}.")
        rows.append({"question": question, "answer": str(answer), "data_source": "longtail", "start": start,
                     "op": op, "operand": operand, "steps": steps, "think": think})
    return rows


def longtail_episode(row: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The right episode of a long-tail row: (assistant text, the tool responses that follow it)
    per turn, the last turn without tools. tools/warmup.py demonstrates it (calling the real
    calculator); the tests measure the set's budgets with it."""
    from tools.warmup import tool_call_text

    start, op, operand = int(row["start"]), str(row["op"]), int(row["operand"])
    steps, think = int(row["steps"]), int(row["think"])
    thought = "Think: " + " ".join(str(j) for j in range(think, -1, -1)) + ".\n"
    turns: list[tuple[str, list[str]]] = []
    value = start
    for left in range(steps, 0, -1):
        nxt = value + operand if op == "+" else value - operand
        calls = (tool_call_text("calculator", {"expression": f"{value} {op} {operand}"}) + "\n"
                 + tool_call_text("calculator", {"expression": f"{left} - 1"}))
        turns.append((thought + calls, [str(nxt), str(left - 1)]))
        value = nxt
    turns.append((thought + f"The answer is \\boxed{{{value}}}.", []))
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
        print(f"wrote {out}/longtail (multi-turn calculator chains with long-tailed lengths)")
    if not args.no_agents:
        print(f"wrote {out}/longdoc, {out}/code and {out}/qa (with corpus.jsonl) for the agent configs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
