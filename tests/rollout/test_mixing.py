"""Mixed datasets: exact per-source counts in every batch, sharded in whole batches, resumable."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from common.config.training import DataConfig
from rollout_service.data import DataError, PromptItem, PromptSource, Source
from rollout_service.mixing import batch_counts, smallest_fitting_batch_size

SIZES = {"taco": 37, "nq": 11, "math": 50}
RATIOS = {"taco": 0.4, "nq": 0.3, "math": 0.3}
B = 10
BATCHES = -(-sum(SIZES.values()) // B)  # 98 rows, batches of 10: 10 batches an epoch


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sources(
    tmp_path: Path, ratios: dict[str, float] | None = None, sizes: dict[str, int] | None = None
) -> list[Source]:
    ratios, sizes = ratios or RATIOS, sizes or SIZES
    return [
        Source(
            (
                _jsonl(
                    tmp_path / f"{name}.jsonl",
                    [{"question": f"{name}{i}?", "answer": i} for i in range(sizes[name])],
                ),
            ),
            name,
            ratio=ratio,
        )
        for name, ratio in ratios.items()
    ]


def _mixed(tmp_path: Path, **kw: object) -> PromptSource:
    ratios, sizes = kw.pop("ratios", None), kw.pop("sizes", None)
    kw = {"seed": 11, "batch_size": B, **kw}
    return PromptSource(_sources(tmp_path, ratios, sizes), **kw)  # type: ignore[arg-type]


def _take(source: PromptSource, n: int) -> list[PromptItem]:
    it = iter(source)
    return [next(it) for _ in range(n)]


def _batches(items: list[PromptItem]) -> dict[tuple[int, int], list[PromptItem]]:
    out: dict[tuple[int, int], list[PromptItem]] = {}
    for it in items:
        assert it.batch is not None
        out.setdefault((it.epoch, it.batch), []).append(it)
    return out


def _counts(batch: list[PromptItem]) -> dict[str, int]:
    return dict(Counter(it.data_source for it in batch))


def _row_of(it: PromptItem) -> tuple[str, int]:
    return it.data_source, int(it.row["answer"])


# -- counts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratios", "size", "counts"),
    [
        ([0.4, 0.3, 0.3], 10, [4, 3, 3]),
        ([0.5, 0.25, 0.25], 6, [3, 2, 1]),  # 3, 1.5, 1.5: the tie goes to the earlier source
        ([1 / 3, 1 / 3, 1 / 3], 10, [4, 3, 3]),
        ([0.1, 0.2, 0.7], 7, [1, 1, 5]),  # 0.7, 1.4, 4.9: leftovers to .9 then .7
        ([2, 1, 1], 4, [2, 1, 1]),  # normalised
    ],
)
def test_largest_remainder_counts(ratios: list[float], size: int, counts: list[int]) -> None:
    assert batch_counts(ratios, size) == counts


def test_every_batch_of_whole_epochs_has_the_exact_counts(tmp_path: Path) -> None:
    src = _mixed(tmp_path)
    assert src.shard_size == BATCHES * B
    batches = _batches(_take(src, 2 * src.shard_size))
    assert sorted(batches) == [(e, b) for e in (0, 1) for b in range(BATCHES)]
    for batch in batches.values():
        assert _counts(batch) == {"taco": 4, "nq": 3, "math": 3}
    sources_in_order = [it.data_source for it in batches[0, 0]]
    assert sources_in_order != sorted(sources_in_order, key=list(RATIOS).index)  # shuffled inside


@pytest.mark.parametrize(
    ("ratios", "size", "expected"),
    [
        ({"taco": 0.5, "nq": 0.25, "math": 0.25}, 6, {"taco": 3, "nq": 2, "math": 1}),
        ({"taco": 1 / 3, "nq": 1 / 3, "math": 1 / 3}, 10, {"taco": 4, "nq": 3, "math": 3}),
    ],
)
def test_largest_remainder_mix_is_exact_in_every_batch(
    tmp_path: Path, ratios: dict[str, float], size: int, expected: dict[str, int]
) -> None:
    src = _mixed(tmp_path, ratios=ratios, batch_size=size)
    batches = _batches(_take(src, 2 * src.shard_size))
    assert len(batches) == 2 * -(-98 // size)
    assert all(_counts(batch) == expected for batch in batches.values())


def test_schedule_is_deterministic_and_new_each_epoch(tmp_path: Path) -> None:
    first = [(it.group_uid, it.index) for it in _take(_mixed(tmp_path), 2 * BATCHES * B)]
    again = [(it.group_uid, it.index) for it in _take(_mixed(tmp_path), 2 * BATCHES * B)]
    assert first == again
    epoch0, epoch1 = [i for _, i in first[: BATCHES * B]], [i for _, i in first[BATCHES * B :]]
    assert epoch0 != epoch1
    other_seed = [it.index for it in _take(_mixed(tmp_path, seed=12), BATCHES * B)]
    assert other_seed != epoch0


@pytest.mark.parametrize("shuffle", [True, False])
def test_rows_wrap_around_only_after_their_whole_source(tmp_path: Path, shuffle: bool) -> None:
    items = _take(_mixed(tmp_path, shuffle=shuffle), 3 * BATCHES * B)
    for name, size in SIZES.items():
        for epochs in (1, 2, 3):  # from the start of the stream, rows are drawn in whole passes
            seen = Counter(i for s, i in map(_row_of, items[: epochs * BATCHES * B]) if s == name)
            draws = epochs * BATCHES * {"taco": 4, "nq": 3, "math": 3}[name]
            assert sum(seen.values()) == draws
            assert set(seen) <= set(range(size))
            assert max(seen.values()) - min(seen.values()) <= 1 and len(seen) == min(size, draws)
    # math (50 rows, 30 draws an epoch) carries on where epoch 0 stopped: all of it by epoch 1
    assert {i for s, i in map(_row_of, items[: 2 * BATCHES * B]) if s == "math"} == set(range(50))


def test_group_uids_are_unique_within_an_epoch_though_rows_repeat(tmp_path: Path) -> None:
    items = _take(_mixed(tmp_path), BATCHES * B)
    assert len({it.index for it in items}) < len(items)  # nq's 11 rows fill 30 slots
    assert [it.group_uid for it in items] == [f"e0-m{slot}" for slot in range(BATCHES * B)]


# -- sharding -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [2, 3])
def test_shards_get_disjoint_whole_batches_that_make_the_single_schedule(
    tmp_path: Path, shards: int
) -> None:
    def key(it: PromptItem) -> tuple[str, int, int | None]:
        return it.group_uid, it.index, it.batch

    whole = _take(_mixed(tmp_path), 2 * BATCHES * B)
    union: list[PromptItem] = []
    for s in range(shards):
        src = _mixed(tmp_path, shard_index=s, shard_count=shards)
        assert src.shard_size == len(range(s, BATCHES, shards)) * B
        items = _take(src, 2 * src.shard_size)
        for (_, b), batch in _batches(items).items():
            assert b % shards == s and len(batch) == B
            assert _counts(batch) == {"taco": 4, "nq": 3, "math": 3}
        assert [it.position for it in items] == list(range(2 * src.shard_size))
        union += items
    assert sorted(map(key, union)) == sorted(map(key, whole))
    assert len({it.group_uid for it in union}) == len(union)  # no two shards share a uid


def test_a_shard_without_a_batch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"shard 10 of 11 is empty: .* 10 batches of 10"):
        _mixed(tmp_path, shard_index=10, shard_count=11)


# -- resumption ---------------------------------------------------------------------------------------


def test_resume_after_out_of_order_commits_continues_the_same_stream(tmp_path: Path) -> None:
    state = tmp_path / "state"

    def source() -> PromptSource:
        return _mixed(tmp_path, shard_index=1, shard_count=2, state_dir=state)

    original = _take(source(), 80)  # 50 per epoch on this shard: crosses into epoch 1
    first = source()
    issued = _take(first, 60)
    done = {0, 1, 2, 5, 9, 13, 40, 51, 55}
    for k in sorted(done, reverse=True):
        first.commit(issued[k])
    assert first.cursor == (0, 3)

    rest = _take(source(), 80 - len(done))
    assert [(it.position, it.group_uid, it.index) for it in rest] == [
        (it.position, it.group_uid, it.index) for it in original if it.position not in done
    ]


def test_cursor_saved_under_another_mix_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _mixed(tmp_path, state_dir=state).commit(0)
    _mixed(tmp_path, state_dir=state)  # the same mix loads
    with pytest.raises(DataError, match="delete it to start over"):
        _mixed(tmp_path, state_dir=state, batch_size=20)
    with pytest.raises(DataError, match="delete it to start over"):
        _mixed(tmp_path, state_dir=state, ratios={"taco": 0.5, "nq": 0.2, "math": 0.3})
    with pytest.raises(DataError, match="delete it to start over"):  # the same files, not mixed
        PromptSource(
            [Source(s.paths, s.name) for s in _sources(tmp_path)], seed=11, state_dir=state
        )
    plain = tmp_path / "plain"
    PromptSource(
        [Source(s.paths, s.name) for s in _sources(tmp_path)], seed=11, state_dir=plain
    ).commit(0)
    with pytest.raises(DataError, match="delete it to start over"):
        _mixed(tmp_path, state_dir=plain)


def test_mixed_uids_map_back_to_positions_and_can_be_held(tmp_path: Path) -> None:
    src = _mixed(tmp_path, shard_index=2, shard_count=3, state_dir=tmp_path / "s")
    items = _take(src, 2 * src.shard_size)
    assert [src.position_of_group(it.group_uid) for it in items] == list(range(2 * src.shard_size))
    other = _take(_mixed(tmp_path, shard_index=0, shard_count=3), 3)
    assert all(src.position_of_group(it.group_uid) is None for it in other)  # shard 0's batches
    # plain uid, past the epoch, garbage
    for foreign in ("e0-i3", f"e0-m{BATCHES * B + 2}", "junk"):
        assert src.position_of_group(foreign) is None
    assert src.hold_groups([items[1].group_uid, items[4].group_uid, other[0].group_uid]) == 2
    assert [it.position for it in _take(src, 4)] == [0, 2, 3, 5]
    for uid in [items[1].group_uid, items[0].group_uid, other[1].group_uid]:
        src.commit_group(uid)
    assert src.cursor == (0, 2) and [it.position for it in _take(src, 3)] == [2, 3, 5]


# -- configuration ------------------------------------------------------------------------------------


def test_a_source_with_no_row_per_batch_is_refused_with_a_batch_size_that_fits(
    tmp_path: Path,
) -> None:
    ratios = {"taco": 0.9, "nq": 0.05, "math": 0.05}  # 9, 0.5, 0.5 of 10: nq gets the leftover
    assert batch_counts(list(ratios.values()), 10) == [9, 1, 0]
    assert smallest_fitting_batch_size(list(ratios.values()), 10) == 14  # 12.6, 0.7, 0.7
    with pytest.raises(DataError) as e:
        _mixed(tmp_path, ratios=ratios)
    message = str(e.value)
    assert (
        "data.datasets" in message and "'math'" in message and "data.train_batch_size=14" in message
    )


def test_a_mix_needs_every_ratio_and_a_batch_size(tmp_path: Path) -> None:
    sources = _sources(tmp_path)
    with pytest.raises(DataError, match=r"needs a ratio above 0 \(got nq=None\)"):
        PromptSource([sources[0], Source(sources[1].paths, "nq"), sources[2]], batch_size=B)
    with pytest.raises(DataError, match=r"data\.train_batch_size"):
        PromptSource(sources)


def test_from_config_tags_each_source_with_its_name_and_agent_type(tmp_path: Path) -> None:
    code = _jsonl(
        tmp_path / "code.jsonl",
        [
            {"question": "c?", "answer": 1, "data_source": "other"},
            {"question": "own?", "answer": 2, "agent": "react"},
        ],
    )
    qa = _jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i}?", "answer": i} for i in range(6)])
    cfg = DataConfig(
        datasets=[
            {"name": "taco", "path": code, "ratio": 0.25, "agent_type": "code_agent"},
            {"name": "nq", "path": [qa], "ratio": 0.75},
        ],
        agent_type="search_agent",
        train_batch_size=4,
        seed=3,
    )
    src = PromptSource.from_config(cfg, shard_index=0, shard_count=1)
    items = _take(src, src.shard_size)
    assert len(items) == 8 and all(
        _counts(b) == {"taco": 1, "nq": 3} for b in _batches(items).values()
    )
    tags = {(it.row["question"], it.data_source, it.agent_type) for it in items}
    assert tags == {
        ("c?", "taco", "code_agent"),
        ("own?", "taco", "react"),
        *((f"q{i}?", "nq", "search_agent") for i in range(6)),
    }
