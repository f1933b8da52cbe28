"""Chunked weight transfer: planning on the learner side, checked assembly on the rollout side.

The learner describes the new policy in one WEIGHTS_ANNOUNCE (a manifest of tensor names, dtypes,
shapes, sizes and xxh3 checksums) and streams the raw bytes in WEIGHTS_CHUNK messages of at most
``chunk_bytes``. A chunk's payload frames are memoryview slices of the caller's tensor buffers, so
nothing is copied before ZeroMQ; the same frames go to every rollout server. Callers must not mutate
those buffers until the transfer is done (publish a snapshot). The receiver ignores repeated chunks
and only hands the weights over once every chunk has arrived and every checksum matches: a transfer
is never half-applied.

The receiver trusts nothing an announce claims (SPEC §8 "Checks before allocating"):
- the manifest is checked before anything is allocated: against the receiver's own model
  (``ModelManifest``: names, shapes and dtypes from the model's safetensors headers; every tensor
  required, none unknown, floating dtypes no wider than the model's or float32; or, for an
  adapter-only update, `protocol.adapters`' checks) when it has one, else only against
  ``max_total_bytes``; ``num_chunks`` may not exceed the bytes announced;
- a tensor's buffer is allocated when the first chunk writing into it arrives, never for the whole
  claim up front: memory grows with the tensors that chunks reach, at most the checked manifest;
- every transfer has a deadline: it is abandoned (``expire``) once no new chunk has arrived for
  ``timeout_s``, or once it has run ``timeout_s + bytes / min_bytes_per_s``, whichever is first.
  The connection reports it (WEIGHTS_APPLIED ok=false and ERROR TIMED_OUT); nothing stays pending.

File hand-over (1.2, capability "weights_file"): to a rollout server on its own machine the learner
sends only the manifest, naming a safetensors file (on /dev/shm) that holds exactly those tensors;
no chunks follow and the assembler returns the file path at once. With ``file_roots`` set, the path
must resolve (symlinks followed) to a regular file inside ``<root>/agentrl-weights-*/`` of one of
them, as ``protocol.slot_files`` lays them out, and be big enough for the manifest;
the resolved path is what the application gets. It checks the file's header against its model before loading it. This is
the only part that touches the file system (a ``stat``), and only when ``file_roots`` is given.
"""

from __future__ import annotations

import math
import os
import stat
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

from protocol.adapters import adapter_problems, is_adapter_update
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ChunkPart, MsgType, TensorSpec, WeightsAnnounce, WeightsChunk
from protocol.slot_files import PREFIX as SLOT_DIR_PREFIX

DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOAT_DTYPES = frozenset(
    {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
)
DEFAULT_TIMEOUT_S = 60.0  # rollout_server.weights_timeout_s
DEFAULT_MIN_BYTES_PER_S = 5e6  # rollout_server.weights_min_mb_per_s
MAX_PROBLEMS = 5  # listed in one refusal; the count says how many there were
MAX_QUOTED = 200  # characters of a peer's name or path quoted back in an error


def _q(text: str) -> str:
    """A peer-chosen string, cut short: a megabyte-long name must not become a megabyte error."""
    return text if len(text) <= MAX_QUOTED else f"{text[:MAX_QUOTED]}... ({len(text)} chars)"


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
    version: int,
    tensors: list[NamedBuffer],
    *,
    chunk_bytes: int = 64 << 20,
    transfer_id: str | None = None,
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


@dataclass(frozen=True)
class ModelManifest:
    """What a weight update of one model may hold: every tensor's dtype and shape (from the model's
    safetensors headers; ``common.safetensors_buffers.model_manifest`` builds it)."""

    tensors: Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape); all required
    # tied lm_head
    optional: Mapping[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    name: str = "the model"  # for messages
    lora_max_rank: int = 0  # > 0: the receiver also takes adapter-only updates up to this rank

    def _spec(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        return self.tensors.get(name) or self.optional.get(name)

    @staticmethod
    def _widest(dtype: str) -> int:
        """Bytes per element an update may use for a tensor stored as ``dtype``: floating tensors
        may come as any floating dtype up to float32 (or the model's own, if wider)."""
        size = DTYPE_SIZES.get(dtype, 8)
        return max(size, 4) if dtype in FLOAT_DTYPES else size

    @property
    def max_bytes(self) -> int:
        """The most bytes an update of this model can take (optional tensors included)."""
        return sum(
            math.prod(shape) * self._widest(dtype)
            for dtype, shape in (*self.tensors.values(), *self.optional.values())
        )

    def problems(self, specs: Sequence[TensorSpec]) -> list[tuple[str, str]]:
        """(field, what is wrong) for every tensor of ``specs`` the model does not have as announced;
        an adapter-only update is checked as one (`protocol.adapters`)."""
        if is_adapter_update([s.name for s in specs]):
            return adapter_problems(
                specs,
                {**self.tensors, **self.optional},
                max_rank=self.lora_max_rank,
                floating=FLOAT_DTYPES,
                what=self.name,
            )
        out: list[tuple[str, str]] = []
        seen: set[str] = set()
        for i, s in enumerate(specs):
            want, name = self._spec(s.name), _q(s.name)
            if s.name in seen:
                out.append((f"tensors[{i}].name", f"{name} is announced twice"))
            elif want is None:
                out.append((f"tensors[{i}].name", f"{name} is not a tensor of {self.name}"))
            else:
                dtype, shape = want
                if tuple(s.shape) != shape:
                    out.append(
                        (
                            f"tensors[{i}].shape",
                            _q(f"{name}: shape {list(s.shape)}, {self.name} has {list(shape)}"),
                        )
                    )
                if s.dtype != dtype and not (
                    dtype in FLOAT_DTYPES
                    and s.dtype in FLOAT_DTYPES
                    and DTYPE_SIZES[s.dtype] <= self._widest(dtype)
                ):
                    out.append(
                        (
                            f"tensors[{i}].dtype",
                            f"{name}: dtype {s.dtype}, {self.name} stores {dtype}",
                        )
                    )
            seen.add(s.name)
        if missing := [n for n in self.tensors if n not in seen]:
            out.append(
                ("tensors", f"{len(missing)} tensors of {self.name} missing, e.g. {missing[:3]}")
            )
        return out


def check_weights_file(path: str, roots: Sequence[str], needed_bytes: int) -> str:
    """The real path of the slot file ``path`` of a file announce, if it is a regular file of at
    least ``needed_bytes`` inside ``<root>/agentrl-weights-*/`` of one of ``roots``; else INVALID_FIELD
    (field ``file``). Symlinks are resolved first, so a link out of the directory is refused."""
    shown = repr(_q(path))
    if "\0" in path or not os.path.isabs(path):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, f"file {shown} is not an absolute path", field="file"
        )
    real = os.path.realpath(path)
    inside = False
    for root in roots:
        base = os.path.realpath(root)
        rel = os.path.relpath(real, base)
        parts = rel.split(os.sep)
        if (
            rel != os.curdir
            and parts[0] != os.pardir
            and len(parts) >= 2
            and parts[0].startswith(SLOT_DIR_PREFIX)
        ):
            inside = True
            break
    if not inside:
        dirs = (
            ", ".join(os.path.join(r, SLOT_DIR_PREFIX + "*") for r in roots) or "(none configured)"
        )
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"file {shown} (resolves to {_q(real)}) is not inside a learner "
            f"weights directory: {dirs}",
            field="file",
        )
    try:
        st = os.stat(real)
    except OSError as e:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, f"file {shown}: {e.strerror or e}", field="file"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, f"file {shown} is not a regular file", field="file"
        )
    if st.st_size < needed_bytes:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"file {shown} holds {st.st_size} bytes, the announced tensors need {needed_bytes}",
            field="file",
        )
    return real


@dataclass
class ReceivedWeights:
    version: int
    transfer_id: str
    tensors: list[tuple[TensorSpec, bytearray | memoryview]]
    file: str = ""  # file hand-over: the tensors (``specs``) lie in this local safetensors file
    specs: list[TensorSpec] = field(default_factory=list)


@dataclass
class _Transfer:
    announce: WeightsAnnounce
    # allocated by the first chunk that writes into the tensor, or all at once by ``allocate``
    buffers: list[bytearray | memoryview | None]
    filled: list[int]
    deadline: float  # the whole transfer: timeout_s + bytes / min_bytes_per_s after the announce
    last_progress: float  # when the announce or the last new chunk arrived
    started: float
    chunks_seen: set[int] = field(default_factory=set)


