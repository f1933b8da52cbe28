"""The intake journal: round trip, torn tails (also from a real SIGKILL), failed writes, compaction."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import learner.journal as journal_mod
from learner.journal import Journal, JournalError
from protocol.batch import Trajectories
from protocol.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[2]


def traj(tid: str, group: str = "g", *, seed: int = 0, response_len: int = 5) -> Trajectory:
    rng = np.random.default_rng(seed)
    mask = np.ones(response_len, np.uint8)
    mask[1::3] = 0
    return Trajectory(
        tid,
        group,
        rng.integers(0, 500, 4, dtype=np.int32),
        rng.integers(0, 500, response_len, dtype=np.int32),
        mask,
        (-rng.random(response_len, dtype=np.float32) * mask).astype(np.float32),
        np.full(response_len, seed % 7, np.int32),
        reward=float(seed) / 3,
        snapshot_index=seed % 2,
        reward_extras={"pass": bool(seed % 2), "score": 0.5},
        timings={"gen": 1.25},
        termination="length",
    )


def batch(tag: str, n: int = 3) -> list[Trajectory]:
    return [traj(f"{tag}-{i}", f"{tag}-g{i % 2}", seed=i) for i in range(n)]


def same(a: Trajectory, b: Trajectory) -> bool:
    arrays = ("prompt_ids", "response_ids", "response_mask", "rollout_logprobs", "versions")
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in arrays) and all(
        getattr(a, k) == getattr(b, k) for k in Trajectory.__dataclass_fields__ if k not in arrays
    )


def segments(d: Path) -> list[Path]:
    return sorted(d.glob("*.seg"))


def test_round_trip_and_reopen(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    b1, b2 = batch("a"), Trajectories.from_list(batch("b", 4))
    assert j.append("rs-0", "ep-1", 1, b1)[0] == 1
    rid, nbytes = j.append("rs-1", "ep-2", 9, b2)
    assert rid == 2 and nbytes > 0 and j.nbytes > nbytes
    j.close()
    j2 = Journal(tmp_path)
    assert j2.record_ids == [1, 2] and j2.next_id == 3
    recs = list(j2.records())
    assert [(r.record_id, r.peer_id, r.epoch, r.seq) for r in recs] == [
        (1, "rs-0", "ep-1", 1),
        (2, "rs-1", "ep-2", 9),
    ]
    assert all(same(x, y) for x, y in zip(recs[0].trajectories, b1, strict=True))
    assert all(same(x, y) for x, y in zip(recs[1].trajectories, b2, strict=True))
    assert isinstance(recs[1].trajectories, Trajectories)
    assert j2.append("rs-0", "ep-1", 2, batch("c"))[0] == 3
    assert len(segments(tmp_path)) == 2  # the new lifetime wrote to a new segment


def test_torn_last_record_is_ignored_and_cut_off(tmp_path: Path) -> None:
    j = Journal(tmp_path, durable=False)
    for i in range(3):
        j.append("rs", "e", i + 1, batch(f"b{i}"))
    j.close()
    (seg,) = segments(tmp_path)
    full = seg.stat().st_size
    with seg.open("r+b") as f:  # the last record lost its tail (killed mid-write)
        f.truncate(full - 17)
    j2 = Journal(tmp_path)
    assert j2.record_ids == [1, 2]
    assert seg.stat().st_size < full - 17  # the torn bytes are gone
    # never acknowledged: its id may be reused
    assert j2.append("rs", "e", 3, batch("again"))[0] == 3
    j2.close()
    assert Journal(tmp_path).record_ids == [1, 2, 3]


def test_corrupt_last_record_and_garbage_tail_are_ignored(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.append("rs", "e", 1, batch("a"))
    j.append("rs", "e", 2, batch("b"))
    j.close()
    (seg,) = segments(tmp_path)
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0xFF  # a flipped byte in the last record: crc mismatch
    seg.write_bytes(bytes(data) + b"\x00garbage")
    assert Journal(tmp_path).record_ids == [1]


def test_bad_segment_header_is_an_error(tmp_path: Path) -> None:
    (tmp_path / f"{1:020d}.seg").write_bytes(b"not a journal")
    with pytest.raises(JournalError):
        Journal(tmp_path)


def test_failed_write_is_undone_and_the_journal_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    j = Journal(tmp_path)
    j.append("rs", "e", 1, batch("a"))
    real = journal_mod._write_all

    def half_then_fail(fd: int, parts: list) -> None:
        real(fd, parts[:2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_mod, "_write_all", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        j.append("rs", "e", 2, batch("b"))
    monkeypatch.setattr(journal_mod, "_write_all", real)
    rid, _ = j.append("rs", "e", 2, batch("b"))
    assert rid == 3  # the failed record's id is not reused
    j.close()
    j2 = Journal(tmp_path)
    assert j2.record_ids == [1, 3] and j2.read(3).seq == 2


def test_failed_undo_makes_the_journal_refuse_appends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    j = Journal(tmp_path)

    def fail(*_: object) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(journal_mod, "_write_all", fail)
    monkeypatch.setattr(journal_mod.os, "ftruncate", fail)
    with pytest.raises(OSError):
        j.append("rs", "e", 1, batch("a"))
    monkeypatch.undo()
    with pytest.raises(JournalError, match="unusable"):
        j.append("rs", "e", 1, batch("a"))


def test_compaction_deletes_whole_old_segments_and_keeps_ids_monotonic(tmp_path: Path) -> None:
    j = Journal(tmp_path, segment_bytes=1)  # one record per segment
    for i in range(5):
        j.append("rs", "e", i + 1, batch(f"b{i}"))
    assert len(segments(tmp_path)) == 5
    assert j.truncate_before(3) == 2
    assert j.record_ids == [3, 4, 5] and len(segments(tmp_path)) == 3
    assert j.truncate_before(3) == 0
    assert j.truncate_before(100) == 3
    assert j.record_ids == [] and len(segments(tmp_path)) == 1  # an empty segment names the next id
    j.close()
    j2 = Journal(tmp_path)
    assert j2.next_id == 6 and j2.append("rs", "e", 6, batch("c"))[0] == 6


def test_compaction_keeps_records_of_a_shared_segment(tmp_path: Path) -> None:
    j = Journal(tmp_path)  # everything in one segment
    for i in range(3):
        j.append("rs", "e", i + 1, batch(f"b{i}"))
    assert j.truncate_before(3) == 0 and j.record_ids == [1, 2, 3]
    assert j.truncate_before(4) == 3 and j.record_ids == []
    assert j.append("rs", "e", 4, batch("c"))[0] == 4


def test_advance_to_and_clear(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.advance_to(50)
    j.close()
    j = Journal(tmp_path)
    assert j.next_id == 50 and j.append("rs", "e", 1, batch("a"))[0] == 50
    j.clear()
    assert j.record_ids == [] and j.next_id == 1 and not segments(tmp_path)
    assert j.append("rs", "e", 1, batch("a"))[0] == 1


_WRITER = """
import os, pathlib, sys, time
import numpy as np
import learner.journal as journal
from learner.journal import Journal
from protocol.trajectory import Trajectory
real_write_all = journal._write_all
def torn(fd, parts):  # from the 5th record on: half of the record's bytes, then stop mid-write
    data = b"".join(bytes(p) for p in parts)
    real_write_all(fd, [data[: len(data) // 2]])
    pathlib.Path(sys.argv[2]).touch()
    time.sleep(600)
j = Journal(pathlib.Path(sys.argv[1]))
n = 200_000
for seq in range(1, 6):  # records of one size: ids of a fixed width
    if seq == 5:
        journal._write_all = torn
    j.append("rs", "e", seq, [Trajectory(f"t{seq:08d}", "g", np.zeros(4, np.int32), np.ones(n, np.int32),
                                         np.ones(n, np.uint8), np.zeros(n, np.float32), np.zeros(n, np.int32))])
"""


@pytest.mark.integration
def test_sigkill_mid_write_leaves_a_readable_journal(tmp_path: Path) -> None:
    """A writer process is killed in the middle of writing its 5th record (it wrote half of the
    record's bytes and stopped there): every complete record reads back, the torn tail is cut off."""
    d, torn = tmp_path / "j", tmp_path / "torn"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(d), str(torn)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    seg = d / f"{1:020d}.seg"

    def size() -> int:
        return seg.stat().st_size if seg.exists() else 0

    try:
        deadline = time.monotonic() + 120  # a bound on a hang (the writer's start-up), not a speed
        while not torn.exists():
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    with seg.open("rb") as f:  # segment header (16 bytes), then the first record's header
        record_bytes = 24 + struct.unpack("<4sIQQ", f.read(40)[16:])[3]
    assert (size() - 16) % record_bytes != 0, "the tail is not torn"
    before = size()
    j = Journal(d)
    ids = j.record_ids
    assert ids == [1, 2, 3, 4]
    assert [r.seq for r in j.records()] == ids
    assert [r.trajectories[0].trajectory_id for r in j.records([ids[-1]])] == [f"t{ids[-1]:08d}"]
    assert size() == 16 + len(ids) * record_bytes <= before  # a torn tail, if any, was cut off
