"""Trajectories and their column-wise wire form.

A trajectory is one sequence the learner trains on: an agent episode, or one segment of it when the
agent edits its own context (StateLM snapshots share the episode's ``group_uid``).

On the wire a batch's per-token arrays travel as five binary frames, one per column, each the
concatenation of that column over the batch in little-endian raw bytes; the msgpack header holds
the per-trajectory scalars plus lengths and names each column's dtype. This keeps the header small,
lets the sender hand numpy buffers to ZeroMQ without copying them again, and lets the receiver
validate every column with one vectorised pass instead of a Python loop per token. Decoded arrays are
read-only views into the received frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol.errors import ErrorCode, ProtocolError
from protocol.schema import from_wire, to_wire

TERMINATIONS = ("answered", "no_tool_call", "length", "max_turns", "tool_error", "aborted")

# (column, attribute, canonical dtype, dtypes a receiver accepts)
COLUMNS: tuple[tuple[str, str, str, frozenset[str]], ...] = (
    ("prompt_ids", "prompt_ids", "int32", frozenset({"int32", "int64"})),
    ("response_ids", "response_ids", "int32", frozenset({"int32", "int64"})),
    ("response_mask", "response_mask", "uint8", frozenset({"uint8", "bool"})),
    ("rollout_logprobs", "rollout_logprobs", "float32", frozenset({"float32", "float64"})),
    ("versions", "versions", "int32", frozenset({"int32", "int64"})),
)


@dataclass(eq=False)
class Trajectory:
    trajectory_id: str
    group_uid: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray  # 1: model token (trained on), 0: tool/env token
    rollout_logprobs: np.ndarray  # logprob of each sampled token under the rollout policy; 0 where mask 0
    versions: np.ndarray  # policy version that produced each response token
    reward: float = 0.0
    snapshot_index: int = 0
    is_snapshot: bool = False
    source_server: str = ""
    data_source: str = ""
    agent_type: str = ""
    termination: str = "answered"
    num_turns: int = 1
    reward_extras: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        return int(self.versions.min()) if len(self.versions) else -1


@dataclass(frozen=True)
class _Meta:
    """Per-trajectory header entry: the scalars of ``Trajectory`` plus its two lengths."""

    trajectory_id: str
    group_uid: str
    prompt_len: int
    response_len: int
    reward: float
    snapshot_index: int = 0
    is_snapshot: bool = False
    source_server: str = ""
    data_source: str = ""
    agent_type: str = ""
    termination: str = "answered"
    num_turns: int = 1
    reward_extras: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError("prompt_len must be >= 1")
        if self.response_len < 0:
            raise ValueError("response_len must be >= 0")
        if self.termination not in TERMINATIONS:
            raise ValueError(f"termination must be one of {list(TERMINATIONS)}, got {self.termination!r}")
        if self.num_turns < 0 or self.snapshot_index < 0:
            raise ValueError("num_turns and snapshot_index must be >= 0")
        for k, v in self.reward_extras.items():
            if not isinstance(v, (int, float, str, bool)):
                raise ValueError(f"reward_extras.{k} must be a scalar")


_META_KEYS = tuple(k for k in _Meta.__dataclass_fields__ if k not in ("prompt_len", "response_len"))


def encode_columns(trajs: list[Trajectory]) -> tuple[list[dict[str, Any]], list[list[str]], list[np.ndarray]]:
    """Trajectories -> (header entries, [[column, dtype]], column arrays)."""
    metas = []
    for t in trajs:
        n = len(t.response_ids)
        lens = {len(t.response_mask), len(t.rollout_logprobs), len(t.versions)}
        if lens != {n}:
            raise ValueError(f"trajectory {t.trajectory_id}: response arrays differ in length")
        m = {k: getattr(t, k) for k in _META_KEYS}
        m["reward"] = float(m["reward"])
        m["prompt_len"] = len(t.prompt_ids)
        m["response_len"] = n
        metas.append(to_wire(_Meta(**m)))
    cols, arrays = [], []
    for name, attr, dtype, _ in COLUMNS:
        parts = [np.asarray(getattr(t, attr), dtype=dtype) for t in trajs]
        arrays.append(np.concatenate(parts) if parts else np.empty(0, dtype))
        cols.append([name, dtype])
    return metas, cols, arrays


def decode_columns(
    metas_raw: Any, cols_raw: Any, frames: list[memoryview], *, max_tokens: int, vocab_size: int = 0
) -> list[Trajectory]:
    """Validate and rebuild trajectories. Raises ProtocolError naming the offending field."""
    if not isinstance(metas_raw, list):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "trajectories: expected an array", field="trajectories")
    metas = [from_wire(_Meta, m, f"trajectories[{i}]") for i, m in enumerate(metas_raw)]
    if not isinstance(cols_raw, list) or len(cols_raw) != len(COLUMNS) or len(frames) != len(COLUMNS):
        raise ProtocolError(
            ErrorCode.MALFORMED, f"batch must carry {len(COLUMNS)} column frames", field="columns"
        )
    for i, m in enumerate(metas):
        if m.prompt_len + m.response_len > max_tokens:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"trajectories[{i}]: {m.prompt_len + m.response_len} tokens exceed the limit of {max_tokens}",
                field=f"trajectories[{i}]",
            )
    n_prompt = sum(m.prompt_len for m in metas)
    n_resp = sum(m.response_len for m in metas)
    cols = {}
    for (name, _attr, _dt, allowed), col, frame in zip(COLUMNS, cols_raw, frames, strict=True):
        if not (isinstance(col, list) and len(col) == 2 and col[0] == name and col[1] in allowed):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"columns: expected [{name!r}, one of {sorted(allowed)}], got {col!r}",
                field=f"columns.{name}",
            )
        dt = np.dtype(col[1]).newbyteorder("<")
        want = (n_prompt if name == "prompt_ids" else n_resp) * dt.itemsize
        if len(frame) != want:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"{name}: frame has {len(frame)} bytes, lengths in the header need {want}",
                field=name,
            )
        cols[name] = np.frombuffer(frame, dtype=dt)
    _check_values(cols, metas, vocab_size)
    return _split(cols, metas)


def _bad_index(name: str, bad: np.ndarray, metas: list[_Meta], what: str) -> ProtocolError:
    """Map a flat index in a column back to trajectory and position, for the error message."""
    flat = int(np.flatnonzero(bad)[0])
    key = "prompt_len" if name == "prompt_ids" else "response_len"
    start = 0
    for i, m in enumerate(metas):
        n = getattr(m, key)
        if flat < start + n:
            path = f"trajectories[{i}].{name}[{flat - start}]"
            return ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: {what}", field=path)
        start += n
    return ProtocolError(ErrorCode.INVALID_FIELD, f"{name}: {what}", field=name)  # unreachable


def _check_values(cols: dict[str, np.ndarray], metas: list[_Meta], vocab_size: int) -> None:
    for name in ("prompt_ids", "response_ids"):
        ids = cols[name]
        if len(ids) and (ids.min() < 0 or (vocab_size and ids.max() >= vocab_size)):
            bad = (ids < 0) | ((ids >= vocab_size) if vocab_size else False)
            raise _bad_index(name, bad, metas, f"token id outside [0, {vocab_size or 'inf'})")
    mask = cols["response_mask"]
    if len(mask) and mask.dtype != np.bool_ and mask.max() > 1:
        raise _bad_index("response_mask", mask > 1, metas, "mask values must be 0 or 1")
    lp = cols["rollout_logprobs"]
    ok = np.isfinite(lp) & (lp <= 0)
    if not ok.all():
        raise _bad_index("rollout_logprobs", ~ok, metas, "logprobs must be finite and <= 0")
    ver = cols["versions"]
    if len(ver) and ver.min() < 0:
        raise _bad_index("versions", ver < 0, metas, "policy versions must be >= 0")


def _split(cols: dict[str, np.ndarray], metas: list[_Meta]) -> list[Trajectory]:
    out = []
    p = r = 0
    for m in metas:
        pe, re_ = p + m.prompt_len, r + m.response_len
        scalars = {k: getattr(m, k) for k in _META_KEYS}
        out.append(
            Trajectory(
                prompt_ids=cols["prompt_ids"][p:pe],
                response_ids=cols["response_ids"][r:re_],
                response_mask=cols["response_mask"][r:re_],
                rollout_logprobs=cols["rollout_logprobs"][r:re_],
                versions=cols["versions"][r:re_],
                **scalars,
            )
        )
        p, r = pe, re_
    return out
