"""The search tool: BM25 ranking over a JSONL corpus, top_k, passage cuts, corpus errors, and
scoring off the event loop (under asyncio and trio)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rollout_service.tools import TOOLS, ToolContext, load_builtin_tools
from rollout_service.tools.search import SearchTool, corpus_index

CTX = ToolContext(episode_id="ep-search")

DOCS = [
    {
        "id": "cat",
        "title": "Domestic cat",
        "text": "The cat is a small carnivorous mammal kept as a pet.",
    },
    {
        "id": "erebus",
        "title": "Mount Erebus",
        "text": "Mount Erebus is the southernmost active volcano on Earth, with a persistent lava lake "
        "in its summit crater on Ross Island, Antarctica. " + "It erupts often. " * 40,
    },
    {
        "id": "tea",
        "title": "Tea",
        "text": "Tea is an aromatic beverage made from the leaves of Camellia sinensis.",
    },
    {"id": 7, "text": "A volcano is a rupture in the crust through which lava escapes."},
    {
        "title": "Glacier",
        "text": "A glacier is a persistent body of dense ice moving under its own weight.",
    },
]


def write_corpus(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.jsonl", DOCS)


def make(corpus: Path, **options: Any) -> SearchTool:
    return TOOLS.get("search")(corpus=str(corpus), **options)  # type: ignore[no-any-return]


def test_search_is_registered_with_a_schema(corpus: Path) -> None:
    assert "search" in load_builtin_tools()
    fn = make(corpus).schema["function"]
    assert fn["name"] == "search" and fn["parameters"]["required"] == ["query"]
    assert set(fn["parameters"]["properties"]) == {"query", "top_k"}


@pytest.mark.anyio
async def test_distinctive_query_ranks_the_right_document_first(corpus: Path) -> None:
    res = await make(corpus).call({"query": "Antarctica lava lake crater"}, CTX)
    assert res.ok and res.metrics["search_hits"] >= 1
    first = res.text.split("\n\n")[0]
    assert first.startswith("[1] Mount Erebus\n") and "Ross Island" in first
    tea = await make(corpus).call({"query": "beverage from Camellia leaves"}, CTX)
    assert tea.text.startswith("[1] Tea\n")


@pytest.mark.anyio
async def test_top_k_and_passage_cut(corpus: Path) -> None:
    tool = make(corpus, top_k=1, max_chars_per_passage=60)
    one = await tool.call({"query": "volcano lava"}, CTX)
    assert one.ok and one.metrics["search_hits"] == 1 and "[2]" not in one.text
    passage = one.text.split("\n", 1)[1]
    assert len(passage) <= 60 and passage.endswith("...")
    two = await tool.call({"query": "volcano lava", "top_k": 2}, CTX)
    assert two.metrics["search_hits"] == 2 and "[2]" in two.text
    # Only documents that share a word with the query are returned, however large top_k is.
    assert "Tea" not in two.text and "Glacier" not in two.text
    bad = await tool.call({"query": "volcano", "top_k": 0}, CTX)
    assert not bad.ok and "top_k" in bad.text


@pytest.mark.anyio
@pytest.mark.parametrize("query", ["", "   \n"])
async def test_empty_query_is_an_error(corpus: Path, query: str) -> None:
    res = await make(corpus).call({"query": query}, CTX)
    assert not res.ok and "empty" in res.text


@pytest.mark.anyio
async def test_no_match_is_a_successful_call_saying_so(corpus: Path) -> None:
    for query in ("zygomorphic quasar", "the of and"):  # unknown words; only stopwords
        res = await make(corpus).call({"query": query}, CTX)
        assert res.ok and "no results" in res.text.lower() and res.metrics["search_hits"] == 0


@pytest.mark.anyio
async def test_bad_arguments_are_reported(corpus: Path) -> None:
    res = await make(corpus).call({"q": "volcano"}, CTX)
    assert not res.ok and "'query'" in res.text


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "ok"', "not valid JSON"),
        ('["text"]', "must be a JSON object"),
        ('{"title": "no text"}', "field 'text' must be a string"),
        ('{"text": "x", "title": 3}', "field 'title' must be a string"),
    ],
)
def test_bad_corpus_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write_corpus(tmp_path / "bad.jsonl", [DOCS[0], "", line])
    with pytest.raises(ValueError, match=message) as info:
        make(path)
    assert f"{path}, line 3" in str(info.value)


def test_missing_or_empty_corpus(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="file not found"):
        make(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="no documents"):
        make(write_corpus(tmp_path / "empty.jsonl", [""]))


def test_index_is_shared_until_the_file_changes(corpus: Path) -> None:
    first = make(corpus).index
    assert make(corpus, top_k=5).index is first is corpus_index(corpus)
    write_corpus(corpus, [*DOCS, {"text": "one more document"}])
    os.utime(corpus, ns=(1, 1))  # a new mtime even on a coarse-grained filesystem clock
    changed = make(corpus).index
    assert changed is not first and len(changed.documents) == len(DOCS) + 1
