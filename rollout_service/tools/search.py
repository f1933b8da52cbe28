"""The ``search`` tool: BM25 over a local JSONL corpus, passages numbered for the model to cite.

Design: the corpus (one JSON object per line: ``text``, optional ``title`` and ``id``) is read and
indexed with ``bm25s`` once, when the tool is made; a bad line fails then, naming the file and the
line. Indexes are cached per (path, mtime, size) in the process, so every factory call for one file
(several agent types, several tool sets) shares one index, and an edited file is re-read. Scoring
runs in a worker thread so a large corpus never stalls the event loop. A query that matches no
indexed word is a successful call that says so: the model should rephrase, not count a failure.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import anyio.to_thread

from rollout_service.tools.base import TOOLS, ToolContext, ToolResult, function_schema, invalid_args

MAX_TOP_K = 20  # largest top_k a call may ask for, unless the configured default is larger
_STOPWORDS = "en"


@dataclass(frozen=True)
class Document:
    text: str
    title: str = ""
    id: str = ""


class SearchIndex:
    """A BM25 index over the documents of one corpus file; ``search`` is thread-safe (read-only)."""

    def __init__(self, documents: list[Document]) -> None:
        # Imported here: bm25s pulls in numba (~0.4 s), which only a process that searches needs.
        import bm25s

        # bm25s sets its logger to DEBUG at import, which would send index-building chatter
        # through this process's handlers; only its warnings are worth a log line.
        logging.getLogger("bm25s").setLevel(logging.WARNING)
        self._tokenize = bm25s.tokenize
        self.documents = documents
        # The title is indexed with the text: a query naming the subject should find its page.
        texts = [f"{d.title}\n{d.text}" if d.title else d.text for d in documents]
        tokens = self._tokenize(texts, stopwords=_STOPWORDS, show_progress=False)
        self._bm25 = bm25s.BM25()
        self._bm25.index(tokens, show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[Document, float]]:
        """The best ``k`` documents with a positive score, best first."""
        import numpy as np

        words = cast(
            list[str],
            self._tokenize(query, stopwords=_STOPWORDS, show_progress=False, return_ids=False)[0],
        )
        ids = self._bm25.get_tokens_ids(words)  # words the corpus never uses are dropped
        if not ids:
            return []
        scores = np.asarray(self._bm25.get_scores_from_ids(ids))
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(self.documents[i], float(scores[i])) for i in top if scores[i] > 0]


def load_corpus(path: Path) -> list[Document]:
    """Read a JSONL corpus; a bad line raises ValueError naming the file and the line number."""
    documents: list[Document] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ValueError(f"search corpus {path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"search corpus {path}: cannot read: {exc}") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"search corpus {path}, line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg}, column {exc.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{where}: must be a JSON object with a 'text' field, got {type(row).__name__}"
            )
        text, title, doc_id = row.get("text"), row.get("title", ""), row.get("id", "")
        if not isinstance(text, str):
            raise ValueError(f"{where}: field 'text' must be a string, got {type(text).__name__}")
        if not isinstance(title, str | None):
            raise ValueError(f"{where}: field 'title' must be a string, got {type(title).__name__}")
        if isinstance(doc_id, bool) or not isinstance(doc_id, str | int | None):
            raise ValueError(
                f"{where}: field 'id' must be a string or an integer, got {type(doc_id).__name__}"
            )
        documents.append(
            Document(text=text, title=title or "", id="" if doc_id is None else str(doc_id))
        )
    if not documents:
        raise ValueError(f"search corpus {path}: no documents (one JSON object per line expected)")
    return documents


_CACHE: dict[Path, tuple[tuple[int, int], SearchIndex]] = {}
_CACHE_LOCK = threading.Lock()


def corpus_index(corpus: str | Path) -> SearchIndex:
    """The index of ``corpus``, built on first use and shared until the file changes."""
    path = Path(corpus).expanduser().resolve()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ValueError(f"search corpus {path}: file not found") from None
    stamp = (st.st_mtime_ns, st.st_size)
    with _CACHE_LOCK:  # one build per file even when factories race in threads
        cached = _CACHE.get(path)
        if cached is None or cached[0] != stamp:
            cached = _CACHE[path] = (stamp, SearchIndex(load_corpus(path)))
        return cached[1]


def cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, an ellipsis marking a cut."""
    text = " ".join(text.split())  # newlines and runs of spaces waste the model's context
    return text if len(text) <= limit else text[: max(limit - 3, 0)].rstrip() + "..."


class SearchTool:
    name = "search"

    def __init__(
        self, index: SearchIndex, *, top_k: int = 3, max_chars_per_passage: int = 400
    ) -> None:
        self.index = index
        self.top_k = top_k
        self.max_chars_per_passage = max_chars_per_passage
        self.max_top_k = max(MAX_TOP_K, top_k)

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.name,
            "Search the document collection by keywords and return the best matching passages, "
            "numbered, each with its title.",
            {
                "query": {"type": "string", "description": "keywords describing what to find"},
                "top_k": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": self.max_top_k,
                    "description": f"passages to return (default {self.top_k})",
                },
            },
            ["query"],
        )

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        if bad := invalid_args(self, args):
            return bad
        query: str = args["query"]
        if not query.strip():
            return ToolResult(text="Error: the query is empty; give some keywords", ok=False)
        k = args.get("top_k", self.top_k)
        if not 1 <= k <= self.max_top_k:
            return ToolResult(
                text=f"Error: top_k must be between 1 and {self.max_top_k}, got {k}", ok=False
            )
        hits = await anyio.to_thread.run_sync(self.index.search, query, k)
        if not hits:
            return ToolResult(text=f"No results for {query!r}.", metrics={"search_hits": 0.0})
        passages = []
        for rank, (doc, _score) in enumerate(hits, start=1):
            heading = f"[{rank}] {doc.title}".rstrip()
            passages.append(f"{heading}\n{cut(doc.text, self.max_chars_per_passage)}")
        return ToolResult(text="\n\n".join(passages), metrics={"search_hits": float(len(hits))})


@TOOLS.register("search")
def make_search_tool(
    *, corpus: str, top_k: int = 3, max_chars_per_passage: int = 400
) -> SearchTool:
    """Options: ``corpus`` (JSONL file), ``top_k`` (default passages per call),
    ``max_chars_per_passage``. Raises ValueError for a missing or malformed corpus."""
    if top_k < 1 or max_chars_per_passage < 1:
        raise ValueError(
            f"search: top_k and max_chars_per_passage must be positive "
            f"(got {top_k}, {max_chars_per_passage})"
        )
    return SearchTool(
        corpus_index(corpus), top_k=top_k, max_chars_per_passage=max_chars_per_passage
    )
