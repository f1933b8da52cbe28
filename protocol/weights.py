"""Chunked weight transfer: planning on the learner side, checked assembly on the rollout side.

The learner describes the new policy in one WEIGHTS_ANNOUNCE (a manifest of tensor names, dtypes,
shapes, sizes and xxh3 checksums) and streams the raw bytes in WEIGHTS_CHUNK messages of at most
``chunk_bytes``. A chunk's payload frames are memoryview slices of the caller's tensor buffers, so
nothing is copied before ZeroMQ; the same frames go to every rollout server. Callers must not mutate
those buffers until the transfer is done (publish a snapshot). The receiver writes parts into
buffers preallocated from the manifest, ignores repeated chunks, and only hands the weights over
once every chunk has arrived and every checksum matches: a transfer is never half-applied.

File hand-over (1.2, capability "weights_file"): to a rollout server on its own machine the learner
sends only the manifest, naming a safetensors file (on /dev/shm) that holds exactly those tensors;
no chunks follow and the assembler returns the file path at once. The receiving application checks
the file's header against the manifest before loading it.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

import xxhash

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ChunkPart, TensorSpec, WeightsAnnounce, WeightsChunk

DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclass(frozen=True)
class NamedBuffer:
    """One tensor as raw bytes: anything supporting the buffer protocol, C-contiguous."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview


def checksum(buf: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def plan_transfer(
    version: int, tensors: list[NamedBuffer], *, chunk_bytes: int = 64 << 20, transfer_id: str | None = None
) -> tuple[WeightsAnnounce, list[WeightsChunk]]:
    """Manifest + chunks (zero-copy slices of ``tensors``) for one policy version."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be >= 1")
    tid = transfer_id or uuid.uuid4().hex
    specs: list[TensorSpec] = []
    views: list[memoryview] = []
    for t in tensors:
        mv = memoryview(t.data).cast("B")
        expected = math.prod(t.shape) * DTYPE_SIZES[t.dtype]
        if mv.nbytes != expected:
            raise ValueError(f"tensor {t.name}: {mv.nbytes} bytes, shape and dtype need {expected}")
        specs.append(TensorSpec(t.name, t.dtype, list(t.shape), mv.nbytes, checksum(mv)))
        views.append(mv)
    chunks: list[WeightsChunk] = []
    parts: list[ChunkPart] = []
    frames: list[memoryview] = []
    room = chunk_bytes

    def close_chunk() -> None:
        nonlocal parts, frames, room
        chunks.append(WeightsChunk(tid, version, len(chunks), parts, tuple(frames)))
        parts, frames, room = [], [], chunk_bytes

    for i, mv in enumerate(views):
        off = 0
        while off < mv.nbytes:
            n = min(room, mv.nbytes - off)
            parts.append(ChunkPart(i, off, n))
            frames.append(mv[off : off + n])
            off += n
            room -= n
            if room == 0:
                close_chunk()
    if parts:
        close_chunk()
    return WeightsAnnounce(version, tid, specs, len(chunks)), chunks


@dataclass
class ReceivedWeights:
    version: int
    transfer_id: str
    tensors: list[tuple[TensorSpec, bytearray]]
    file: str = ""  # file hand-over: the tensors (``specs``) lie in this local safetensors file
    specs: list[TensorSpec] = field(default_factory=list)


@dataclass
class _Transfer:
    announce: WeightsAnnounce
    buffers: list[bytearray]
    filled: list[int]
    chunks_seen: set[int] = field(default_factory=set)


class WeightAssembler:
    """Receiving end of transfers. Sans-IO: feed it messages, get complete weights back."""

    def __init__(self, *, max_total_bytes: int = 64 << 30) -> None:
        self.max_total_bytes = max_total_bytes
        self._current: _Transfer | None = None
        self._abandoned: set[str] = set()
        self._finished: set[str] = set()

    @property
    def in_progress(self) -> WeightsAnnounce | None:
        return self._current.announce if self._current else None

    def announce(self, msg: WeightsAnnounce) -> ReceivedWeights | None:
        """Start a transfer; a newer announce abandons an unfinished older one."""
        if msg.checksum_algo != "xxh3_64":
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"unsupported checksum_algo {msg.checksum_algo!r}",
                                field="checksum_algo")
        total = 0
        for i, s in enumerate(msg.tensors):
            size = DTYPE_SIZES.get(s.dtype)
            if size is None or any(d < 0 for d in s.shape) or math.prod(s.shape) * size != s.nbytes:
                raise ProtocolError(ErrorCode.INVALID_FIELD,
                                    f"tensors[{i}] ({s.name}): dtype/shape/nbytes inconsistent",
                                    field=f"tensors[{i}]")
            total += s.nbytes
        if total > self.max_total_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"weights of {total} bytes exceed {self.max_total_bytes}")
        if self._current is not None:
            self._abandoned.add(self._current.announce.transfer_id)
            self._current = None
        if msg.file:
            if msg.num_chunks != 0:
                raise ProtocolError(ErrorCode.INVALID_FIELD, "a file announce has no chunks", field="num_chunks")
            self._finished.add(msg.transfer_id)
            return ReceivedWeights(msg.version, msg.transfer_id, [], file=msg.file, specs=list(msg.tensors))
        self._current = _Transfer(msg, [bytearray(s.nbytes) for s in msg.tensors], [0] * len(msg.tensors))
        return self._finish_if_complete()

    def chunk(self, msg: WeightsChunk) -> ReceivedWeights | None:
        cur = self._current
        if cur is None or msg.transfer_id != cur.announce.transfer_id:
            if msg.transfer_id in self._abandoned or msg.transfer_id in self._finished:
                return None  # late or repeated chunks of a superseded or finished transfer: harmless
            raise ProtocolError(ErrorCode.UNEXPECTED, f"chunk of unannounced transfer {msg.transfer_id}")
        if not 0 <= msg.index < cur.announce.num_chunks:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"chunk index {msg.index} out of range", field="index")
        if msg.index in cur.chunks_seen:
            return None
        for i, p in enumerate(msg.parts):
            if p.tensor >= len(cur.buffers) or p.offset + p.nbytes > len(cur.buffers[p.tensor]):
                raise ProtocolError(ErrorCode.INVALID_FIELD, f"parts[{i}] outside its tensor", field=f"parts[{i}]")
        for p, data in zip(msg.parts, msg.frames, strict=True):
            cur.buffers[p.tensor][p.offset : p.offset + p.nbytes] = data
            cur.filled[p.tensor] += p.nbytes
        cur.chunks_seen.add(msg.index)
        return self._finish_if_complete()

    def _finish_if_complete(self) -> ReceivedWeights | None:
        cur = self._current
        assert cur is not None
        if len(cur.chunks_seen) < cur.announce.num_chunks:
            return None
        self._current = None
        self._finished.add(cur.announce.transfer_id)
        for spec, buf, filled in zip(cur.announce.tensors, cur.buffers, cur.filled, strict=True):
            if filled != spec.nbytes or checksum(memoryview(buf)) != spec.checksum:
                raise ProtocolError(
                    ErrorCode.CHECKSUM_MISMATCH,
                    f"version {cur.announce.version}: tensor {spec.name} failed verification "
                    f"({filled}/{spec.nbytes} bytes)",
                    field=spec.name,
                )
        return ReceivedWeights(cur.announce.version, cur.announce.transfer_id,
                               list(zip(cur.announce.tensors, cur.buffers, strict=True)))
