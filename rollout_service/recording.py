"""Batch files: the on-disk form of a trajectory batch, used by recordings and by the spool.

One file holds one batch as a msgpack map (format in RECORDING.md): a format version, the server
id, a sequence number, the time, and ``frames``: the TRAJECTORY_BATCH exactly as framed on the
wire, each frame a msgpack bin. Keeping the wire frames (rather than a second serialisation)
means reading a file back goes through ``protocol.codec.decode``, so a replay or a resend gets
trajectories validated by the same code as the learner's, and nothing is ever unpickled.

Files are written to a temporary name and renamed, so a reader never sees half a batch; spool
files are also fsynced (they are the only copy until the learner acknowledges them). Each file
carries an xxh3 checksum of every frame and of its meta, and every reader checks them (unless
asked not to, ``verify=False``), so a flipped byte or an edited reward or mask is refused with the
file and the part named, not replayed or trained. Format 1 files predate the checksums and are read
unchecked.
"""

from __future__ import annotations

import os
import re
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import anyio
import msgpack
import xxhash

from common.fileio import atomic_write_bytes
from common.logging import get_logger
from protocol import codec
from protocol.errors import ProtocolError
from protocol.messages import TrajectoryBatch
from protocol.trajectory import Trajectory

_log = get_logger("rollout_service.recording")
FORMAT_VERSION = 2
"""2: with ``checksums``; 1 (without) is still read."""
READABLE_FORMATS = (1, 2)
_DEFAULT_LIMITS = codec.CodecLimits()
_NAME = re.compile(r"^batch-(\d+)\.msgpack$")


class BatchFileError(ValueError):
    """A batch file is not in the documented format or does not hold a valid batch."""


class ChecksumError(BatchFileError):
    """A batch file's content does not match the checksums written with it."""


@dataclass(frozen=True)
class BatchMeta:
    format: int
    server_id: str
    seq: int
    time: float
    path: Path


def batch_path(directory: Path, n: int) -> Path:
    # Zero-padded so a plain sort of the names is the write order.
    return directory / f"batch-{n:010d}.msgpack"


def batch_files(directory: Path) -> list[tuple[int, Path]]:
    """(number, path) of every batch file in ``directory``, in order (temporary files ignored)."""
    if not directory.is_dir():
        return []
    found = ((_NAME.match(p.name), p) for p in directory.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


def remove_temporaries(directory: Path) -> int:
    """Delete half-written files a crashed writer left (they never got their final name)."""
    stale = list(directory.glob(".batch-*.msgpack.tmp-*")) if directory.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def _meta_sum(server_id: Any, seq: Any, at: Any) -> int:
    return xxhash.xxh3_64_intdigest(cast(bytes, msgpack.packb([server_id, seq, at])))


def pack_batch_file(
    frames: Sequence[codec.Frame], *, server_id: str, seq: int, at: float | None = None
) -> bytes:
    at = time.time() if at is None else at
    raw = [codec.view(f).cast("B").tobytes() if not isinstance(f, bytes) else f for f in frames]
    doc = {
        "format": FORMAT_VERSION,
        "server_id": server_id,
        "seq": seq,
        "time": at,
        "frames": raw,
        "checksums": {
            "meta": _meta_sum(server_id, seq, at),
            "frames": [xxhash.xxh3_64_intdigest(f) for f in raw],
        },
    }
    return cast(bytes, msgpack.packb(doc, use_bin_type=True))  # None only when given a stream


def write_batch_file(
    path: Path, frames: Sequence[codec.Frame], *, server_id: str, seq: int, durable: bool
) -> None:
    """Blocking: call it from a worker thread. ``durable``: fsync before the rename."""
    atomic_write_bytes(path, pack_batch_file(frames, server_id=server_id, seq=seq), durable=durable)


def read_batch_file(
    path: Path, limits: codec.CodecLimits = _DEFAULT_LIMITS, *, verify: bool = True
) -> tuple[BatchMeta, TrajectoryBatch]:
    """Blocking. The file's meta and its decoded, validated batch; ``BatchFileError`` otherwise
    (``ChecksumError`` for content that changed after it was written, unless not ``verify``)."""
    try:
        doc = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=True, ext_hook=_no_ext)
    except BatchFileError:
        raise
    except Exception as e:  # msgpack raises many types on damaged input
        raise BatchFileError(
            f"{path}: not a msgpack batch file ({type(e).__name__}: {e})"
        ) from None
    meta = _meta(doc, path)
    if verify and meta.format >= 2:
        _check_sums(doc, path)
    try:
        msg = codec.decode(doc["frames"], limits)
    except ProtocolError as e:
        raise BatchFileError(f"{path}: invalid batch ({e.code.name}: {e.message})") from None
    if not isinstance(msg, TrajectoryBatch):
        raise BatchFileError(f"{path}: holds a {type(msg).__name__}, not a TRAJECTORY_BATCH")
    return meta, msg


def _no_ext(code: int, data: bytes) -> Any:
    raise BatchFileError(f"msgpack extension type {code} is not allowed in a batch file")


