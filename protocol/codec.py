"""Frames <-> messages.

Layout of every message: ``[type, header, *payload]`` where ``type`` is one byte (``MsgType``),
``header`` is a msgpack map and ``payload`` frames are raw bytes (trajectory columns, tensor slices).
msgpack is decoded with extension types refused and map keys restricted to strings, so nothing on
the wire can construct objects; nothing is ever unpickled. Every failure is a ``ProtocolError`` with
a code, so a receiver can answer with a typed ERROR and keep the connection.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import msgpack
import numpy as np

from protocol import typed_header
from protocol.batch import Trajectories, as_columns
from protocol.budget import Truncated
from protocol.columns import FRAMES_NUMBERS, decode_columns, decode_numbers_form
from protocol.errors import ErrorCode, ProtocolError
from protocol.limits import CodecLimits
from protocol.messages import (
    MESSAGE_TYPES,
    TYPE_OF,
    ChunkPart,
    Error,
    Message,
    MsgType,
    TrajectoryBatch,
    WeightsChunk,
)
from protocol.schema import check, from_wire, to_wire
from protocol.trajectory import COLUMNS, HEADER_FIELDS, META_ORDER, NUMBERS

Frame = bytes | memoryview | np.ndarray
_PEEK_HEADER_BYTES = 1 << 20  # an oversized message's header is still read if at most this big


DEFAULT_LIMITS = CodecLimits()
"""What `decode` accepts unless told otherwise."""


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.MALFORMED, f"msgpack extension type {code} is not allowed")


def _pack(obj: Any) -> bytes:
    return cast(bytes, msgpack.packb(obj, use_bin_type=True))  # None only when given a stream


# msgpack decodes its Timestamp extension (type -1) itself, without asking ext_hook. Every encoding
# of it holds one of these byte strings, so a header without any cannot carry one; a header with one
# (or a false match inside a string or a float) is decoded with hooks that look.
_TIMESTAMP_MARKS = (b"\xd6\xff", b"\xd7\xff", b"\xc7\x0c\xff")


def _may_hold_timestamp(data: bytes) -> bool:
    """Whether ``data`` holds one of ``_TIMESTAMP_MARKS``. Each ends in 0xff, which few headers
    hold at all: memchr finds the 0xff bytes (a header's worth in well under a microsecond, where
    a search per mark costs ~50 us for a batch header) and only their predecessors are looked at."""
    i = data.find(b"\xff", 1)
    while i > 0:
        if data[i - 1] in (0xD6, 0xD7) or (data[i - 1] == 0x0C and i > 1 and data[i - 2] == 0xC7):
            return True
        i = data.find(b"\xff", i + 1)
    return False


def _no_timestamps(obj: Any) -> Any:
    values = obj.values() if isinstance(obj, dict) else obj
    if any(isinstance(v, msgpack.Timestamp) for v in values):
        raise ProtocolError(
            ErrorCode.MALFORMED, "msgpack extension type -1 (timestamp) is not allowed"
        )
    return obj


def view(frame: Frame) -> memoryview:
    """A frame's bytes without a copy (an ndarray's buffer is its ``.data``)."""
    return frame.data if isinstance(frame, np.ndarray) else memoryview(frame)


def _unpack(buf: Frame) -> Any:
    data = buf if isinstance(buf, bytes) else view(buf).tobytes()  # headers are small
    hooks: dict[str, Any] = {}
    if _may_hold_timestamp(data):
        hooks = {"object_hook": _no_timestamps, "list_hook": _no_timestamps}
    try:
        result = msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True, **hooks
        )
        if hooks:
            _no_timestamps([result])  # a bare timestamp at the top
        return result
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises a zoo of types for hostile input
        raise ProtocolError(
            ErrorCode.MALFORMED, f"header is not valid msgpack: {type(e).__name__}: {e}"
        ) from e


_OMITTED_WHEN_EMPTY = tuple(f.name for f in HEADER_FIELDS if f.omit_when_empty)
_HEADER_NAMES = tuple(f.name for f in HEADER_FIELDS)


def _header_meta(meta: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The ``meta`` map as sent: the fields ``names``, in that order, except optional maps that are
    empty for every trajectory (the receiver defaults them), so a batch without agent actions
    encodes as it did before the field."""
    return {
        k: v.tolist() if isinstance(v, np.ndarray) else v
        for k in names
        if (v := meta[k]) is not None and (k not in _OMITTED_WHEN_EMPTY or any(v))
    }


