"""Which slot file the next policy version is written to (the weights file hand-over, driver side).

Design: the learner keeps at most ``slots`` safetensors files under one run-private directory on
/dev/shm (``<dir>/agentrl-weights-<pid>-<id>/v<version>/model.safetensors``, the convention of
``protocol.slot_files``).
Version N reuses the file of an older version, renamed to ``v<N>`` and rewritten in place by rank 0
(``weights_file_writer``), once that older file is safe to overwrite:
- every rollout server that takes files has applied a newer version (servers apply versions in
  order, so none will read it again), and
- no chunked transfer was planned from it (ZeroMQ may still be sending slices of its pages).
A file that fails the second rule is retired instead: unlinked, its pages live on while mapped.
When no slot is free and none can be added, the version goes out as chunks only.

Cleanup. Everything is removed when the learner stops: ``close`` on every way out of the trainer
(normal end, error, SIGTERM/Ctrl-C, which the trainer turns into cancellation), and an ``atexit``
hook for a ``SystemExit`` raised outside it. A learner that could not run either (SIGKILL, OOM
killer) leaves its directory behind: ``protocol.slot_files.remove_stale`` at the next start deletes
the directories whose pid (in the name) is no longer alive.
"""

from __future__ import annotations

import atexit
import shutil
from dataclasses import dataclass
from pathlib import Path

from protocol.slot_files import FILE_NAME, make_root


@dataclass
class _Slot:
    id: int
    version: int
    folder: Path
    reusable: bool = True

    @property
    def path(self) -> Path:
        return self.folder / FILE_NAME


class WeightFiles:
    def __init__(self, parent: str | Path, slots: int) -> None:
        self.root = make_root(parent)
        atexit.register(self.close)  # a SystemExit that bypasses the trainer's own cleanup
        self.max_slots = slots
        self._slots: list[_Slot] = []
        self._current: _Slot | None = None
        self._ids = 0

    def take(self, version: int, *, oldest_applied: int | None) -> tuple[int, Path] | None:
        """The slot id and file path to write ``version`` into, or None (publish as chunks).
        ``oldest_applied``: the lowest version applied by a connected server that takes files
        (None: no such server)."""
        done = (
            (lambda s: True) if oldest_applied is None else (lambda s: s.version < oldest_applied)
        )
        old = [s for s in self._slots if s is not self._current and done(s)]
        for s in [s for s in old if not s.reusable]:  # retire: nobody reads it any more
            shutil.rmtree(s.folder, ignore_errors=True)
            self._slots.remove(s)
        free = [s for s in old if s.reusable]
        folder = self.root / f"v{version}"
        if free:
            slot = min(free, key=lambda s: s.version)
            slot.folder.rename(folder)
        elif len(self._slots) < self.max_slots:
            self._ids += 1
            slot = _Slot(self._ids, version, folder)
            folder.mkdir()
            self._slots.append(slot)
        else:
            return None
        slot.folder, slot.version, slot.reusable = folder, version, True
        return slot.id, slot.path

    def published(self, version: int, *, replaced_chunked: bool) -> None:
        """``version`` is announced (from its file, or as chunks only): it is the current one now.
        ``replaced_chunked``: chunks were cut from the file it replaces (read just before the
        publish, with no await in between, so no later planning can be missed)."""
        if self._current is not None and replaced_chunked:
            self._current.reusable = False
        self._current = next((s for s in self._slots if s.version == version), None)

    def failed(self, slot_id: int) -> None:
        """Writing into the slot failed midway: drop it (a half-written file is never announced)."""
        for s in [s for s in self._slots if s.id == slot_id]:
            shutil.rmtree(s.folder, ignore_errors=True)
            self._slots.remove(s)

    def close(self) -> None:
        """Remove every file (idempotent)."""
        shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.close)