def _frame_name(frames: list[bytes], i: int) -> str:
    """What frame `i` of a TRAJECTORY_BATCH holds, for a message (see protocol/SPEC.md)."""
    if i == 0:
        return "frame 0 (the message type)"
    if i == 1:
        return "frame 1 (the header: per-trajectory fields such as reward, lengths and ids)"
    try:
        columns = msgpack.unpackb(frames[1], raw=False, ext_hook=_no_ext).get("columns")
        return f"frame {i} (column {columns[i - 2][0]!r})"
    except Exception:  # a damaged header: the index alone
        return f"frame {i}"


def _check_sums(doc: dict[str, Any], path: Path) -> None:
    sums, frames = doc.get("checksums"), doc["frames"]
    if (
        not isinstance(sums, dict)
        or not isinstance(sums.get("meta"), int)
        or not isinstance(sums.get("frames"), list)
    ):
        raise ChecksumError(f"{path}: field 'checksums' missing or of the wrong type")
    changed = "was changed after it was written (replay --unchecked reads it anyway)"
    if sums["meta"] != _meta_sum(doc["server_id"], doc["seq"], doc["time"]):
        raise ChecksumError(f"{path}: its meta (server_id, seq or time) {changed}")
    if len(sums["frames"]) != len(frames):
        raise ChecksumError(
            f"{path}: {len(frames)} frames against {len(sums['frames'])} checksums: frames were "
            "added or removed after it was written"
        )
    for i, (frame, expected) in enumerate(zip(frames, sums["frames"], strict=True)):
        if xxhash.xxh3_64_intdigest(frame) != expected:
            raise ChecksumError(f"{path}: {_frame_name(frames, i)} {changed}")


def _meta(doc: Any, path: Path) -> BatchMeta:
    if not isinstance(doc, dict):
        raise BatchFileError(f"{path}: expected a msgpack map, got {type(doc).__name__}")
    fmt = doc.get("format")
    if fmt not in READABLE_FORMATS or isinstance(fmt, bool):
        readable = ", ".join(map(str, READABLE_FORMATS))
        raise BatchFileError(f"{path}: format {fmt!r}, this build reads formats {readable}")
    checks = {"server_id": str, "seq": int, "time": (int, float), "frames": list}
    for key, kind in checks.items():
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool):
            raise BatchFileError(f"{path}: field {key!r} missing or of the wrong type")
    if not all(isinstance(f, bytes) for f in doc["frames"]):
        raise BatchFileError(f"{path}: field 'frames': every frame must be msgpack bin")
    return BatchMeta(fmt, doc["server_id"], doc["seq"], float(doc["time"]), path)


def read_recording(
    path: str | os.PathLike[str],
    limits: codec.CodecLimits = _DEFAULT_LIMITS,
    *,
    verify: bool = True,
) -> Iterator[tuple[BatchMeta, list[Trajectory]]]:
    """Every batch of a recording (a directory of batch files, in order, or one file) as
    (meta, validated trajectories). Raises ``BatchFileError`` at the first bad file."""
    p = Path(path)
    if not p.exists():
        raise BatchFileError(f"{p}: no such recording file or directory")
    files = [p] if p.is_file() else [f for _, f in batch_files(p)]
    for f in files:
        meta, batch = read_batch_file(f, limits, verify=verify)
        yield meta, list(batch.trajectories)


class Recorder:
    """Writes every shipped batch to ``<directory>/batch-<n>.msgpack`` (n continues after the files
    already there, so a restarted server appends to its recording).

    ``max_bytes``: the oldest files are deleted once the recording holds more (the newest file is
    always kept). A write that fails (a full disk) stops the recording with one error naming the
    path; the recording is for debugging, and training goes on without it."""

    def __init__(
        self, directory: str | os.PathLike[str], server_id: str, *, max_bytes: int | None = None
    ) -> None:
        self.directory, self.server_id = Path(directory), server_id
        self.max_bytes = max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = batch_files(self.directory)
        self._next = existing[-1][0] + 1 if existing else 1
        self._files = deque((p, p.stat().st_size) for _, p in existing)
        self.bytes = sum(size for _, size in self._files)
        self.written = self.removed = 0
        self.failed: str | None = None
        """Why recording stopped (None: it goes on)."""

    async def record(self, seq: int, frames: Sequence[codec.Frame]) -> Path | None:
        """Write one batch (``frames`` as sent under wire sequence number ``seq``) off the loop;
        None once recording has stopped on a write error."""
        if self.failed is not None:
            return None
        path = batch_path(self.directory, self._next)
        self._next += 1  # taken before the await: concurrent callers get distinct files
        try:
            await anyio.to_thread.run_sync(
                lambda: write_batch_file(
                    path, frames, server_id=self.server_id, seq=seq, durable=False
                )
            )
            size = path.stat().st_size
        except OSError as e:
            self.failed = f"{path}: {e.strerror or e}"
            _log.error("recording stopped: cannot write a batch file", error=self.failed)
            remove_temporaries(self.directory)
            return None
        self._files.append((path, size))
        self.bytes += size
        self.written += 1
        self._trim()
        return path

    def _trim(self) -> None:
        while self.max_bytes is not None and self.bytes > self.max_bytes and len(self._files) > 1:
            old, size = self._files.popleft()
            old.unlink(missing_ok=True)
            self.bytes -= size
            self.removed += 1
