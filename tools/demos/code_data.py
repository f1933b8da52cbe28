"""Computation tasks for the code-agent demo: the answer needs a program, not a copy.

Design: like tools/make_tiny_data, generated and deterministic for a seed, in the row format the
rollout server reads. A row asks for the value of a Python expression (``7 ** 5``, ``614 % 37``)
that a tiny model cannot compute in its head but can copy into ``print(...)`` between the code tags; the sandbox prints the number and the model copies it
between the answer tags. The ``math`` reward compares the answer with the row's ``answer``
(computed here by Python itself). The question names no tags: the code agent's system prompt
names the configured ones, so a config with custom tags needs no other data.

    python -m tools.demos.code_data --out runs/demo-code-data   # train.jsonl, val.jsonl
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from common.fileio import write_jsonl

FORMS = ("{a} ** {k}", "{x} % {c}")
QUESTION = "What is {expr}? Compute it with Python, then give the number as the answer."
DATA_SOURCE = "compute"


def expression(rng: random.Random) -> str:
    form = rng.choice(FORMS)
    # Short to copy (two numbers, like the calculator demo's), impossible to guess: a power of up
    # to 6 digits, or the remainder of a 3-digit number.
    return form.format(
        a=rng.randint(2, 9), k=rng.randint(3, 6), x=rng.randint(100, 999), c=rng.randint(7, 97)
    )


def compute_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        expr = expression(rng)
        value = eval(expr, {"__builtins__": {}})  # our own arithmetic: digits and operators only
        rows.append(
            {
                "question": QUESTION.format(expr=expr),
                "answer": str(value),
                "expression": expr,
                "data_source": DATA_SOURCE,
            }
        )
    return rows


def make_code_data(out_dir: str | Path, *, train: int = 512, val: int = 32, seed: int = 0) -> Path:
    out = Path(out_dir)
    write_jsonl(out / "train.jsonl", compute_rows(train, seed))
    write_jsonl(out / "val.jsonl", compute_rows(val, seed + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.demos.code_data",
        description="Write the code demo's computation tasks (train.jsonl, val.jsonl).",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory (created)")
    p.add_argument("--train", type=int, default=512, help="train rows (default %(default)s)")
    p.add_argument("--val", type=int, default=32, help="validation rows (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default %(default)s)")
    a = p.parse_args(argv)
    out = make_code_data(a.out, train=a.train, val=a.val, seed=a.seed)
    print(f"wrote {out}/train.jsonl and {out}/val.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