def _number_frames(meta: dict[str, Any]) -> list[np.ndarray]:
    return [np.asarray(meta[f.name], dtype=f.dtype) for f in NUMBERS]


def encode(msg: Message, *, number_frames: bool = False) -> list[Frame]:
    """Message -> frames. Payload frames are the caller's buffers, not copies.

    ``number_frames``: a batch in the 1.5 form (per-trajectory numbers as binary frames), only for
    a peer that negotiated 1.5; otherwise the 1.3/1.4 form every receiver decodes."""
    t = TYPE_OF[type(msg)]
    tb = bytes((t,))
    if isinstance(msg, TrajectoryBatch):
        batch = as_columns(msg.trajectories)  # no copy when the producer built columns
        if number_frames:
            header = {
                "seq": msg.seq,
                "columns": _WIRE_COLUMNS_NUMBERS,
                "meta": _header_meta(batch.meta, _HEADER_NAMES),
            }
            return [tb, _pack(header), *batch.canonical_arrays(), *_number_frames(batch.meta)]
        header = {
            "seq": msg.seq,
            "columns": _WIRE_COLUMNS,
            "meta": _header_meta(batch.meta, META_ORDER),
        }
        return [tb, _pack(header), *batch.canonical_arrays()]
    if isinstance(msg, WeightsChunk):
        header = {
            "transfer_id": msg.transfer_id,
            "version": msg.version,
            "index": msg.index,
            "parts": to_wire(msg.parts),
        }
        return [tb, _pack(header), *msg.frames]
    return [tb, _pack(to_wire(msg))]


_WIRE_COLUMNS = [[name, dtype] for name, _, dtype, _ in COLUMNS]
_WIRE_COLUMNS_NUMBERS = [*_WIRE_COLUMNS, *([f.name, f.dtype] for f in NUMBERS)]


def header_form(frames: list[Frame]) -> list[Frame]:
    """A batch this process encoded, in the 1.3/1.4 form (for a peer older than 1.5, which
    negotiated after the batch was encoded); other messages and batches already in it unchanged."""
    if len(frames) != 2 + FRAMES_NUMBERS or view(frames[0]).tobytes() != bytes(
        (MsgType.TRAJECTORY_BATCH,)
    ):
        return frames
    header = _unpack(frames[1])
    meta = dict(header["meta"])
    for spec, frame in zip(NUMBERS, frames[2 + len(COLUMNS) :], strict=True):
        values = np.frombuffer(view(frame), dtype=np.dtype(spec.dtype).newbyteorder("<"))
        meta[spec.name] = (values != 0).tolist() if spec.kind == "bool" else values.tolist()
    legacy = {
        "seq": header["seq"],
        "columns": _WIRE_COLUMNS,
        "meta": _header_meta({k: meta.get(k) for k in META_ORDER}, META_ORDER),
    }
    return [frames[0], _pack(legacy), *frames[2 : 2 + len(COLUMNS)]]


# room for a batch header (its per-trajectory scalars) of any valid batch
HEADER_ROOM_BYTES = 16 << 20
# Bytes per token of a batch in the canonical dtypes (what ``encode`` writes): prompt tokens carry
# fewer, so this bounds both.
_TOKEN_BYTES = sum(np.dtype(dt).itemsize for _, _, dt, _ in COLUMNS)


def run_message_bytes(limits: CodecLimits) -> int:
    """The largest message a valid sender of this run needs: a batch of the most trajectories, each
    at the longest length ``limits`` allow, in the canonical dtypes, plus room for its header; at
    most ``max_message_bytes``. (A learner announces it in WELCOME and lets libzmq refuse any
    bigger frame before buffering it.)"""
    tokens = min(
        limits.max_tokens_per_trajectory, limits.max_model_len or limits.max_tokens_per_trajectory
    )
    return min(
        limits.max_message_bytes,
        limits.max_trajectories_per_batch * tokens * _TOKEN_BYTES + HEADER_ROOM_BYTES,
    )


