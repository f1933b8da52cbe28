"""Training prompts: loading data files, and a sharded, shuffled, resumable stream of prompts.

Files (JSON list, JSONL, parquet) are read whole and every row is checked at load time, so a bad
row stops the server at start-up with the file, the row and the field named, not hours later in an
agent loop. Bytes that are not UTF-8 are reported with the file and line, and a row bigger than
``data.max_row_bytes`` with its size and the limit (a JSONL line is refused without reading it
whole). ``load_rows(..., limit=n)`` reads only the first rows, as ``--check`` does. Each row is
adapted by its layout (``rollout_service.layouts``: ours and AgentFly's question/answer rows,
verl's chat-prompt rows with ``reward_model.ground_truth``), which names the field a bad row lacks;
every other field is kept for reward functions (``tests``, ``documents``, ``extra_info``...).

``PromptSource`` concatenates the configured sources; a row's *global index* is its place in that
concatenation, stable across epochs and restarts. Each epoch is a permutation of all global
indices seeded by ``(seed, epoch)``, and this server keeps the indices with
``index % shard_count == shard_index``, so servers sharing a data set never overlap and together
cover it. Positions in this server's stream are numbered across epochs
(``epoch * shard_size + offset``), which gives one integer order for the cursor.

Mixed sources (every ``Source`` has a ``ratio``, as ``data.datasets`` do): the epoch is a schedule
of whole batches in which each source has the same exact count (``rollout_service.mixing`` has the
design). Batch ``b`` of an epoch goes to shard ``b % shard_count``, so each server's stream is
whole batches and any ``batch_size`` consecutive positions from a batch boundary hold the exact
mix. A small source repeats within an epoch, so group uids name the slot, not the row:
``e{epoch}-m{batch * batch_size + place}`` (``e{epoch}-i{index}`` without mixing).

Resumption: a prompt is only *done* once its group has been acknowledged by the learner
(``commit``). Groups finish out of order, so the cursor is the lowest position not yet done plus
the done positions ahead of it; it is written to a small JSON file atomically (tmp, fsync,
rename). A restarted server starts at the cursor and skips the done positions ahead, so it never
skips an unshipped prompt; prompts that were in flight are run again, except those whose groups
are already in the shipper's spool: ``hold_groups`` keeps them from being reissued (group uids
encode the position) and ``commit_group`` marks them done when their resent batch is acknowledged.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config.training import DataConfig
from common.fileio import atomic_write_bytes
from rollout_service.layouts import DEFAULT_LAYOUT, DataError, LayoutOptions, adapt_row
from rollout_service.mixing import MixedSchedule, batch_counts, smallest_fitting_batch_size

__all__ = ["DataError", "LayoutOptions", "PromptItem", "PromptSource", "Source", "layout_options"]

STATE_FILE = "data_cursor.json"
STATE_FORMAT = 1
# i: row index (plain), m: slot in the epoch (mixed)
_GROUP_UID = re.compile(r"^e(\d+)-([im])(\d+)$")
_MIX_KEYS = ("ratios", "batch_size", "source_rows")  # in the cursor's fingerprint when mixing


@dataclass(frozen=True)
class PromptItem:
    index: int
    """Global index of the row (its place in the concatenation of all sources): stable."""
    epoch: int
    row: dict[str, Any]
    data_source: str
    agent_type: str
    group_uid: str
    """Deterministic from (epoch, index), or (epoch, slot) when mixing: unique within an epoch."""
    position: int
    """Place in this shard's stream across epochs; what ``PromptSource.commit`` counts."""
    batch: int | None = None
    """Mixed sources: the batch of the epoch (over all shards) that holds this prompt; else None."""


@dataclass(frozen=True)
class Source:
    """One named group of files; ``name``/``agent_type`` None: taken from each row (or defaults).
    ``ratio``: share of every batch (all sources have one, or none; normalised to sum 1)."""

    paths: tuple[str, ...]
    name: str | None = None
    agent_type: str | None = None
    ratio: float | None = None


# -- loading -------------------------------------------------------------------------------------


DEFAULT_MAX_ROW_BYTES = 4 << 20  # data.max_row_bytes's default
Reader = Callable[[Path, int, int | None], list[tuple[str, Any]]]
"""(file, max_row_bytes, first rows only or None) -> [(where in the file, row)]."""


