"""Slot files of the weights file hand-over: reuse only once every file-taking server applied a
newer version, retire files chunks were cut from, fall back to chunks when full, clean up."""

from __future__ import annotations

from pathlib import Path

from learner.weights_files import WeightFiles


def _publish(files: WeightFiles, version: int, **kw) -> tuple[int, Path] | None:
    got = files.take(version, **kw)
    if got is not None:
        got[1].write_bytes(f"v{version}".encode())
        files.published(version)
    return got


def test_slots_are_reused_in_place_once_every_server_moved_on(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path, slots=2)
    s1, p1 = _publish(files, 1, oldest_applied=0, current_chunked=False)
    s2, p2 = _publish(files, 2, oldest_applied=0, current_chunked=False)
    assert s1 != s2 and p1.parent.name == "v1" and p2.parent.name == "v2"
    assert files.take(3, oldest_applied=1, current_chunked=False) is None  # v1 may still be read
    s3, p3 = _publish(files, 3, oldest_applied=2, current_chunked=False)
    assert s3 == s1 and p3.parent.name == "v3" and not p1.exists()
    assert p3.read_bytes() == b"v3"
    files.close()
    assert not files.root.exists()


def test_a_file_chunks_were_cut_from_is_retired_not_rewritten(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path, slots=2)
    s1, p1 = _publish(files, 1, oldest_applied=None, current_chunked=False)
    s2, _ = _publish(files, 2, oldest_applied=None, current_chunked=True)  # chunks came from v1
    s3, p3 = _publish(files, 3, oldest_applied=None, current_chunked=False)
    assert s1 not in (s2, s3) and not p1.parent.exists()  # retired, a new slot took its place
    assert len(list(files.root.iterdir())) == 2


def test_the_current_file_is_never_taken(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path, slots=2)
    _publish(files, 1, oldest_applied=None, current_chunked=False)
    _, p2 = _publish(files, 2, oldest_applied=None, current_chunked=False)
    _, p3 = _publish(files, 3, oldest_applied=None, current_chunked=False)
    assert p3.parent.name == "v3" and p2.read_bytes() == b"v2"  # v1's slot was reused, not v2's


def test_a_failed_write_drops_its_slot(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path, slots=2)
    slot, path = files.take(1, oldest_applied=None, current_chunked=False)
    files.failed(slot)
    assert not path.parent.exists() and files.take(1, oldest_applied=None, current_chunked=False) is not None