def split_frames(frames: Sequence[Frame], piece_bytes: int) -> list[Frame]:
    """``frames`` as sent to a receiver with a frame bound (SPEC §2, since 1.6): each frame of
    ``piece_bytes`` or more becomes pieces of exactly ``piece_bytes`` and a last, shorter piece
    (possibly empty); smaller frames are unchanged. Pieces are views of the frames, not copies."""
    out: list[Frame] = []
    for f in frames:
        v = view(f)
        if v.nbytes < piece_bytes:
            out.append(f)
            continue
        v = v.cast("B")
        whole = v.nbytes - v.nbytes % piece_bytes
        out.extend(v[i : i + piece_bytes] for i in range(0, whole, piece_bytes))
        out.append(v[whole:])
    return out


class Joined(list):  # type: ignore[type-arg]
    """A message's frames with their pieces already joined by the transport, as it read them
    (``zmq_transport``, where peers split at its frame bound): ``decode`` takes them as they are.
    ``unended``: the message ended inside a split frame (refused as ``join_pieces`` does)."""

    def __init__(self, frames: Sequence[Frame] = (), *, unended: bool = False) -> None:
        super().__init__(frames)
        self.unended = unended


def unended_split(piece_bytes: int) -> ProtocolError:
    return ProtocolError(
        ErrorCode.MALFORMED,
        f"the message ends inside a split frame (its last frame has {piece_bytes} bytes, the "
        "piece size: a split frame ends with a shorter piece, possibly empty)",
    )


def join_pieces(frames: Sequence[Frame], piece_bytes: int) -> list[Frame]:
    """The frames ``split_frames`` made: a frame of exactly ``piece_bytes`` continues in the next
    one. Each split frame is copied once, into one buffer (so decoded arrays stay views of one
    frame); frames that were not split are passed through. MALFORMED when the message ends inside
    a split frame."""
    out: list[Frame] = []
    run: list[memoryview] = []
    for f in frames:
        v = view(f)
        if v.nbytes == piece_bytes:
            run.append(v)
        elif run:
            run.append(v)
            out.append(b"".join(run))
            run = []
        else:
            out.append(f)
    if run:
        raise unended_split(piece_bytes)
    return out


def frame_bytes(frames: Sequence[Frame]) -> int:
    return sum(view(f).nbytes for f in frames)


def peek_type(frames: Sequence[Frame]) -> MsgType:
    """Route on the type frame alone. Raises MALFORMED / UNKNOWN_TYPE."""
    if not frames:
        raise ProtocolError(ErrorCode.MALFORMED, "empty message")
    tf = view(frames[0])
    if tf.nbytes != 1:
        raise ProtocolError(ErrorCode.MALFORMED, f"type frame must be 1 byte, got {tf.nbytes}")
    code = tf.tobytes()[0]
    try:
        t = MsgType(code)
    except ValueError:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {code}") from None
    if len(frames) < 2:
        e = ProtocolError(
            ErrorCode.MALFORMED, f"a message has at least 2 frames, got {len(frames)}"
        )
        e.ref_type = int(t)  # known type: lets the receiver tell a broken ERROR from other junk
        raise e
    return t


def decode(
    frames: Sequence[Frame], limits: CodecLimits = DEFAULT_LIMITS, *, piece_bytes: int = 0
) -> Message:
    """Frames -> validated message, or ProtocolError (with ref_type/ref_seq when known).
    ``piece_bytes``: the receiver's frame bound, whose split frames are joined first (0: none;
    frames the transport joined, ``Joined``, are taken as they are)."""
    if isinstance(frames, Truncated):
        raise _over_budget(frames)
    size = frame_bytes(frames)
    t = peek_type(frames)
    header: Any = None
    try:
        if isinstance(frames, Joined):
            if frames.unended:
                raise unended_split(piece_bytes)
        elif piece_bytes:
            frames = join_pieces(frames, piece_bytes)
        if size > limits.max_message_bytes:
            if view(frames[1]).nbytes <= _PEEK_HEADER_BYTES:
                header = _unpack(frames[1])  # only to name the refused batch (ref_seq) below
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"message of {size} bytes exceeds the limit of {limits.max_message_bytes}",
            )
        payload = [view(f).cast("B") for f in frames[2:]]
        if (
            t is MsgType.TRAJECTORY_BATCH
            and (typed := typed_header.decode(view(frames[1]), FRAMES_NUMBERS)) is not None
        ):
            header = {"seq": typed.seq}  # names the batch in an error from the checks below
            try:
                return _decode_typed_batch(typed, payload, limits)
            except typed_header.Fallback:
                header = None  # the generic path decodes it again and names what is wrong
        header = _unpack(frames[1])
        if not isinstance(header, dict):
            raise ProtocolError(ErrorCode.MALFORMED, "header must be a msgpack map")
        if t is MsgType.TRAJECTORY_BATCH:
            return _decode_batch(header, payload, limits)
        if t is MsgType.WEIGHTS_CHUNK:
            return _decode_chunk(header, payload)
        if payload:
            raise ProtocolError(
                ErrorCode.MALFORMED, f"{t.name} carries no payload frames, got {len(payload)}"
            )
        return from_wire(MESSAGE_TYPES[t], header, t.name)
    except ProtocolError as e:
        e.ref_type = int(t)
        seq = header.get("seq") if isinstance(header, dict) and t is MsgType.TRAJECTORY_BATCH else 0
        e.ref_seq = seq if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0 else 0
        raise


