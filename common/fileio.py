"""Atomic file writes: a reader, or a process restarted after a crash, sees the old content or the
new, never a mix.

Design: write a temporary sibling (``.NAME.tmp-PID``, a name readers ignore and crash recovery can
find), then rename it over the target. ``durable`` also fsyncs the file and its directory, for files
that are the only copy of something (a spooled batch, the data cursor); without it the write costs
no disk flush (configs, generated data).
"""

from __future__ import annotations

import os
from pathlib import Path


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
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # The rename itself is only durable once the directory entry is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
