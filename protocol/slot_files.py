"""The slot-file convention: where weights files lie on a host's /dev/shm, shared by every process
that writes them (the learner, ``learner.weights_files``; a weight relay, ``rollout_service.relay``)
and every one that reads them (a rollout server, ``protocol.weights.check_weights_file``).

Design: each writer owns one private directory ``<dir>/agentrl-weights-<pid>-<id>/`` (``make_root``)
holding one folder per slot, each with one ``model.safetensors`` (vLLM reloads a directory). A
reader accepts a file only inside such a directory, so a peer cannot make a server map an arbitrary
path. The pid in the name is what makes cleanup possible without a registry: a writer killed with
no chance to clean up (SIGKILL, OOM killer) leaves its directory behind, and ``remove_stale`` at the
next writer's start deletes the directories whose pid is no longer alive, so /dev/shm never fills
up with dead runs' weights.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

FILE_NAME = "model.safetensors"
PREFIX = "agentrl-weights-"
NAME = re.compile(rf"{PREFIX}(\d+)-[0-9a-f]+")
"""A slot root's name; group 1 is the pid of the process that made it."""


def make_root(parent: str | Path) -> Path:
    """A new private directory of this process under ``parent`` (created, parents too)."""
    root = Path(parent) / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    try:  # a zombie (killed, not yet reaped by its parent) is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale(parent: str | Path, name: re.Pattern[str] = NAME) -> list[Path]:
    """Delete the weights directories under ``parent`` left by learners that are no longer alive
    (killed with no chance to clean up); returns what was removed. A directory of a live process
    (another learner on this machine) or of another user is left alone. ``name``: the directories'
    names, group 1 the pid of the process that made each (another kind of per-process directory)."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for d in entries:
        m = name.fullmatch(d.name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        try:
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed
