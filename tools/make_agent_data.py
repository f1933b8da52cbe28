"""Tiny generated datasets for the agents beyond arithmetic: long documents, code tasks, search QA.

Design: like make_tiny_data, generated and deterministic for a seed, in the row format the rollout
server reads, so the real loaders, agents, tools and rewards run on them:

- ``longdoc/``: StateLM tasks. Each row has ``documents`` (filler paragraphs with one fact hidden
  in one of them) and asks for the hidden number; the math reward checks the finish answer.
- ``code/``: code-agent tasks. "Write add_k(x) returning x + k" with ``tests`` (asserts) and
  ``reward_fn: code``, so the code reward runs the answer against the tests in the sandbox.
- ``qa/``: search questions whose answers are in ``corpus.jsonl`` (one fact per document, among
  distractors), scored by qa_f1; the search tool indexes the corpus with BM25.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from common.fileio import write_jsonl

PROJECTS = [
    "Falcon",
    "Heron",
    "Otter",
    "Lynx",
    "Marten",
    "Badger",
    "Kestrel",
    "Ibis",
    "Puffin",
    "Stoat",
]
FILLER = [
    "The committee met on a Tuesday and discussed the budget at length.",
    "Several reports were filed, none of them remarkable.",
    "Weather in the region was mild for the season.",
    "The archive holds letters, maps and a few photographs.",
    "Nobody remembers why the old bridge was painted green.",
]
FIRST = [
    "Ada",
    "Boris",
    "Chloe",
    "Dmitri",
    "Elena",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Luca",
]
LAST = ["Novak", "Okafor", "Petrov", "Quinn", "Rossi", "Sato", "Tanaka", "Umar", "Vega", "Weber"]
TOWNS = [
    "Arbor",
    "Brill",
    "Corve",
    "Dunmere",
    "Elst",
    "Fennick",
    "Galloway",
    "Harrow",
    "Istle",
    "Jarrow",
    "Kelby",
    "Lorne",
    "Marrow",
    "Nettle",
    "Orrin",
    "Pellam",
]


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(rng.choice(FILLER) for _ in range(sentences))


def longdoc_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        project, number = rng.choice(PROJECTS), rng.randint(1000, 9999)
        docs = [
            {"title": f"report {k}", "text": _paragraph(rng, rng.randint(8, 14))} for k in range(2)
        ]
        where = rng.randrange(2)
        text = docs[where]["text"].split(". ")
        text.insert(rng.randrange(len(text)), f"The secret number of project {project} is {number}")
        docs[where]["text"] = ". ".join(text)
        rows.append(
            {
                "question": f"What is the secret number of project {project}? Read the documents, "
                "note what you find, delete what you no longer need, then finish.",
                "answer": str(number),
                "documents": docs,
                "data_source": "longdoc",
            }
        )
    return rows


def code_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(2, 40)
        rows.append(
            {
                "question": f"Write a Python function add_k(x) that returns x + {k}. Test it in <code>, "
                "then give the function in <answer>.",
                "answer": f"def add_k(x):\n    return x + {k}",
                "tests": [
                    f"assert add_k(0) == {k}",
                    f"assert add_k(-{k}) == 0",
                    f"assert add_k(5) == {5 + k}",
                ],
                "reward_fn": "code",
                "data_source": "code",
            }
        )
    return rows


def qa_rows_and_corpus(n: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = random.Random(seed)
    corpus, rows = [], []
    for i, town in enumerate(TOWNS):
        founder = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        corpus.append(
            {
                "id": f"town-{i}",
                "title": town,
                "text": f"{town} is a small town. It was founded by {founder} in {rng.randint(1600, 1900)}.",
            }
        )
        rows.append(
            {
                "question": f"Who founded {town}? Use the search tool, then finish with the name.",
                "answer": founder,
                "data_source": "qa",
            }
        )
    for i in range(len(TOWNS)):
        corpus.append({"id": f"noise-{i}", "title": f"Note {i}", "text": _paragraph(rng, 3)})
    rng.shuffle(rows)
    return (rows * (n // len(rows) + 1))[:n], corpus


def make_agent_data(out_dir: str | Path, *, train: int = 64, val: int = 8, seed: int = 0) -> Path:
    """Write longdoc/, code/ and qa/ (train.jsonl, val.jsonl; qa/corpus.jsonl) under ``out_dir``."""
    out = Path(out_dir)
    for name, make in (("longdoc", longdoc_rows), ("code", code_rows)):
        write_jsonl(out / name / "train.jsonl", make(train, seed))
        write_jsonl(out / name / "val.jsonl", make(val, seed + 1))
    qa, corpus = qa_rows_and_corpus(train + val, seed)
    write_jsonl(out / "qa" / "train.jsonl", qa[:train])
    write_jsonl(out / "qa" / "val.jsonl", qa[train:])
    write_jsonl(out / "qa" / "corpus.jsonl", corpus)
    return out
