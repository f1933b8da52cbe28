"""Data files and the sharded, resumable prompt stream (real files written by the tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.config.training import DataConfig
from rollout_service.data import STATE_FILE, DataError, PromptSource, Source, load_rows


def _rows(n: int, tag: str = "q") -> list[dict]:
    return [{"question": f"{tag}{i}?", "answer": i, "tests": [f"assert f({i})"]} for i in range(n)]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_three_formats_load_the_same_rows_with_extra_fields(tmp_path: Path) -> None:
    rows = [
        {
            "question": "list?",
            "answer": ["a", "b"],
            "data_source": "gsm",
            "agent": "tool",
            "tests": ["t"],
        },
        *_rows(3),
    ]
    as_json = tmp_path / "d.json"
    as_json.write_text(json.dumps(rows))
    as_jsonl = _jsonl(tmp_path / "d.jsonl", rows)
    as_parquet = tmp_path / "d.parquet"
    # Parquet columns have one type: answers as strings; rows lacking a column read back as None.
    pq.write_table(
        pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in rows]), as_parquet
    )
    assert load_rows(as_json) == rows
    assert load_rows(as_jsonl) == rows
    loaded = load_rows(as_parquet)
    assert [r["question"] for r in loaded] == [r["question"] for r in rows]
    assert loaded[0]["data_source"] == "gsm" and loaded[1]["tests"] == ["assert f(0)"]
    assert loaded[1]["data_source"] is None and loaded[1]["answer"] == "0"


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"answer": 1}, "question"),
        ({"question": "", "answer": 1}, "question"),
        ({"question": "q?"}, "answer"),
        ({"question": "q?", "answer": True}, "answer"),
        ({"question": "q?", "answer": {"x": 1}}, "answer"),
        ({"question": "q?", "answer": "1", "agent": 3}, "agent"),
        ({"question": "q?", "answer": "1", "data_source": ""}, "data_source"),
    ],
)
def test_bad_row_names_file_line_and_field(tmp_path: Path, row: dict, field: str) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", [*_rows(2), row])
    with pytest.raises(DataError) as e:
        load_rows(path)
    assert str(path) in str(e.value) and "line 3" in str(e.value) and f"'{field}'" in str(e.value)


def test_bad_files_are_named(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": 1}\n{oops\n')
    with pytest.raises(DataError, match=r"broken\.jsonl: line 2: not valid JSON"):
        load_rows(broken)
    not_list = tmp_path / "obj.json"
    not_list.write_text('{"question": "a"}')
    with pytest.raises(DataError, match=r"obj\.json: expected a JSON list"):
        load_rows(not_list)
    bad_row = tmp_path / "rows.json"
    bad_row.write_text(json.dumps([{"question": "a", "answer": 1}, "text"]))
    with pytest.raises(DataError, match=r"rows\.json: row 1: expected an object"):
        load_rows(bad_row)
    pq_path = tmp_path / "t.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"question": "a", "answer": "1"}, {"question": "b", "answer": None}]),
        pq_path,
    )
    with pytest.raises(DataError, match=r"t\.parquet: row 1: field 'answer'"):
        load_rows(pq_path)
    with pytest.raises(DataError, match=r"unknown data file type '\.csv'"):
        (tmp_path / "x.csv").write_text("q,a")
        load_rows(tmp_path / "x.csv")
    with pytest.raises(DataError, match="no such data file"):
        load_rows(tmp_path / "missing.jsonl")


def _take(source: PromptSource, n: int) -> list:
    it = iter(source)
    return [next(it) for _ in range(n)]


def test_shards_are_disjoint_and_cover_every_row_each_epoch(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", _rows(23))
    shards = [
        PromptSource([Source((str(path),))], shard_index=s, shard_count=3, seed=7) for s in range(3)
    ]
    per_epoch: dict[int, list[int]] = {0: [], 1: []}
    for s, src in enumerate(shards):
        items = _take(src, 2 * src.shard_size)
        assert all(it.index % 3 == s for it in items)
        for it in items:
            per_epoch[it.epoch].append(it.index)
    for indices in per_epoch.values():
        assert sorted(indices) == list(range(23))  # each row once per epoch over all shards
    epochs = [it.index for it in _take(shards[0], 16)]
    # shuffled, anew each epoch
    assert epochs[:8] != sorted(epochs[:8]) and epochs[:8] != epochs[8:]
    again = PromptSource([Source((str(path),))], shard_index=0, shard_count=3, seed=7)
    assert [it.index for it in _take(again, 16)] == [it.index for it in _take(shards[0], 16)]
    item = _take(again, 1)[0]
    assert item.group_uid == f"e0-i{item.index}" and item.row["question"] == f"q{item.index}?"


def test_datasets_are_tagged_with_name_and_agent_type(tmp_path: Path) -> None:
    a = _jsonl(tmp_path / "a.jsonl", _rows(3, "a"))
    b = _jsonl(
        tmp_path / "b.jsonl", [*_rows(2, "b"), {"question": "own?", "answer": "x", "agent": "code"}]
    )
    cfg = DataConfig(
        datasets=[
            {"name": "math", "path": str(a), "ratio": 0.5, "agent_type": "tool"},
            {"name": "search", "path": [str(b)], "ratio": 0.5},
        ],
        agent_type="single_turn",
        shuffle=False,
    )
    # datasets with ratios are mixed: batches of 4 (the default data.train_batch_size) of 2 + 2
    items = _take(PromptSource.from_config(cfg, shard_index=0, shard_count=1), 8)
    assert [(it.index, it.data_source, it.agent_type) for it in items] == [
        (0, "math", "tool"),
        (1, "math", "tool"),
        (3, "search", "single_turn"),
        (4, "search", "single_turn"),
        (2, "math", "tool"),
        (0, "math", "tool"),
        (5, "search", "code"),
        (3, "search", "single_turn"),
    ]
    assert [it.batch for it in items] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(DataError, match="no training data"):
        PromptSource.from_config(DataConfig(), shard_index=0, shard_count=1)
    with pytest.raises(DataError, match="shard 4 of 5 is empty"):
        PromptSource.from_config(DataConfig(train_files=[str(a)]), shard_index=4, shard_count=5)


def test_resume_after_out_of_order_commits_skips_nothing_unshipped(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", _rows(10))
    state = tmp_path / "state"

    def source() -> PromptSource:
        return PromptSource(
            [Source((str(path),))], shard_index=1, shard_count=2, seed=3, state_dir=state
        )

    first = source()
    items = _take(first, 8)  # 5 per epoch: crosses into epoch 1
    for k in (0, 1, 3, 5, 6):  # 2 and 4 still in flight when the server dies
        first.commit(items[k])
    first.commit(items[3])  # acknowledged twice: harmless
    assert first.cursor == (0, 2) and first.done_ahead == {3, 5, 6}
    assert (state / STATE_FILE).exists() and not list(state.glob(".*tmp*"))

    resumed = source()
    redo = [it.position for it in _take(resumed, 4)]
    assert redo == [2, 4, 7, 8]  # in-flight 2 and 4 redone, done 3, 5, 6 skipped, 7 never issued
    assert [it.index for it in _take(resumed, 3)] == [items[k].index for k in (2, 4, 7)]
    for p in (2, 4):
        resumed.commit(p)
    assert resumed.cursor == (1, 2) and resumed.done_ahead == frozenset()


def test_cursor_saved_for_other_data_is_refused(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", _rows(10))
    state = tmp_path / "state"
    PromptSource([Source((str(path),))], shard_count=2, state_dir=state).commit(0)
    with pytest.raises(DataError, match="delete it to start over"):
        PromptSource([Source((str(path),))], shard_index=1, shard_count=2, state_dir=state)
    (state / STATE_FILE).write_text("{not json")
    with pytest.raises(DataError, match="unreadable data cursor"):
        PromptSource([Source((str(path),))], shard_count=2, state_dir=state)


def test_held_groups_are_not_issued_and_commit_by_uid(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", _rows(9))
    src = PromptSource(
        [Source((str(path),))], shard_index=2, shard_count=3, seed=5, state_dir=tmp_path / "s"
    )
    items = _take(src, 6)  # two epochs of three
    assert [src.position_of_group(it.group_uid) for it in items] == list(range(6))
    # "e0-i0" is shard 0's
    assert src.position_of_group("e0-i0") is None and src.position_of_group("junk") is None
    assert src.hold_groups([items[1].group_uid, items[4].group_uid, "e0-i0"]) == 2
    assert [it.position for it in _take(src, 4)] == [0, 2, 3, 5]
    for uid in [items[1].group_uid, items[0].group_uid, "e9-i3"]:  # a foreign uid is ignored
        src.commit_group(uid)
    assert src.cursor == (0, 2) and [it.position for it in _take(src, 2)] == [2, 3]


def test_non_utf8_bytes_name_the_file_and_line(tmp_path: Path) -> None:
    good = json.dumps({"question": "a?", "answer": 1}).encode()
    bad = b'{"question": "caf' + b"\xe9" + b'?", "answer": 1}'  # Latin-1, not UTF-8
    as_jsonl = tmp_path / "latin1.jsonl"
    as_jsonl.write_bytes(good + b"\n" + good + b"\n" + bad + b"\n")
    with pytest.raises(DataError) as e:
        load_rows(as_jsonl)
    assert (
        str(as_jsonl) in str(e.value) and "line 3" in str(e.value) and "not UTF-8" in str(e.value)
    )
    assert "byte 18 " in str(e.value)  # where in the line
    as_json = tmp_path / "latin1.json"
    as_json.write_bytes(b"[\n" + good + b",\n" + bad + b"\n]")
    with pytest.raises(DataError) as e:
        load_rows(as_json)
    assert (
        str(as_json) in str(e.value)
        and "line 3 column 18" in str(e.value)
        and "not UTF-8" in str(e.value)
    )


def test_a_row_over_the_limit_is_refused_with_its_size(tmp_path: Path) -> None:
    # 50 MB in one JSONL line: refused under the default limit (4 MiB), naming file, line, size, limit.
    big = {"question": "q?", "answer": 1, "documents": ["x" * 50_000_000]}
    path = _jsonl(tmp_path / "big.jsonl", [*_rows(2), big])
    size = len(json.dumps(big).encode())
    with pytest.raises(DataError) as e:
        load_rows(path)
    message = str(e.value)
    assert str(path) in message and "line 3" in message
    assert f"row of {size} bytes" in message and f"data.max_row_bytes={4 << 20}" in message
    # The limit is a setting: the same row passes a larger one; JSON lists and parquet are bounded too.
    assert len(load_rows(path, max_row_bytes=60_000_000)) == 3
    rows = [*_rows(2), {"question": "q?", "answer": "1", "documents": ["y" * 5000]}]
    as_json = tmp_path / "d.json"
    as_json.write_text(json.dumps(rows))
    as_parquet = tmp_path / "d.parquet"
    # from_pylist takes its columns from the first row: every row names every column.
    pq.write_table(
        pa.Table.from_pylist([{"documents": [], **r, "answer": str(r["answer"])} for r in rows]),
        as_parquet,
    )
    for p in (as_json, as_parquet):
        with pytest.raises(
            DataError,
            match=rf"{p}: row 2: row of \d+ bytes is larger than data\.max_row_bytes=4000",
        ):
            load_rows(p, max_row_bytes=4000)
        assert len(load_rows(p, max_row_bytes=6000)) == 3
    # The configured limit reaches the prompt stream.
    config = DataConfig(train_files=[str(path)], max_row_bytes=1000)
    with pytest.raises(DataError, match=r"data\.max_row_bytes=1000"):
        PromptSource.from_config(config, shard_index=0, shard_count=1)


def test_first_rows_only(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b"".join(json.dumps(r).encode() + b"\n" for r in _rows(3)) + b"\xff\xfe broken\n"
    )
    assert [r["question"] for r in load_rows(path, limit=2)] == ["q0?", "q1?"]
    with pytest.raises(DataError, match="line 4"):
        load_rows(path)
    as_parquet = tmp_path / "d.parquet"
    pq.write_table(
        pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in _rows(50)]), as_parquet
    )
    assert len(load_rows(as_parquet, limit=5)) == 5 and len(load_rows(as_parquet)) == 50