class WeightAssembler:
    """Receiving end of transfers. Sans-IO: feed it messages and the time, get complete weights back.

    ``manifest``: the receiver's model; announces that do not fit it are refused (None: only
    ``max_total_bytes`` bounds them). ``file_roots``: where file announces may point (None: any
    path, unchecked). ``timeout_s`` / ``min_bytes_per_s``: the deadlines (None: no timeout); they
    only run for callers that pass ``now``. ``allocate``: gives the buffers of every tensor of a
    checked chunked announce at once (a weight relay's mapped slot file, so chunks land in the file
    as they arrive); the default allocates each tensor lazily.
    """

    def __init__(
        self,
        *,
        max_total_bytes: int = 64 << 30,
        manifest: ModelManifest | None = None,
        file_roots: Sequence[str] | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        min_bytes_per_s: float = DEFAULT_MIN_BYTES_PER_S,
        allocate: Callable[[WeightsAnnounce], Sequence[memoryview]] | None = None,
    ) -> None:
        self.allocate = allocate
        self.max_total_bytes = manifest.max_bytes if manifest is not None else max_total_bytes
        self.manifest = manifest
        self.file_roots = list(file_roots) if file_roots is not None else None
        self.timeout_s, self.min_bytes_per_s = timeout_s, min_bytes_per_s
        self._current: _Transfer | None = None
        self._abandoned: set[str] = set()
        self._finished: set[str] = set()

    @property
    def in_progress(self) -> WeightsAnnounce | None:
        return self._current.announce if self._current else None

    @property
    def deadline(self) -> float:
        """When ``expire`` must run next (inf: nothing pending, or no timeout)."""
        cur = self._current
        if cur is None or self.timeout_s is None:
            return math.inf
        return min(cur.deadline, cur.last_progress + self.timeout_s)

    def expire(self, now: float) -> tuple[WeightsAnnounce, ProtocolError] | None:
        """Abandon the pending transfer if its deadline has passed: its announce, and what to report."""
        cur = self._current
        if cur is None or now < self.deadline:
            return None
        self._current = None
        self._abandoned.add(cur.announce.transfer_id)
        a = cur.announce
        total = sum(t.nbytes for t in a.tensors)
        if now - cur.last_progress >= (self.timeout_s or 0.0):
            why = f"no new chunk for {now - cur.last_progress:.1f} s (timeout {self.timeout_s:g} s)"
        else:
            why = (
                f"not complete {cur.deadline - cur.started:.1f} s after its announce (timeout {self.timeout_s:g} s "
                f"+ {total} bytes at {self.min_bytes_per_s:g} bytes/s)"
            )
        err = ProtocolError(
            ErrorCode.TIMED_OUT,
            f"weights version {a.version} (transfer {_q(a.transfer_id)}) abandoned: "
            f"{len(cur.chunks_seen)} of {a.num_chunks} chunks, {sum(cur.filled)} of {total} bytes "
            f"received; {why}",
        )
        err.ref_type = int(MsgType.WEIGHTS_ANNOUNCE)
        return a, err

    def announce(self, msg: WeightsAnnounce, now: float | None = None) -> ReceivedWeights | None:
        """Start a transfer; a newer announce abandons an unfinished older one. A refused announce
        (ProtocolError) leaves any transfer in progress as it was."""
        total = self._check(msg)
        if msg.file:
            if msg.num_chunks != 0:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD, "a file announce has no chunks", field="num_chunks"
                )
            path = (
                msg.file
                if self.file_roots is None
                else check_weights_file(msg.file, self.file_roots, total)
            )
            self._supersede()
            self._finished.add(msg.transfer_id)
            return ReceivedWeights(
                msg.version, msg.transfer_id, [], file=path, specs=list(msg.tensors)
            )
        self._supersede()
        start = math.inf if now is None else now  # no clock: no deadline
        budget = (self.timeout_s or 0.0) + total / self.min_bytes_per_s
        buffers: list[bytearray | memoryview | None] = [None] * len(msg.tensors)
        if self.allocate is not None:
            buffers = list(self.allocate(msg))
        self._current = _Transfer(
            msg,
            buffers,
            [0] * len(msg.tensors),
            deadline=start + budget,
            last_progress=start,
            started=start,
        )
        return self._finish_if_complete()

    def _supersede(self) -> None:
        if self._current is not None:
            self._abandoned.add(self._current.announce.transfer_id)
            self._current = None

    def _check(self, msg: WeightsAnnounce) -> int:
        """Every check an announce must pass before anything is allocated; returns its total bytes."""
        if msg.checksum_algo != "xxh3_64":
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"unsupported checksum_algo {_q(msg.checksum_algo)!r}",
                field="checksum_algo",
            )
        total = 0
        for i, s in enumerate(msg.tensors):
            size = DTYPE_SIZES.get(s.dtype)
            if size is None or any(d < 0 for d in s.shape) or math.prod(s.shape) * size != s.nbytes:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD,
                    f"tensors[{i}] ({_q(s.name)}): dtype/shape/nbytes inconsistent",
                    field=f"tensors[{i}]",
                )
            total += s.nbytes
        if total > self.max_total_bytes:
            of = (
                f"{self.manifest.name} can hold"
                if self.manifest is not None
                else "max_total_bytes allows"
            )
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"weights of {total} bytes in {len(msg.tensors)} tensors "
                f"exceed the {self.max_total_bytes} bytes {of}",
                field="tensors",
            )
        if self.manifest is not None and (problems := self.manifest.problems(msg.tensors)):
            more = (
                f" (and {len(problems) - MAX_PROBLEMS} more)"
                if len(problems) > MAX_PROBLEMS
                else ""
            )
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"version {msg.version} does not fit {self.manifest.name}: "
                + "; ".join(p for _, p in problems[:MAX_PROBLEMS])
                + more,
                field=problems[0][0],
            )
        if not msg.file and (msg.num_chunks > total or (total > 0 and msg.num_chunks == 0)):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"num_chunks {msg.num_chunks} for {total} bytes: every "
                "chunk carries at least one byte",
                field="num_chunks",
            )
        return total

    def chunk(self, msg: WeightsChunk, now: float | None = None) -> ReceivedWeights | None:
        cur = self._current
        if cur is None or msg.transfer_id != cur.announce.transfer_id:
            if msg.transfer_id in self._abandoned or msg.transfer_id in self._finished:
                return (
                    None  # late or repeated chunks of a superseded or finished transfer: harmless
                )
            raise ProtocolError(
                ErrorCode.UNEXPECTED, f"chunk of unannounced transfer {_q(msg.transfer_id)}"
            )
        if not 0 <= msg.index < cur.announce.num_chunks:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, f"chunk index {msg.index} out of range", field="index"
            )
        if msg.index in cur.chunks_seen:
            return None
        specs = cur.announce.tensors
        for i, p in enumerate(msg.parts):
            if p.tensor >= len(specs) or p.offset + p.nbytes > specs[p.tensor].nbytes:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD, f"parts[{i}] outside its tensor", field=f"parts[{i}]"
                )
        for p, data in zip(msg.parts, msg.frames, strict=True):
            buf = cur.buffers[p.tensor]
            if buf is None:  # the first bytes of this tensor: only now is its room taken
                buf = cur.buffers[p.tensor] = bytearray(specs[p.tensor].nbytes)
            buf[p.offset : p.offset + p.nbytes] = data
            cur.filled[p.tensor] += p.nbytes
        cur.chunks_seen.add(msg.index)
        if now is not None:
            cur.last_progress = now
        return self._finish_if_complete()

    def _finish_if_complete(self) -> ReceivedWeights | None:
        cur = self._current
        assert cur is not None
        if len(cur.chunks_seen) < cur.announce.num_chunks:
            return None
        self._current = None
        self._finished.add(cur.announce.transfer_id)
        buffers: list[bytearray | memoryview] = [
            b if b is not None else bytearray() for b in cur.buffers
        ]
        for spec, buf, filled in zip(cur.announce.tensors, buffers, cur.filled, strict=True):
            if (
                filled != spec.nbytes
                or len(buf) != spec.nbytes
                or checksum(memoryview(buf)) != spec.checksum
            ):
                raise ProtocolError(
                    ErrorCode.CHECKSUM_MISMATCH,
                    f"version {cur.announce.version}: tensor {_q(spec.name)} failed verification "
                    f"({filled}/{spec.nbytes} bytes)",
                    field=spec.name,
                )
        return ReceivedWeights(
            cur.announce.version,
            cur.announce.transfer_id,
            list(zip(cur.announce.tensors, buffers, strict=True)),
        )
