"""Data of the mixed demo: arithmetic, search QA and computation tasks, one folder per source.

Design: the three generators that already exist, each row labelled with its source and agent so
training (configs/demo_mixed.yaml names the sources), validation (one file, each row's own
``data_source`` and ``agent``) and the warm-up (``bin/warmup --agent mixed``, one file in the
batch's proportions) read the same rows:
- ``arithmetic/``: tools.make_tiny_data's questions ("What is 51 + 99? Use the calculator, ...");
  the tool agent with the calculator, the math reward on the boxed number;
- ``qa/``: tools.make_agent_data's search questions ("Who founded Arbor? Use the search tool, then
  finish with the name.") and their corpus (one town per document, among distractors); the tool
  agent with search on the tool server, the qa_f1 reward on the finish answer;
- ``code/``: tools.demos.code_data's computations ("What is 64 ** 7 % 40? ..."); the code agent,
  its python on the tool server, the math reward on the answer.
``warmup.jsonl`` interleaves the three in the 4/3/3 proportion of a training batch,
``warmup-tools.jsonl`` holds its tool-agent rows (arithmetic and qa) and ``warmup-code.jsonl`` its
code rows: demonstrations of one agent share their long prompt prefix (the tool schemas), which the
warm-up computes once per step, so warming up on each agent's rows apart costs a fraction of the
mix. ``val.jsonl`` holds every source's validation rows.

    python -m tools.demos.mixed_data --out runs/demo-mixed-data
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from common.fileio import write_jsonl
from tools.demos.code_data import compute_rows
from tools.make_agent_data import qa_rows_and_corpus
from tools.make_tiny_data import make_rows

SOURCES = {"arithmetic": "tool_agent", "qa": "tool_agent", "code": "code"}
"""source name (the config's dataset name and each row's data_source) -> agent type"""
PATTERN = ("arithmetic", "qa", "code", "arithmetic", "qa", "code", "arithmetic", "qa", "code")
"""The warm-up file's order, then one more arithmetic row: 4/3/3 in every 10 rows."""


def _label(rows: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    return [{**r, "data_source": source, "agent": SOURCES[source]} for r in rows]


def source_rows(n: int, seed: int, qa: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {
        "arithmetic": _label(make_rows(n, seed), "arithmetic"),
        "qa": _label(qa, "qa"),
        "code": _label(compute_rows(n, seed), "code"),
    }


def interleave(by_source: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows in the 4/3/3 proportion of a batch, until a source runs out."""
    cursors = dict.fromkeys(by_source, 0)
    out: list[dict[str, Any]] = []
    while True:
        for source in (*PATTERN, "arithmetic"):
            if cursors[source] >= len(by_source[source]):
                return out
            out.append(by_source[source][cursors[source]])
            cursors[source] += 1


def make_mixed_data(out_dir: str | Path, *, train: int = 256, val: int = 8, seed: int = 0) -> Path:
    out = Path(out_dir)
    # One corpus: the search questions of both splits are about its towns.
    qa, corpus = qa_rows_and_corpus(train + val, seed)
    train_rows = source_rows(train, seed, qa[:train])
    val_rows = source_rows(val, seed + 1, qa[train:])
    for source in SOURCES:
        write_jsonl(out / source / "train.jsonl", train_rows[source])
    write_jsonl(out / "qa" / "corpus.jsonl", corpus)
    write_jsonl(out / "val.jsonl", [r for source in SOURCES for r in val_rows[source]])
    mixed = interleave(train_rows)
    write_jsonl(out / "warmup.jsonl", mixed)
    write_jsonl(out / "warmup-tools.jsonl", [r for r in mixed if r["agent"] == "tool_agent"])
    write_jsonl(out / "warmup-code.jsonl", [r for r in mixed if r["agent"] == "code"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.demos.mixed_data",
        description="Write the mixed demo's data: arithmetic/, qa/ (with corpus.jsonl), code/, "
        "val.jsonl and warmup.jsonl.",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory (created)")
    p.add_argument(
        "--train", type=int, default=256, help="train rows per source (default %(default)s)"
    )
    p.add_argument(
        "--val", type=int, default=8, help="validation rows per source (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="(default %(default)s)")
    a = p.parse_args(argv)
    out = make_mixed_data(a.out, train=a.train, val=a.val, seed=a.seed)
    print(f"wrote {out}: arithmetic/, qa/, code/, val.jsonl, warmup*.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
