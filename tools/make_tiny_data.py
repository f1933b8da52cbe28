"""Tiny local datasets for tests and the demo: arithmetic questions with exact answers.

Design: generated, never downloaded, deterministic for a seed. Rows use the dataset format the
rollout server reads (``question``, ``answer``, ``data_source``; optional ``agent``), written as
JSONL, so the real loading code runs on them. The questions invite the calculator tool, which is
what the demo's tool agent learns to call.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

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


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8"), durable=False)


def make_tiny_data(out_dir: str | Path, *, train: int = 256, val: int = 32, seed: int = 0,
                   agents: bool = False) -> Path:
    """Arithmetic train.jsonl / val.jsonl; with ``agents``, also the longdoc/, code/ and qa/ sets
    of tools.make_agent_data (StateLM, code agent, search)."""
    out = Path(out_dir)
    write_jsonl(out / "train.jsonl", make_rows(train, seed))
    write_jsonl(out / "val.jsonl", make_rows(val, seed + 1))
    if agents:
        from tools.make_agent_data import make_agent_data

        make_agent_data(out, seed=seed)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make-tiny-data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for train.jsonl, val.jsonl and the agent sets")
    ap.add_argument("--train", type=int, default=256, help="training rows")
    ap.add_argument("--val", type=int, default=32, help="validation rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-agents", action="store_true",
                    help="skip the longdoc/, code/ and qa/ sets (StateLM, code agent, search)")
    args = ap.parse_args(argv)
    out = make_tiny_data(args.out, train=args.train, val=args.val, seed=args.seed, agents=not args.no_agents)
    print(f"wrote {out / 'train.jsonl'} ({args.train} rows) and {out / 'val.jsonl'} ({args.val} rows)")
    if not args.no_agents:
        print(f"wrote {out}/longdoc, {out}/code and {out}/qa (with corpus.jsonl) for the agent configs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