def _over_budget(frames: Truncated) -> ProtocolError:
    """The error for a message the transport stopped keeping (``protocol.budget``): the budget's
    code, naming what broke it and the limit, matched to its batch when the header was kept."""
    ref_type = ref_seq = 0
    try:
        # the type frame alone (the header may be gone)
        ref_type = int(peek_type([*frames[:1], b""]))
        if ref_type == MsgType.TRAJECTORY_BATCH and len(frames) >= 2:
            header = _unpack(frames[1])
            seq = header.get("seq") if isinstance(header, dict) else 0
            ref_seq = seq if type(seq) is int and seq > 0 else 0
    except ProtocolError:
        pass  # junk type or header: the error stays unmatched
    e = ProtocolError(frames.budget.code_for(ref_type), f"message of {frames.what}: dropped unread")
    e.ref_type, e.ref_seq = ref_type, ref_seq
    return e


def _decode_batch(header: dict, payload: list[memoryview], limits: CodecLimits) -> TrajectoryBatch:
    seq = check(int, header.get("seq"), "TRAJECTORY_BATCH.seq")
    if seq < 1:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, f"TRAJECTORY_BATCH.seq: must be >= 1 (got {seq})", field="seq"
        )
    meta, columns = decode_columns(header.get("meta"), header.get("columns"), payload, limits)
    return TrajectoryBatch(seq=seq, trajectories=Trajectories(meta, columns))


def _decode_typed_batch(
    typed: Any, payload: list[memoryview], limits: CodecLimits
) -> TrajectoryBatch:
    """A 1.5 batch whose header ``typed_header`` decoded: the same checks as ``_decode_batch``,
    in the same order, with the header lists already typed."""
    meta, columns = decode_numbers_form(
        functools.partial(typed_header.lists, typed), typed.columns, payload, limits
    )
    return TrajectoryBatch(seq=typed.seq, trajectories=Trajectories(meta, columns))


def _decode_chunk(header: dict, payload: list[memoryview]) -> WeightsChunk:
    transfer_id = check(str, header.get("transfer_id"), "WEIGHTS_CHUNK.transfer_id")
    version = check(int, header.get("version"), "WEIGHTS_CHUNK.version")
    index = check(int, header.get("index"), "WEIGHTS_CHUNK.index")
    parts = check(list[ChunkPart], header.get("parts"), "WEIGHTS_CHUNK.parts")
    if len(parts) != len(payload):
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"WEIGHTS_CHUNK: {len(parts)} parts but {len(payload)} payload frames",
        )
    for i, (p, f) in enumerate(zip(parts, payload, strict=True)):
        if p.nbytes != f.nbytes or p.offset < 0 or p.tensor < 0:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"WEIGHTS_CHUNK.parts[{i}]: {f.nbytes} bytes, header says {p.nbytes}",
                field=f"parts[{i}]",
            )
    return WeightsChunk(
        transfer_id=transfer_id, version=version, index=index, parts=parts, frames=tuple(payload)
    )


def should_answer(err: ProtocolError) -> bool:
    """Never answer an undecodable ERROR with an ERROR: two peers would bounce them forever."""
    return err.ref_type != MsgType.ERROR


def error_message(err: ProtocolError) -> Error:
    """The ERROR to send back for ``err``."""
    return Error(
        code=int(err.code),
        message=err.message,
        fatal=err.code.fatal,
        field=err.field or "",
        ref_type=err.ref_type,
        ref_seq=err.ref_seq,
    )