def load_rows(
    path: str | os.PathLike[str],
    *,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    limit: int | None = None,
    options: LayoutOptions = DEFAULT_LAYOUT,
) -> list[dict[str, Any]]:
    """Every row of one file (the first ``limit`` only, when given), adapted from its layout and
    validated. Raises ``DataError`` naming the file, the line or row, and the field or limit."""
    return [
        row
        for _, row in located_rows(path, max_row_bytes=max_row_bytes, limit=limit, options=options)
    ]


def located_rows(
    path: str | os.PathLike[str],
    *,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    limit: int | None = None,
    options: LayoutOptions = DEFAULT_LAYOUT,
) -> list[tuple[str, dict[str, Any]]]:
    """``load_rows`` with where each row is in its file ("line 3", "row 2"), for messages."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such data file")
    reader = _READERS.get(p.suffix.lower())
    if reader is None:
        raise DataError(
            f"{p}: unknown data file type {p.suffix.lower()!r} "
            f"(expected {', '.join(sorted(_READERS))})"
        )
    rows = [
        (where, adapt_row(row, f"{p}: {where}", options))
        for where, row in reader(p, max_row_bytes, limit)
    ]
    if not rows:
        raise DataError(f"{p}: the file holds no rows")
    return rows


def _too_big(where: str, size: int, limit: int) -> DataError:
    return DataError(
        f"{where}: row of {size} bytes is larger than data.max_row_bytes={limit}; "
        "shorten it or raise the limit"
    )


def _not_utf8(where: str, e: UnicodeDecodeError, text: bytes) -> DataError:
    """``where``: the file, or the file and line; ``text`` holds ``e``'s bytes from its start."""
    line = text.count(b"\n", 0, e.start) + 1
    column = e.start - (text.rfind(b"\n", 0, e.start) + 1) + 1
    return DataError(
        f"{where}: line {line} column {column} (byte): not UTF-8 text "
        f"({e.reason}: {e.object[e.start : e.end]!r}); data files must be UTF-8"
    )


def _read_jsonl(p: Path, max_row_bytes: int, limit: int | None) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    with p.open("rb") as f:
        lineno = 0
        # Bounded reads: a line past the limit is refused after max_row_bytes + 2 bytes of it,
        # never read whole into memory.
        while limit is None or len(rows) < limit:
            raw = f.readline(max_row_bytes + 2)
            if not raw:
                break
            lineno += 1
            where = f"{p}: line {lineno}"
            content = raw.rstrip(b"\r\n")
            if len(content) > max_row_bytes:
                size = len(content)
                # measure, don't keep
                while not raw.endswith(b"\n") and (raw := f.readline(1 << 20)):
                    size += len(raw.rstrip(b"\r\n"))
                raise _too_big(where, size, max_row_bytes)
            try:
                line = content.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{where}: not UTF-8 text at byte {e.start + 1} of the line "
                    f"({e.reason}: {e.object[e.start : e.end]!r}); data files must be UTF-8"
                ) from None
            if not line.strip():
                continue  # a trailing newline or blank separator line is not a row
            try:
                rows.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    return rows


def _read_json_list(p: Path, max_row_bytes: int, limit: int | None) -> list[tuple[str, Any]]:
    raw = p.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _not_utf8(str(p), e, raw) from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    if not isinstance(data, list):
        raise DataError(f"{p}: expected a JSON list of rows, got a {type(data).__name__}")
    rows = [(f"row {i}", row) for i, row in enumerate(data[:limit])]
    if len(raw) > max_row_bytes:  # else no row can be bigger than the limit
        _check_sizes(p, rows, max_row_bytes)
    return rows


def _read_parquet(p: Path, max_row_bytes: int, limit: int | None) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(p)
        if limit is None:
            table = parquet.read()
        else:
            table = pa.Table.from_batches(
                list(_first(parquet.iter_batches(batch_size=limit))), schema=parquet.schema_arrow
            )
        records = table.to_pylist()
    except UnicodeDecodeError as e:
        raise DataError(
            f"{p}: a text column holds bytes that are not UTF-8 ({e.reason}); "
            "data files must be UTF-8"
        ) from None
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{p}: not a readable parquet file ({e})") from None
    rows = [(f"row {i}", row) for i, row in enumerate(records)]
    # Every row is measured: the file's own sizes (compressed, dictionary-encoded) bound nothing.
    _check_sizes(p, rows, max_row_bytes)
    return rows


def _first(batches: Iterator[Any]) -> Iterator[Any]:
    for batch in batches:
        yield batch
        return


