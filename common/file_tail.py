"""Following a file another process appends to: its new complete lines, read incrementally.

Design: one reader for every "tail a log or JSONL file while a child writes it" in the project
(bin/train's events and metrics, bin/chaos, the benches' watchers). Each read opens the file, reads
from where the last one ended, and keeps a partial last line for the next read, so a line is seen
once and only whole. A file replaced (another inode) is read from its start; one cut back below the
offset (a writer dropped its partial last line) is read from its new end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class LineTail:
    """New complete lines of ``path``: from its size at construction on, or from its start with
    ``from_start`` (a file the follower must read whole, e.g. one created just before)."""

    def __init__(self, path: Path, *, from_start: bool = False) -> None:
        self.path = path
        st = None if from_start or not path.exists() else path.stat()
        self.offset = st.st_size if st else 0
        self.inode = st.st_ino if st else None
        self._partial = b""

    def read_lines(self) -> list[bytes]:
        """The lines completed since the last read (without their newline); [] while the file is
        missing."""
        try:
            with self.path.open("rb") as f:
                st = os.fstat(f.fileno())
                if self.inode is None:
                    self.inode = st.st_ino
                elif st.st_ino != self.inode:  # a new file: read it from the start
                    self.inode, self.offset, self._partial = st.st_ino, 0, b""
                elif st.st_size < self.offset:  # cut back
                    self.offset, self._partial = st.st_size, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return lines


class JsonlTail(LineTail):
    """New JSON objects of a JSONL file; a line that is not a JSON object is skipped."""

    def read(self) -> list[dict[str, Any]]:
        out = []
        for line in self.read_lines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out
