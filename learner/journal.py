"""The intake journal: an append-only, crash-safe log of every trajectory batch the learner accepted.

A batch is appended (and fsynced) before the protocol acknowledges it, because the ACK lets the
rollout server delete its own copy; from then on this file is the only one. Design:

- Records get ids 1, 2, ... that never repeat, also across restarts and compaction. A record holds
  the batch as the wire codec encodes it (the TRAJECTORY_BATCH frames: a msgpack header and the
  raw little-endian token columns; never pickle) plus who sent it (peer id, epoch, seq). Reading
  one back decodes and validates it with ``protocol.codec`` again: ``Trajectories`` whose arrays
  are views into the bytes read.
- Records live in segment files named by the first id they may hold (``<id>.seg``). A segment is
  created under a temporary name, fsynced and renamed into place (with the directory fsynced),
  so a segment file always has a valid header; records are appended to the newest segment only.
  After a restart new records go to a new segment, never after a record of an earlier lifetime.
- Each record is ``magic | crc32 | id | length | body``, the crc covering id, length and body. A
  learner killed mid-write leaves a torn last record (short, or with a wrong crc): opening the
  journal ignores it and cuts it off. A write that fails (disk full) is cut off the same way at
  once; if even that fails the journal refuses further appends (the protocol then refuses batches,
  and the senders keep them).
- Compaction (``truncate_before``) deletes whole segments whose records are all older than a
  given id. The newest segment is never deleted without first starting a new, empty one, whose
  name keeps the next id: ids stay monotonic even when every record is gone.

Appends come from the protocol driver's worker thread and compaction from the event loop; one lock
orders them. The sizes (``len``, ``nbytes``) are read without it, so a stats line never waits for
an fsync.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, cast

import msgpack
import numpy as np

from common.fileio import fsync_dir
from common.logging import get_logger
from protocol import codec
from protocol.batch import Trajectories
from protocol.messages import TrajectoryBatch
from protocol.trajectory import Trajectory

SEGMENT_MAGIC = b"AIJS"
RECORD_MAGIC = b"AIJR"
FORMAT_VERSION = 1
_SEGMENT_HEAD = struct.Struct("<4sIQ")  # magic, format version, first record id
_RECORD_HEAD = struct.Struct("<4sIQQ")  # magic, crc32, record id, body length
_ID_LEN = struct.Struct("<QQ")  # what the crc covers before the body
_META_LEN = struct.Struct("<I")
SUFFIX = ".seg"
# Records were validated when they were received: reading back only has to trust the sizes.
_READ_LIMITS = codec.CodecLimits(
    max_message_bytes=1 << 62, max_trajectories_per_batch=1 << 62, max_tokens_per_trajectory=1 << 62
)


class JournalError(Exception):
    """The journal cannot be used (a corrupt segment header, or storage that failed for good)."""


@dataclass(frozen=True)
class JournalRecord:
    record_id: int
    peer_id: str
    epoch: str
    seq: int
    trajectories: Trajectories
    nbytes: int  # size on disk, header included


@dataclass
class _Segment:
    first_id: int
    path: Path
    size: int  # bytes of valid content
    records: dict[int, tuple[int, int]] = field(default_factory=dict)  # id -> (offset, length)

    @property
    def last_id(self) -> int:
        return max(self.records) if self.records else self.first_id - 1


def _segment_name(first_id: int) -> str:
    return f"{first_id:020d}{SUFFIX}"


def _bytes_view(frame: codec.Frame) -> memoryview:
    m = frame.data if isinstance(frame, np.ndarray) else memoryview(frame)
    return m if m.format == "B" and m.ndim == 1 else m.cast("B")


def _write_all(fd: int, parts: Sequence[memoryview | bytes]) -> None:
    for part in parts:
        view = memoryview(part)
        while view.nbytes:
            view = view[os.write(fd, view) :]


class Journal:
    """Append-only journal in ``directory`` (created if needed). ``durable=False`` skips the fsyncs
    (tests, benchmarks); ``segment_bytes`` is the size after which a new segment starts."""

    def __init__(
        self, directory: Path, *, segment_bytes: int = 64 << 20, durable: bool = True
    ) -> None:
        self.directory = Path(directory)
        self.segment_bytes, self.durable = segment_bytes, durable
        self._log = get_logger("learner.journal")
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []
        self._active: _Segment | None = None  # the segment this lifetime appends to
        self._fd: int | None = None
        self._failed: str | None = None
        self.directory.mkdir(parents=True, exist_ok=True)
        # a segment whose creation was cut short
        for stray in self.directory.glob(f".*{SUFFIX}.tmp"):
            stray.unlink()
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            self._segments.append(self._scan(path))
        last = max((s.last_id for s in self._segments), default=0)
        self._next_id = max([last + 1, *(s.first_id for s in self._segments)])
        self._recount()

    # -- reading ---------------------------------------------------------------------------------
    @property
    def next_id(self) -> int:
        """The id the next record will get."""
        return self._next_id

    @property
    def record_ids(self) -> list[int]:
        with self._lock:
            return sorted(i for s in self._segments for i in s.records)

    @property
    def nbytes(self) -> int:
        """Bytes of the journal on disk."""
        return self._nbytes

    def __len__(self) -> int:
        return self._len

    def __contains__(self, record_id: object) -> bool:
        with self._lock:
            return any(record_id in s.records for s in self._segments)

    def read(self, record_id: int) -> JournalRecord:
        with self._lock:
            seg = next((s for s in self._segments if record_id in s.records), None)
            if seg is None:
                raise KeyError(f"record {record_id} is not in the journal {self.directory}")
            offset, length = seg.records[record_id]
            path = seg.path
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read(length)
        return _decode(record_id, data)

    def records(self, ids: Iterable[int] | None = None) -> Iterator[JournalRecord]:
        """Records in id order: all of them, or those of ``ids`` (missing ones raise KeyError)."""
        for rid in sorted(self.record_ids if ids is None else set(ids)):
            yield self.read(rid)

    # -- writing ---------------------------------------------------------------------------------
    def append(
        self, peer_id: str, epoch: str, seq: int, trajectories: Sequence[Trajectory]
    ) -> tuple[int, int]:
        """Write one batch durably; returns (record id, bytes written). Thread-safe."""
        frames = [
            _bytes_view(f)
            for f in codec.encode(TrajectoryBatch(seq=seq, trajectories=trajectories))
        ]
        # cast: msgpack's stub allows None (a Packer with autoreset off), packb always gives bytes
        meta = cast(
            bytes,
            msgpack.packb(
                {
                    "peer_id": peer_id,
                    "epoch": epoch,
                    "seq": seq,
                    "frames": [f.nbytes for f in frames],
                },
                use_bin_type=True,
            ),
        )
        parts: list[memoryview | bytes] = [_META_LEN.pack(len(meta)), meta, *frames]
        body_len = sum(memoryview(p).nbytes for p in parts)
        with self._lock:
            if self._failed:
                raise JournalError(f"journal {self.directory} is unusable: {self._failed}")
            rid = self._next_id
            crc = zlib.crc32(_ID_LEN.pack(rid, body_len))
            for p in parts:
                crc = zlib.crc32(p, crc)
            head = _RECORD_HEAD.pack(RECORD_MAGIC, crc, rid, body_len)
            seg, fd = self._writable(_RECORD_HEAD.size + body_len)
            offset = seg.size
            self._next_id += 1  # consumed even by a failed write: an id is never reused
            try:
                _write_all(fd, [head, *parts])
                if self.durable:
                    os.fsync(fd)
            except OSError as e:
                self._cut(fd, offset, e)
                raise
            seg.size = offset + _RECORD_HEAD.size + body_len
            seg.records[rid] = (offset, seg.size - offset)
            self._recount()
            return rid, seg.size - offset

    def advance_to(self, next_id: int) -> None:
        """Never hand out an id below ``next_id`` (a checkpoint saw ids up to ``next_id - 1``)."""
        with self._lock:
            if next_id > self._next_id:
                self._next_id = next_id
                self._start_segment()  # its name keeps the floor across restarts

    def truncate_before(self, record_id: int) -> int:
        """Delete the segments whose records all have ids below ``record_id``; returns how many
        records went. Records at or above it are kept (and some below it, in shared segments)."""
        with self._lock:
            doomed = [s for s in self._segments if s.records and s.last_id < record_id]
            if not doomed:
                return 0
            if self._segments[-1] in doomed:  # keep a segment that names the next id
                self._start_segment()
            for s in doomed:
                if s is self._active:
                    self._close_fd()
                    self._active = None
                s.path.unlink()
                self._segments.remove(s)
            # Empty segments older than the newest hold nothing and name nothing needed.
            for s in [s for s in self._segments[:-1] if not s.records and s is not self._active]:
                s.path.unlink()
                self._segments.remove(s)
            if self.durable:
                fsync_dir(self.directory)
            self._recount()
            return sum(len(s.records) for s in doomed)

    def clear(self) -> None:
        """Delete every record (a fresh run); ids start again at 1."""
        with self._lock:
            self._close_fd()
            self._active = None
            for s in self._segments:
                s.path.unlink()
            self._segments.clear()
            self._next_id = 1
            self._failed = None
            if self.durable:
                fsync_dir(self.directory)
            self._recount()

    def close(self) -> None:
        with self._lock:
            self._close_fd()

    # -- internals -------------------------------------------------------------------------------
    def _writable(self, nbytes: int) -> tuple[_Segment, int]:
        seg = self._active
        if (
            seg is None
            or self._fd is None
            or (seg.records and seg.size + nbytes > self.segment_bytes)
        ):
            seg = self._start_segment()
        assert self._fd is not None
        return seg, self._fd

    def _start_segment(self) -> _Segment:
        """A new, empty segment named by the next id (created atomically), now the one appended to."""
        self._close_fd()
        first = self._next_id
        path = self.directory / _segment_name(first)
        if path.exists():  # an empty segment of the same name (no record was written since)
            seg = next(s for s in self._segments if s.path == path)
        else:
            tmp = self.directory / f".{path.name}.tmp"
            with tmp.open("wb") as f:
                f.write(_SEGMENT_HEAD.pack(SEGMENT_MAGIC, FORMAT_VERSION, first))
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if self.durable:
                fsync_dir(self.directory)
            seg = _Segment(first, path, _SEGMENT_HEAD.size)
            self._segments.append(seg)
        self._fd = os.open(path, os.O_WRONLY)
        os.lseek(self._fd, seg.size, os.SEEK_SET)
        self._active = seg
        self._recount()
        return seg

    def _cut(self, fd: int, offset: int, error: OSError) -> None:
        """Remove a partly written record; if that fails too, refuse all further appends."""
        try:
            os.ftruncate(fd, offset)
            os.lseek(fd, offset, os.SEEK_SET)
            if self.durable:
                os.fsync(fd)
        except OSError as e2:
            self._failed = f"a write failed ({error}) and could not be undone ({e2})"
            self._log.error("journal unusable", directory=str(self.directory), error=self._failed)

    def _recount(self) -> None:
        self._len = sum(len(s.records) for s in self._segments)
        self._nbytes = sum(s.size for s in self._segments)

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _scan(self, path: Path) -> _Segment:
        """Index a segment, checking every record; a torn tail is cut off."""
        with path.open("rb") as f:
            head = f.read(_SEGMENT_HEAD.size)
            if len(head) < _SEGMENT_HEAD.size:
                raise JournalError(f"{path}: truncated segment header")
            magic, version, first = _SEGMENT_HEAD.unpack(head)
            if (
                magic != SEGMENT_MAGIC
                or version != FORMAT_VERSION
                or path.name != _segment_name(first)
            ):
                raise JournalError(
                    f"{path}: not an intake journal segment of format {FORMAT_VERSION}"
                )
            seg = _Segment(first, path, _SEGMENT_HEAD.size)
            prev = first - 1
            total = os.fstat(f.fileno()).st_size
            while seg.size < total:
                reason = self._check_record(f, seg.size, total, prev)
                if isinstance(reason, str):
                    self._log.warning(
                        "torn record at the end of the journal ignored",
                        segment=path.name,
                        offset=seg.size,
                        bytes=total - seg.size,
                        reason=reason,
                    )
                    break
                rid, length = reason
                seg.records[rid] = (seg.size, length)
                seg.size += length
                prev = rid
        if seg.size < total:
            with path.open("r+b") as f:
                f.truncate(seg.size)
                if self.durable:
                    os.fsync(f.fileno())
        return seg

    @staticmethod
    def _check_record(f: BinaryIO, offset: int, total: int, prev: int) -> tuple[int, int] | str:
        """(id, length) of the valid record at ``offset``, or why there is none."""
        f.seek(offset)
        head = f.read(_RECORD_HEAD.size)
        if len(head) < _RECORD_HEAD.size:
            return "short header"
        magic, crc, rid, body_len = _RECORD_HEAD.unpack(head)
        if magic != RECORD_MAGIC:
            return "bad magic"
        if offset + _RECORD_HEAD.size + body_len > total:
            return "short body"
        if rid <= prev:
            return f"record id {rid} after {prev}"
        check = zlib.crc32(_ID_LEN.pack(rid, body_len))
        left = body_len
        while left:
            chunk = f.read(min(left, 16 << 20))
            if not chunk:
                return "short body"
            check = zlib.crc32(chunk, check)
            left -= len(chunk)
        if check != crc:
            return "crc mismatch"
        return rid, _RECORD_HEAD.size + body_len


def _decode(record_id: int, data: bytes) -> JournalRecord:
    _, crc, rid, body_len = _RECORD_HEAD.unpack_from(data)
    body = memoryview(data)[_RECORD_HEAD.size :]
    if rid != record_id or zlib.crc32(body, zlib.crc32(_ID_LEN.pack(rid, body_len))) != crc:
        raise JournalError(f"record {record_id} changed on disk since the journal was opened")
    (meta_len,) = _META_LEN.unpack_from(body)
    meta = msgpack.unpackb(body[_META_LEN.size : _META_LEN.size + meta_len], raw=False)
    frames, pos = [], _META_LEN.size + meta_len
    for n in meta["frames"]:
        frames.append(body[pos : pos + n])
        pos += n
    msg = codec.decode(frames, _READ_LIMITS)
    assert isinstance(msg, TrajectoryBatch) and isinstance(msg.trajectories, Trajectories)
    return JournalRecord(
        record_id, meta["peer_id"], meta["epoch"], meta["seq"], msg.trajectories, len(data)
    )
