"""Epoch arithmetic: how many training steps ``trainer.total_epochs`` epochs of the data make.

Design: the learner and bin/train both need the step count before any rollout server reads the
data, so it lives here, below every package that needs it (the learner no longer imports the
rollout server's data module). Rows are only counted here, not validated: a bad row is refused by
the rollout server's loader (``rollout_service/data.py``), which reads the same three formats and
counts them the same way (JSONL: non-blank lines; JSON: the list's length; parquet: its rows).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import Config


def count_rows(path: str | Path) -> int:
    """Rows in one data file (.jsonl, .json list or .parquet)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        with p.open("rb") as f:
            return sum(1 for line in f if line.strip())
    if suffix == ".json":
        data = json.loads(p.read_bytes())
        return len(data) if isinstance(data, list) else 0
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(p).metadata.num_rows)
    raise ValueError(f"{p}: unknown data file type {suffix!r} (expected .json, .jsonl, .parquet)")


def steps_per_epoch(rows: int, batch_size: int, *, mixed: bool) -> int:
    """Batches in one epoch: whole batches only, except mixed sources (``data.datasets``), whose
    epoch is ceil(rows / batch) batches (``rollout_service/mixing.py`` fills the last one)."""
    return -(-rows // batch_size) if mixed else rows // batch_size


def train_paths(config: Config) -> Sequence[str]:
    data = config.data
    if data.datasets:
        return [p for d in data.datasets for p in d.path]
    return data.train_files


def total_steps(config: Config) -> int:
    """``trainer.total_training_steps`` when set, else ``trainer.total_epochs`` epochs (at least 1)."""
    if config.trainer.total_training_steps:
        return config.trainer.total_training_steps
    rows = sum(count_rows(p) for p in train_paths(config))
    batches = steps_per_epoch(rows, config.data.train_batch_size, mixed=bool(config.data.datasets))
    return max(1, config.trainer.total_epochs * batches)