def _check_sizes(p: Path, rows: list[tuple[str, Any]], max_row_bytes: int) -> None:
    """A row's size is its compact JSON encoding (what a JSONL line of it would take)."""
    for where, row in rows:
        text = json.dumps(row, ensure_ascii=False, separators=(",", ":"), default=str)
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > max_row_bytes:
            raise _too_big(f"{p}: {where}", size, max_row_bytes)


_READERS: dict[str, Reader] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json_list,
    ".parquet": _read_parquet,
}
"""File suffix -> its reader."""


# -- the prompt stream -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Row:
    row: dict[str, Any]
    data_source: str
    agent_type: str


def layout_options(data: DataConfig) -> LayoutOptions:
    """The ``data.*`` keys that shape how rows are read."""
    return LayoutOptions(prompt_key=data.prompt_key)


def sources_from_config(data: DataConfig) -> list[Source]:
    """``data.datasets`` (each its own name and agent type) or else ``data.train_files``."""
    if data.datasets:
        return [Source(tuple(d.path), d.name, d.agent_type, d.ratio) for d in data.datasets]
    if not data.train_files:
        raise DataError("no training data: set data.train_files or data.datasets")
    return [Source(tuple(data.train_files))]


class PromptSource:
    """This shard's prompts in a deterministic per-epoch shuffled order, resumable from a state file.

    Iterate it (endless unless ``max_epochs``), run each item, and call ``commit(item)`` once its
    group has been acknowledged by the learner. Sources with ratios need ``batch_size``.
    """

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        shard_index: int = 0,
        shard_count: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        default_agent_type: str = "single_turn",
        state_dir: str | os.PathLike[str] | None = None,
        max_epochs: int | None = None,
        batch_size: int | None = None,
        max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
        options: LayoutOptions = DEFAULT_LAYOUT,
    ) -> None:
        if not 0 <= shard_index < shard_count:
            raise DataError(f"shard_index {shard_index} is not in [0, shard_count={shard_count})")
        self.shard_index, self.shard_count = shard_index, shard_count
        self.seed, self.shuffle, self.max_epochs = seed, shuffle, max_epochs
        self.rows, self.source_rows = _load_sources(
            sources, default_agent_type, max_row_bytes=max_row_bytes, options=options
        )
        self.ratios = [s.ratio for s in sources]
        self.mix = _mixed_schedule(
            sources, self.source_rows, batch_size, seed=seed, shuffle=shuffle
        )
        if self.mix is None:
            self.shard_size = len(range(shard_index, len(self.rows), shard_count))
            if self.shard_size == 0:
                raise DataError(
                    f"shard {shard_index} of {shard_count} is empty: the data has only "
                    f"{len(self.rows)} rows"
                )
        else:
            batches = len(range(shard_index, self.mix.batches_per_epoch, shard_count))
            if batches == 0:
                raise DataError(
                    f"shard {shard_index} of {shard_count} is empty: an epoch of the mixed "
                    f"data has only {self.mix.batches_per_epoch} batches of "
                    f"{self.mix.batch_size} (data.train_batch_size); use fewer rollout servers"
                )
            self.shard_size = batches * self.mix.batch_size
        self.state_path = Path(state_dir) / STATE_FILE if state_dir is not None else None
        self._next_undone = 0  # every position below this is done
        self._done_ahead: set[int] = set()  # done positions above it (groups finish out of order)
        self._held: set[int] = set()  # in flight in a batch recovered from the spool: not reissued
        self._orders: dict[int, np.ndarray] = {}
        self._load_state()

    @classmethod
    def from_config(
        cls,
        data: DataConfig,
        *,
        shard_index: int,
        shard_count: int,
        state_dir: str | os.PathLike[str] | None = None,
        max_epochs: int | None = None,
    ) -> PromptSource:
        return cls(
            sources_from_config(data),
            shard_index=shard_index,
            shard_count=shard_count,
            seed=data.seed,
            shuffle=data.shuffle,
            default_agent_type=data.agent_type,
            state_dir=state_dir,
            max_epochs=max_epochs,
            batch_size=data.train_batch_size,
            max_row_bytes=data.max_row_bytes,
            options=layout_options(data),
        )

    # -- iteration ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[PromptItem]:
        """From the cursor on, skipping positions already done."""
        position = self._next_undone
        while self.max_epochs is None or position // self.shard_size < self.max_epochs:
            if position not in self._done_ahead and position not in self._held:
                yield self.item_at(position)
            position += 1

    def item_at(self, position: int) -> PromptItem:
        epoch, offset = divmod(position, self.shard_size)
        index = int(self._order(epoch)[offset])
        r = self.rows[index]
        batch, uid = None, f"e{epoch}-i{index}"
        if self.mix is not None:
            k, place = divmod(offset, self.mix.batch_size)
            batch = self.shard_index + k * self.shard_count
            uid = f"e{epoch}-m{batch * self.mix.batch_size + place}"
        return PromptItem(
            index=index,
            epoch=epoch,
            row=r.row,
            data_source=r.data_source,
            agent_type=r.agent_type,
            group_uid=uid,
            position=position,
            batch=batch,
        )

    def _order(self, epoch: int) -> np.ndarray:
        """This shard's global indices in epoch ``epoch``'s order (cached for the last two epochs,
        since items in flight can straddle an epoch boundary)."""
        order = self._orders.get(epoch)
        if order is None:
            if self.mix is not None:
                # The epoch's whole schedule, dealt to the shards in whole batches.
                batches = self.mix.epoch(epoch).reshape(
                    self.mix.batches_per_epoch, self.mix.batch_size
                )
                order = batches[self.shard_index :: self.shard_count].reshape(-1)
            else:
                everything = np.arange(len(self.rows))
                if self.shuffle:
                    # One permutation of the whole data set per epoch, filtered to this shard: the
                    # order depends only on (seed, epoch), never on the shard layout.
                    everything = np.random.default_rng([self.seed, epoch]).permutation(
                        len(self.rows)
                    )
                order = everything[everything % self.shard_count == self.shard_index]
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return order

    # -- the cursor --------------------------------------------------------------------------------

    @property
    def cursor(self) -> tuple[int, int]:
        """(epoch, offset) of the lowest position not yet done."""
        return divmod(self._next_undone, self.shard_size)

    @property
    def done_ahead(self) -> frozenset[int]:
        return frozenset(self._done_ahead)

    def commit(self, item: PromptItem | int) -> None:
        """Mark a prompt (item or its position) done and persist the cursor."""
        position = item.position if isinstance(item, PromptItem) else item
        self._held.discard(position)
        if position < self._next_undone or position in self._done_ahead:
            return  # committed twice (a resent batch acknowledged again): nothing changes
        self._done_ahead.add(position)
        while self._next_undone in self._done_ahead:
            self._done_ahead.remove(self._next_undone)
            self._next_undone += 1
        self._save_state()

    def position_of_group(self, group_uid: str) -> int | None:
        """The position of the prompt a ``group_uid`` of this source names; None when it names
        none of this shard's prompts (another data set or sharding produced it)."""
        m = _GROUP_UID.match(group_uid)
        if m is None or (m.group(2) == "m") != (self.mix is not None):
            return None
        epoch, number = int(m.group(1)), int(m.group(3))
        if self.mix is not None:
            batch, place = divmod(number, self.mix.batch_size)
            if batch >= self.mix.batches_per_epoch or batch % self.shard_count != self.shard_index:
                return None
            return epoch * self.shard_size + batch // self.shard_count * self.mix.batch_size + place
        if number >= len(self.rows) or number % self.shard_count != self.shard_index:
            return None
        offsets = np.flatnonzero(self._order(epoch) == number)
        return epoch * self.shard_size + int(offsets[0])

    def hold_groups(self, group_uids: Iterable[str]) -> int:
        """Do not issue these prompts: their groups are already on their way to the learner (in
        batches resubmitted from the spool); ``commit_group`` them when acknowledged. Returns
        how many of the uids were this shard's prompts not yet done."""
        held = 0
        for uid in group_uids:
            position = self.position_of_group(uid)
            if (
                position is not None
                and position >= self._next_undone
                and position not in self._done_ahead
            ):
                self._held.add(position)
                held += 1
        return held

    def commit_group(self, group_uid: str) -> None:
        """``commit`` by group uid; uids that are not this shard's prompts are ignored."""
        position = self.position_of_group(group_uid)
        if position is not None:
            self.commit(position)

    def commit_groups(self, group_uids: Iterable[str]) -> None:
        """``commit_group`` for each (the shipper's groups acked before a restart)."""
        for uid in group_uids:
            self.commit_group(uid)

    def _fingerprint(self) -> dict[str, Any]:
        # A cursor is only meaningful for the same rows, shuffle, sharding and mix. The mixing keys
        # are left out without mixing, so cursors saved before mixing existed still load.
        fp: dict[str, Any] = {
            "rows": len(self.rows),
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "shard_index": self.shard_index,
            "shard_count": self.shard_count,
        }
        if self.mix is not None:
            fp |= {
                "ratios": self.ratios,
                "batch_size": self.mix.batch_size,
                "source_rows": self.source_rows,
            }
        return fp

    def _save_state(self) -> None:
        if self.state_path is None:
            return
        state = {
            "format": STATE_FORMAT,
            **self._fingerprint(),
            "next_undone": self._next_undone,
            "done_ahead": sorted(self._done_ahead),
        }
        atomic_write_bytes(self.state_path, json.dumps(state).encode())

    def _load_state(self) -> None:
        if self.state_path is None or not self.state_path.exists():
            return
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
            fmt, nxt, ahead = state["format"], state["next_undone"], state["done_ahead"]
            saved = {k: state[k] for k in self._fingerprint() if k not in _MIX_KEYS}
            # A cursor saved with(out) mixing must not pass for one saved without (with) it.
            saved |= {k: state.get(k) for k in _MIX_KEYS if k in state or self.mix is not None}
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(
                f"{self.state_path}: unreadable data cursor ({type(e).__name__}: {e}); "
                "delete it to start the data from the beginning"
            ) from None
        if fmt != STATE_FORMAT:
            raise DataError(
                f"{self.state_path}: cursor format {fmt}, this build reads {STATE_FORMAT}"
            )
        if saved != self._fingerprint():
            raise DataError(
                f"{self.state_path}: the cursor was saved for {saved}, but the data and "
                f"sharding now give {self._fingerprint()}; delete it to start over"
            )
        if not isinstance(nxt, int) or not all(isinstance(p, int) and p > nxt for p in ahead):
            raise DataError(f"{self.state_path}: inconsistent cursor (next_undone={nxt!r})")
        self._next_undone, self._done_ahead = nxt, set(ahead)


def _load_sources(
    sources: Sequence[Source],
    default_agent_type: str,
    *,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    options: LayoutOptions = DEFAULT_LAYOUT,
) -> tuple[list[_Row], list[int]]:
    """Every source's rows, concatenated, and how many rows each source has."""
    rows: list[_Row] = []
    sizes: list[int] = []
    for source in sources:
        before = len(rows)
        for path in source.paths:
            fallback_name = source.name or Path(path).stem
            for row in load_rows(path, max_row_bytes=max_row_bytes, options=options):
                # A dataset's name is authoritative (metrics and rewards group by it); plain
                # train_files keep each row's own data_source. The agent is the most specific one
                # named: the row's own, else the dataset's, else data.agent_type.
                name = source.name or row.get("data_source") or fallback_name
                agent = row.get("agent") or source.agent_type or default_agent_type
                rows.append(_Row(row, name, agent))
        sizes.append(len(rows) - before)
    if not rows:
        raise DataError("no training rows: every configured source is empty")
    return rows, sizes


def _mixed_schedule(
    sources: Sequence[Source],
    sizes: Sequence[int],
    batch_size: int | None,
    *,
    seed: int,
    shuffle: bool,
) -> MixedSchedule | None:
    """The mixed schedule when the sources carry ratios; None when none does."""
    ratios = [s.ratio for s in sources]
    if all(r is None for r in ratios):
        return None
    names = [_source_name(s) for s in sources]
    if any(r is None or r <= 0 for r in ratios):
        bad = ", ".join(
            f"{n}={r}" for n, r in zip(names, ratios, strict=True) if r is None or r <= 0
        )
        raise DataError(f"data.datasets: every source of a mix needs a ratio above 0 (got {bad})")
    if batch_size is None or batch_size < 1:
        raise DataError(
            f"mixed sources need a batch size of at least 1 (data.train_batch_size), got {batch_size}"
        )
    for name, size in zip(names, sizes, strict=True):
        if size == 0:
            raise DataError(f"data.datasets: source {name!r} has no rows")
    ratios_f = [float(r) for r in ratios if r is not None]
    counts = batch_counts(ratios_f, batch_size)
    for name, ratio, count in zip(names, ratios_f, counts, strict=True):
        if count == 0:
            fix = smallest_fitting_batch_size(ratios_f, batch_size)
            raise DataError(
                f"data.datasets: source {name!r} (ratio {ratio:g}) gets 0 of the {batch_size} prompts "
                f"of a batch (data.train_batch_size={batch_size}, counts {dict(zip(names, counts, strict=True))}); "
                f"data.train_batch_size={fix} gives every source at least one, or raise its ratio"
            )
    return MixedSchedule(sizes, counts, seed=seed, shuffle=shuffle)


def _source_name(source: Source) -> str:
    return source.name or (Path(source.paths[0]).stem if source.paths else "<no files>")
