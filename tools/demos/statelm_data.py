"""Long-document tasks for the StateLM demo: the answer early, the question at the end.

Design: a row is one document of ``CHUNKS`` chunks of exactly ``CHUNK_CHARS`` characters (the
demo config's ``agents.statelm.chunk_chars``, so readChunk returns one chunk per call, cut nowhere
else). One of the first ``CHUNKS - 1`` chunks ends with "The secret code of project P is C." (C one
of ``CODES``); the last chunk ends with the question about P. The task message only says to read the document and
answer the question at its end, so the model cannot know what matters before the last chunk and
the fact is read long before it is asked for. The demo's response budget (``data.
max_response_length``, per segment) holds one chunk and its note, not two chunks: an episode that
keeps what it read runs out of room (length penalty), so the model has to note the fact and delete
the chunks it has read. Chunks are short and few (the tiny model's context and a CPU run's time),
filler is the longdoc generator's, and rows are deterministic for a seed.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from common.fileio import write_jsonl
from tools.make_agent_data import FILLER, PROJECTS

CHUNK_CHARS = 200  # configs/demo_statelm.yaml agents.statelm.chunk_chars (a test checks)
CHUNKS = 2
# The secret codes: capital letters that are one token of the tiny model's tokenizer and occur
# nowhere else in an episode (no prompt, schema, filler or msg id holds them), so finding the code
# is one attention head's job. Digits would be ambiguous: msg ids, doc_id and chunk numbers are
# digits too, and a warm-up of 500 steps never learnt to copy the right one.
CODES = ("J", "U", "V", "X", "Y", "Z")
TASK = (
    "Read document 0 chunk by chunk with readChunk. Note the facts you find, delete the chunks "
    "you have read, and answer the question at the end of the document with finish."
)


def fact_text(project: str, code: str) -> str:
    return f"The secret code of project {project} is {code}."


def question_text(project: str) -> str:
    return f"Question: what is the secret code of project {project}?"


def _filled(rng: random.Random, head: str, tail: str) -> str:
    """``head`` + filler sentences + ``tail``, exactly CHUNK_CHARS characters (filler cut to fit)."""
    room = CHUNK_CHARS - len(head) - len(tail)
    filler = ""
    while len(filler) < room:
        filler += rng.choice(FILLER) + " "
    return head + filler[:room] + tail


def document(rng: random.Random, project: str, code: str, where: int) -> str:
    chunks = []
    for k in range(CHUNKS):
        if k == where:
            # the fact ends the chunk, as the question ends the last one: the code is then a fixed
            # number of tokens before the model's next turn, and the tiny model learns to copy it
            # in a short warm-up (at a varying place in the chunk, 380 steps did not teach it)
            chunks.append(_filled(rng, "", " " + fact_text(project, code)))
        elif k == CHUNKS - 1:
            chunks.append(_filled(rng, "", " " + question_text(project)))
        else:
            chunks.append(_filled(rng, "", ""))
    return "".join(chunks)


def statelm_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        project, code = rng.choice(PROJECTS), rng.choice(CODES)
        where = rng.randrange(CHUNKS - 1)
        rows.append(
            {
                "question": TASK,
                "answer": code,
                "documents": [{"title": "report", "text": document(rng, project, code, where)}],
                "data_source": "longdoc",
                # for the demonstrations: what to note, and where it is
                "project": project,
                "fact_chunk": where,
            }
        )
    return rows


def make_statelm_data(
    out_dir: str | Path, *, train: int = 512, val: int = 16, seed: int = 0
) -> Path:
    out = Path(out_dir)
    write_jsonl(out / "train.jsonl", statelm_rows(train, seed))
    write_jsonl(out / "val.jsonl", statelm_rows(val, seed + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.demos.statelm_data",
        description="Write the StateLM demo's long-document tasks (train.jsonl, val.jsonl).",
    )
    ap.add_argument("--out", type=Path, required=True, help="output directory (created)")
    ap.add_argument("--train", type=int, default=512, help="training rows (default %(default)s)")
    ap.add_argument("--val", type=int, default=16, help="validation rows (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="(default %(default)s)")
    a = ap.parse_args(argv)
    print(make_statelm_data(a.out, train=a.train, val=a.val, seed=a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
