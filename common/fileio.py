"""Atomic file writes: a reader, or a process restarted after a crash, sees the old content or the
new, never a mix.

Design: write a temporary sibling (``.NAME.tmp-PID``, a name readers ignore and crash recovery can
find), then rename it over the target. ``durable`` also fsyncs the file and its directory, for files
that are the only copy of something (a spooled batch, the data cursor); without it the write costs
no disk flush (configs, generated data).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    with tmp.open("wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Rows as JSON lines, written atomically (not fsynced: generated data can be made again)."""
    atomic_write_bytes(
        path, "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8"), durable=False
    )


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries durable: a file created or renamed in it survives a crash only
    once this returns (the file's own fsync does not cover its name)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
