"""Frame-level helpers shared by both roles: valid traffic, hand-made invalid traffic, descriptions.

Valid messages always come from ``protocol.codec`` (the suite carries no second encoder that could
drift from it). Invalid ones start from codec output and are corrupted in exactly one place, so each
case tests one rule. Everything received is kept as a ``Received`` record: the raw frames plus what
decoding them gave (a message or the ``ProtocolError``), because the endpoint under test is not
trusted to send decodable frames. ``describe`` turns records into the short strings failure reasons
quote ("received: HEARTBEAT x2, ACK(seqs=[1], credits=1)").
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import msgpack
import numpy as np

from protocol import codec
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import (
    PROBE_CAPABILITY,
    Ack,
    Error,
    Hello,
    Identity,
    Message,
    MsgType,
    TrajectoryBatch,
    ValidateRequest,
    ValidateResult,
    WeightsApplied,
    Welcome,
)
from protocol.trajectory import COLUMNS, Trajectory
from protocol.version import PROTOCOL_VERSION

Frames = list[Any]
# Index of each token column's frame in a TRAJECTORY_BATCH: [type, header, *columns].
COLUMN_FRAME = {name: 2 + i for i, (name, *_rest) in enumerate(COLUMNS)}
# Identity used in HELLO when none is given: the reference endpoints accept any tokenizer.
DEFAULT_MODEL = Identity(name="conformance", sha256="0" * 64, vocab_size=0)
DEFAULT_TOKENIZER = Identity(name="conformance", sha256="", vocab_size=0)

M = TypeVar("M")


@dataclass
class Received:
    """One message from the endpoint under test, decoded if it could be."""

    frames: list[bytes]
    msg: Message | None
    error: ProtocolError | None
    identity: bytes = b""
    at: float = field(default_factory=time.monotonic)

    @property
    def type(self) -> int | None:
        if self.msg is not None:
            return int(codec.TYPE_OF[type(self.msg)])
        if self.frames and len(self.frames[0]) == 1:
            return self.frames[0][0]
        return None

    def is_(self, cls: type) -> bool:
        return isinstance(self.msg, cls)

    def as_(self, cls: type[M]) -> M:
        """The message as ``cls``: what the predicate that picked this record checked."""
        if not isinstance(self.msg, cls):
            raise TypeError(f"expected {cls.__name__}, got {self.describe()}")
        return self.msg

    def error_code(self) -> ErrorCode | None:
        """The code of a received ERROR message (not of a decoding failure)."""
        if isinstance(self.msg, Error):
            return (
                ErrorCode(self.msg.code) if self.msg.code in ErrorCode._value2member_map_ else None
            )
        return None

    def describe(self) -> str:
        return describe_message(self.msg) if self.msg is not None else self._describe_undecodable()

    def _describe_undecodable(self) -> str:
        t = self.type
        name = MsgType(t).name if t in MsgType._value2member_map_ else f"type {t}"
        err = self.error
        why = f"{err.code.name}: {err.message}" if err else "?"
        return f"undecodable {name} ({_clip(why, 80)})"


def decode(frames: Sequence[Any], limits: codec.CodecLimits, identity: bytes = b"") -> Received:
    raw = [bytes(memoryview(f).cast("B")) for f in frames]
    try:
        return Received(raw, codec.decode(raw, limits), None, identity)
    except ProtocolError as e:
        return Received(raw, None, e, identity)


def describe_message(msg: Message) -> str:
    name = codec.TYPE_OF[type(msg)].name
    match msg:
        case Ack():
            dups = f", duplicates={msg.duplicates}" if msg.duplicates else ""
            return f"ACK(seqs={_clip(str(msg.seqs), 40)}, credits={msg.credits}{dups})"
        case Error():
            code = (
                ErrorCode(msg.code).name
                if msg.code in ErrorCode._value2member_map_
                else str(msg.code)
            )
            extra = "".join(
                f", {k}={v}" for k, v in (("ref_seq", msg.ref_seq), ("field", msg.field)) if v
            )
            return f"ERROR({code}{extra}: {_clip(msg.message, 60)})"
        case Welcome():
            return f"WELCOME(credits={msg.credits}, next_seq={msg.next_seq})"
        case TrajectoryBatch():
            return f"TRAJECTORY_BATCH(seq={msg.seq})"
        case WeightsApplied():
            return f"WEIGHTS_APPLIED(version={msg.version}, ok={msg.ok})"
        case Hello():
            return (
                f"HELLO(peer_id={msg.peer_id}, version={'.'.join(map(str, msg.protocol_version))})"
            )
        case ValidateRequest():
            return f"VALIDATE_REQUEST(request_id={_clip(msg.request_id, 30)}, version={msg.policy_version})"
        case ValidateResult():
            state = "ok" if msg.ok else f"failed: {_clip(msg.error, 40)}"
            return f"VALIDATE_RESULT(request_id={_clip(msg.request_id, 30)}, count={msg.count}, {state})"
    return name


def describe(records: Iterable[Received]) -> str:
    """Records as one line, runs folded: 'HEARTBEAT x3, TRAJECTORY_BATCH(seq=2..8), ACK(...)'."""
    out: list[list[Any]] = []  # [description, count] or ["TRAJECTORY_BATCH", [seqs]]
    for r in records:
        if isinstance(r.msg, TrajectoryBatch):
            if out and out[-1][0] == "TRAJECTORY_BATCH":
                out[-1][1].append(r.msg.seq)
            else:
                out.append(["TRAJECTORY_BATCH", [r.msg.seq]])
            continue
        d = r.describe()
        if out and out[-1][0] == d:
            out[-1][1] += 1
        else:
            out.append([d, 1])
    if not out:
        return "nothing"
    parts = [
        _batches(n) if d == "TRAJECTORY_BATCH" else d if n == 1 else f"{d} x{n}" for d, n in out
    ]
    if len(parts) > 8:
        parts = [*parts[:7], f"... {len(parts) - 7} more"]
    return ", ".join(parts)


def _batches(seqs: list[int]) -> str:
    if len(seqs) > 2 and seqs == list(range(seqs[0], seqs[0] + len(seqs))):
        return f"TRAJECTORY_BATCH(seq={seqs[0]}..{seqs[-1]})"
    return f"TRAJECTORY_BATCH(seq={_clip(', '.join(map(str, seqs)), 40)})"


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def mentions_version(text: str, major: int) -> bool:
    """Whether ``text`` names protocol major version ``major`` (as '2' or '2.x')."""
    return re.search(rf"(?<![\d.]){major}(\.\d+)?(?![\d.])", text) is not None


# -- building valid traffic ---------------------------------------------------------------------------
def hello(
    peer_id: str,
    epoch: str,
    *,
    model: Identity = DEFAULT_MODEL,
    tokenizer: Identity = DEFAULT_TOKENIZER,
    policy_version: int = 0,
    version: Sequence[int] = PROTOCOL_VERSION,
    capabilities: Sequence[str] = (),
) -> Hello:
    # PROBE_CAPABILITY: the learner acknowledges these batches and never trains them (a live run stays as it was)
    return Hello(
        protocol_version=list(version),
        peer_id=peer_id,
        role="rollout-server",
        epoch=epoch,
        model=model,
        tokenizer=tokenizer,
        policy_version=policy_version,
        capabilities=[PROBE_CAPABILITY, *capabilities],
    )


def tiny_trajectory(
    tid: str, *, vocab: int = 100, prompt_len: int = 4, response_len: int = 6
) -> Trajectory:
    """A small valid trajectory: token ids below ``vocab``, a tool span (mask 0) in the response."""
    rng = np.random.default_rng(zlib.crc32(tid.encode()))
    mask = np.ones(response_len, np.uint8)
    mask[response_len // 3 : response_len // 3 + max(1, response_len // 3)] = 0
    lp = np.where(mask == 1, -rng.random(response_len, dtype=np.float32) - 0.01, 0.0).astype(
        np.float32
    )
    return Trajectory(
        trajectory_id=tid,
        group_uid=f"group-{tid}",
        prompt_ids=rng.integers(0, vocab, prompt_len, dtype=np.int32),
        response_ids=rng.integers(0, vocab, response_len, dtype=np.int32),
        response_mask=mask,
        rollout_logprobs=lp,
        versions=np.zeros(response_len, np.int32),
        reward=1.0,
        source_server="conformance",
        data_source="conformance",
        agent_type="conformance",
    )


def batch_frames(seq: int, trajectories: list[Trajectory]) -> Frames:
    return codec.encode(TrajectoryBatch(seq=seq, trajectories=trajectories))


# -- corrupting traffic by hand ----------------------------------------------------------------------
def pack(obj: Any) -> bytes:
    return cast(bytes, msgpack.packb(obj, use_bin_type=True))  # None only when given a stream


def header_of(frames: Frames) -> dict[str, Any]:
    return msgpack.unpackb(bytes(memoryview(frames[1]).cast("B")), raw=False)


def with_header(frames: Frames, edit: Callable[[dict[str, Any]], None]) -> Frames:
    """Frames whose msgpack header was decoded, changed by ``edit`` in place, and re-encoded."""
    hdr = header_of(frames)
    edit(hdr)
    return [frames[0], pack(hdr), *frames[2:]]


def with_column(frames: Frames, column: str, edit: Callable[[np.ndarray], np.ndarray]) -> Frames:
    """Frames with one token column replaced by ``edit(copy of that column)``."""
    i = COLUMN_FRAME[column]
    dtype = dict(header_of(frames)["columns"])[column]
    arr = np.frombuffer(
        bytes(memoryview(frames[i]).cast("B")), dtype=np.dtype(dtype).newbyteorder("<")
    ).copy()
    out = list(frames)
    out[i] = edit(arr).tobytes()
    return out


def type_byte(t: MsgType | int) -> bytes:
    return bytes((int(t),))
