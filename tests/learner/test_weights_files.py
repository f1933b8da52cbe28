"""Slot files of the weights file hand-over: reuse only once every file-taking server applied a
newer version, retire files chunks were cut from, fall back to chunks when full, clean up on every
exit (SIGTERM and Ctrl-C included), and the directories of killed learners at the next start."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from learner.weights_files import WeightFiles
from protocol.slot_files import remove_stale


def _publish(
    files: WeightFiles, version: int, *, current_chunked: bool = False, **kw
) -> tuple[int, Path] | None:
    got = files.take(version, **kw)
    if got is not None:
        got[1].write_bytes(f"v{version}".encode())
    files.published(version, replaced_chunked=current_chunked)
    return got


def test_slots_are_reused_in_place_once_every_server_moved_on(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path, slots=2)
    s1, p1 = _publish(files, 1, oldest_applied=0)
    s2, p2 = _publish(files, 2, oldest_applied=0)
    assert s1 != s2 and p1.parent.name == "v1" and p2.parent.name == "v2"
    assert files.take(3, oldest_applied=1) is None  # v1 may still be read
    s3, p3 = _publish(files, 3, oldest_applied=2)
    assert s3 == s1 and p3.parent.name == "v3" and not p1.exists()
    assert p3.read_bytes() == b"v3"
    files.close()
    assert not files.root.exists()


def test_a_file_chunks_were_cut_from_is_retired_not_rewritten(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path, slots=2)
    s1, p1 = _publish(files, 1, oldest_applied=None)
    s2, _ = _publish(files, 2, oldest_applied=None, current_chunked=True)  # chunks came from v1
    s3, _ = _publish(files, 3, oldest_applied=None)
    assert s1 not in (s2, s3) and not p1.parent.exists()  # retired, a new slot took its place
    assert len(list(files.root.iterdir())) == 2


def test_the_current_file_is_never_taken(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path, slots=2)
    _publish(files, 1, oldest_applied=None)
    _, p2 = _publish(files, 2, oldest_applied=None)
    _, p3 = _publish(files, 3, oldest_applied=None)
    assert p3.parent.name == "v3" and p2.read_bytes() == b"v2"  # v1's slot was reused, not v2's


def test_a_failed_write_drops_its_slot(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path, slots=2)
    slot, path = files.take(1, oldest_applied=None)
    files.failed(slot)
    assert not path.parent.exists() and files.take(1, oldest_applied=None) is not None


def test_a_version_sent_as_chunks_only_leaves_no_current_file(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path, slots=2)
    _, p1 = _publish(files, 1, oldest_applied=0)
    _, p2 = _publish(files, 2, oldest_applied=0)
    assert files.take(3, oldest_applied=0) is None  # both files may still be read: chunks only
    files.published(3, replaced_chunked=True)  # chunks had been cut from v2's file
    _, p4 = _publish(files, 4, oldest_applied=3)
    # v1 reused, v2 retired
    assert p4.parent.name == "v4" and not p1.exists() and not p2.parent.exists()
    assert [d.name for d in files.root.iterdir()] == ["v4"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.integration
def test_remove_stale_deletes_only_dead_learners_directories(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = tmp_path / f"agentrl-weights-{_dead_pid()}-0a1b2c3d"
        (dead / "v3").mkdir(parents=True)
        (dead / "v3" / "model.safetensors").write_bytes(b"x")
        live = tmp_path / f"agentrl-weights-{sleeper.pid}-0a1b2c3d"
        live.mkdir()
        mine = WeightFiles(tmp_path, slots=2)
        other = tmp_path / "agentrl-weights-notapid"  # not ours to judge
        other.mkdir()
        assert remove_stale(tmp_path) == [dead]
        assert not dead.exists() and live.exists() and mine.root.exists() and other.exists()
        mine.close()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_stale(tmp_path) == [live]  # its process is gone now
    assert remove_stale(tmp_path / "missing") == []


_HOLDER = """
import signal, sys, time
from learner.weights_files import WeightFiles
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # what ray.init installs in the learner
files = WeightFiles(sys.argv[1], slots=2)
print(files.root, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
@pytest.mark.integration
def test_files_are_gone_after_any_exit_or_at_the_next_start(tmp_path: Path, sig: int) -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
        text=True,
    )
    assert p.stdout is not None
    root = Path(p.stdout.readline().strip())
    assert root.is_dir()
    p.send_signal(sig)
    p.wait(timeout=30)
    if sig == signal.SIGKILL:  # no chance to clean up: the next start does
        assert root.exists() and remove_stale(tmp_path) == [root]
    assert not root.exists()
