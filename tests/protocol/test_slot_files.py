"""The slot-file convention (``protocol.slot_files``): a writer's private directory is named for its
process, a reader accepts files only inside such a directory, and cleanup spares the living."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protocol.errors import ProtocolError
from protocol.slot_files import FILE_NAME, PREFIX, make_root, remove_stale
from protocol.weights import check_weights_file


def test_a_root_is_named_for_its_process_and_survives_cleanup(tmp_path: Path) -> None:
    root = make_root(tmp_path / "shm")
    assert root.parent == tmp_path / "shm" and root.name.startswith(f"{PREFIX}{os.getpid()}-")
    dead = tmp_path / "shm" / f"{PREFIX}999999999-abcdef12"
    dead.mkdir()
    assert remove_stale(tmp_path / "shm") == [dead] and root.is_dir()


def test_readers_accept_only_files_inside_a_slot_directory(tmp_path: Path) -> None:
    slot = make_root(tmp_path) / "v1"
    slot.mkdir()
    inside = slot / FILE_NAME
    inside.write_bytes(b"x" * 64)
    outside = tmp_path / FILE_NAME
    outside.write_bytes(b"x" * 64)
    assert check_weights_file(str(inside), [str(tmp_path)], 8) == os.path.realpath(inside)
    with pytest.raises(ProtocolError, match="not inside a learner weights directory"):
        check_weights_file(str(outside), [str(tmp_path)], 8)
