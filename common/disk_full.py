"""A full disk ends a process cleanly: one line naming the path, a known exit status, no traceback.

Design: every process writes to its run directory (journal, checkpoints, metrics, recordings,
logs). Writes are atomic (a temporary file renamed into place) or append whole records, so a write
refused for lack of space leaves nothing torn, and the process cannot go on without it. The
entrypoints' common ``main`` (`common.cli`) finds the refusal in what ended the run, however deep
in task groups or exception chains (`find`), logs the path and exits ``EXIT_DISK_FULL``
(sysexits' EX_IOERR). bin/train says so when the learner stops on it; a rollout server that stops
on it is restarted like any other, since space may have been freed by then.
"""

from __future__ import annotations

import errno
import traceback

EXIT_DISK_FULL = 74
_FULL = {errno.ENOSPC, errno.EDQUOT}


def find(exc: BaseException) -> OSError | None:
    """The disk-full ``OSError`` behind ``exc`` (itself, in its group, its cause or context)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def describe(e: OSError) -> str:
    """``No space left on device: /run/x/journal.bin``: the path is what the operator acts on.
    A write to a file already open names no path: then the code that wrote it is named."""
    if e.filename is not None:
        return f"{e.strerror or 'the disk is full'}: {e.filename}"
    frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ is not None else []
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown"
    return f"{e.strerror or 'the disk is full'}: a file written at {where}"
