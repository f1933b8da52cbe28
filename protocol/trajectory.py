"""Trajectories and their column-wise wire form.

A trajectory is one sequence the learner trains on: an agent episode, or one segment of it when the
agent edits its own context (StateLM snapshots share the episode's ``group_uid``).

On the wire a batch's per-token arrays travel as five binary frames, one per column, each the
concatenation of that column over the batch in little-endian raw bytes; the msgpack header holds
the per-trajectory scalars as columns too (field -> list, lengths included) and names each token
column's dtype. This keeps the header small,
lets the sender hand numpy buffers to ZeroMQ without copying them again, and lets the receiver
validate every column with one vectorised pass instead of a Python loop per token. Decoded arrays are
read-only views into the received frames.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from protocol.errors import ErrorCode, ProtocolError

TERMINATIONS = ("answered", "no_tool_call", "length", "max_turns", "tool_error", "aborted")

# ``Trajectory.actions``: what the agent did in the episode, as counts. These names, plus
# ``tool_calls/<tool>`` per tool; receivers ignore names they do not know.
ACTION_COUNTS = (
    "tool_calls",
    "tool_errors",
    "snapshots",
    "deletions",
    "sandbox_runs",
    "sandbox_errors",
)
TOOL_CALLS_PREFIX = "tool_calls/"

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
    rollout_logprobs: (
        np.ndarray
    )  # logprob of each sampled token under the rollout policy; 0 where mask 0
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
    # Counts of the agent's actions over the whole episode (``ACTION_COUNTS``). Only the episode's
    # final trajectory carries them (StateLM snapshot trajectories carry {}), so summing over a
    # batch counts each episode once whichever of its segments were kept.
    actions: dict[str, float] = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        return int(self.versions.min()) if len(self.versions) else -1


# Per-trajectory scalars travel column-wise too: header["meta"] maps each field to a list with one
# value per trajectory. Validating a column is one tight loop per field instead of a schema walk per
# trajectory, which is what keeps decoding at memory speed for batches of thousands.
# (field, kind, required, default)
META_FIELDS: tuple[tuple[str, str, bool, Any], ...] = (
    ("trajectory_id", "str", True, None),
    ("group_uid", "str", True, None),
    ("prompt_len", "count", True, None),
    ("response_len", "count", True, None),
    ("reward", "float", True, None),
    ("snapshot_index", "count", False, 0),
    ("is_snapshot", "bool", False, False),
    ("source_server", "str", False, ""),
    ("data_source", "str", False, ""),
    ("agent_type", "str", False, ""),
    ("termination", "termination", False, "answered"),
    ("num_turns", "count", False, 1),
    ("reward_extras", "scalars", False, None),
    ("timings", "floats", False, None),
    ("actions", "counts", False, None),
)
# Optional map fields an encoder leaves out of the header when every trajectory's map is empty:
# agents that do not act cost nothing on the wire, and such a batch encodes as before the field.
OMITTED_WHEN_EMPTY = ("actions",)
SCALARS = (
    "trajectory_id",
    "group_uid",
    "reward",
    "snapshot_index",
    "is_snapshot",
    "source_server",
    "data_source",
    "agent_type",
    "termination",
    "num_turns",
    "reward_extras",
    "timings",
    "actions",
)
# protocol.batch builds trajectories positionally (a kwargs dict per trajectory costs more than the rest).
_POSITIONAL = ("trajectory_id", "group_uid", *(c[1] for c in COLUMNS), *SCALARS[2:])
assert tuple(f.name for f in fields(Trajectory))[: len(_POSITIONAL)] == _POSITIONAL, (
    "Trajectory fields moved"
)


def _is_float(x: Any) -> bool:
    return (type(x) is float and math.isfinite(x)) or type(x) is int


_KIND_CHECKS: dict[str, tuple[Any, str]] = {
    "str": (lambda x: type(x) is str, "expected a string"),
    "count": (lambda x: type(x) is int and x >= 0, "expected an integer >= 0"),
    "float": (_is_float, "expected a finite number"),
    "bool": (lambda x: type(x) is bool, "expected a boolean"),
    "termination": (lambda x: x in TERMINATIONS, f"expected one of {list(TERMINATIONS)}"),
    "scalars": (
        lambda d: (
            type(d) is dict
            and all(type(k) is str and type(v) in (int, float, str, bool) for k, v in d.items())
        ),
        "expected a map of scalars",
    ),
    "floats": (
        lambda d: type(d) is dict and all(type(k) is str and _is_float(v) for k, v in d.items()),
        "expected a map of numbers",
    ),
    "counts": (
        lambda d: (
            type(d) is dict
            and all(type(k) is str and _is_float(v) and v >= 0 for k, v in d.items())
        ),
        "expected a map of numbers >= 0",
    ),
}


# Whole-column checks for the common case: each one only passes a column that every value of would
# pass its ``_KIND_CHECKS`` entry, so the per-value checks (which find the first bad value for the
# error message) run only on columns that are about to be rejected. Same verdicts, same errors.
def _types(values: Any) -> set[type]:
    return set(map(type, values))


def _finite_sum(numbers: list[Any]) -> bool:
    """For ints and floats only: a finite sum means every term is finite (inf or nan propagate;
    an overflowing sum of finite terms merely sends the column to the per-value check)."""
    return math.isfinite(sum(numbers))


def _dict_values(col: list[Any]) -> list[Any]:  # only called once every item is known to be a dict
    return list(itertools.chain.from_iterable(map(dict.values, col)))


def _str_keys(col: list[Any]) -> bool:  # likewise
    return _types(set().union(*col)) <= {str}


def _floats_map(col: list[Any]) -> bool:
    if not (_types(col) <= {dict} and _str_keys(col)):
        return False
    values = _dict_values(col)
    return _types(values) <= {float, int} and _finite_sum(values)


def _counts_map(col: list[Any]) -> bool:
    if not (_types(col) <= {dict} and _str_keys(col)):
        return False
    values = _dict_values(col)
    return _types(values) <= {float, int} and _finite_sum(values) and min(values, default=0) >= 0


_TERMINATION_SET = frozenset(TERMINATIONS)
_FAST_CHECKS: dict[str, Any] = {
    "str": lambda col: _types(col) <= {str},
    "count": lambda col: _types(col) <= {int} and (not col or min(col) >= 0),
    "float": lambda col: _types(col) <= {float, int} and _finite_sum(col),
    "bool": lambda col: _types(col) <= {bool},
    "termination": lambda col: _types(col) <= {str} and set(col) <= _TERMINATION_SET,
    "scalars": lambda col: (
        _types(col) <= {dict}
        and _str_keys(col)
        and _types(_dict_values(col)) <= {int, float, str, bool}
    ),
    "floats": _floats_map,
    "counts": _counts_map,
}


def _decode_meta(raw: Any) -> tuple[int, dict[str, list[Any]]]:
    if not isinstance(raw, dict):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, "meta: expected a map of columns", field="meta"
        )
    n = -1
    out: dict[str, list[Any]] = {}
    for name, kind, required, default in META_FIELDS:
        col = raw.get(name)
        if col is None:
            if required:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD,
                    f"meta.{name}: missing required field",
                    field=f"meta.{name}",
                )
            out[name] = [default if default is not None else {} for _ in range(max(n, 0))]
            continue
        if not isinstance(col, list) or (n >= 0 and len(col) != n):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"meta.{name}: expected a list of {max(n, 0)} values",
                field=f"meta.{name}",
            )
        n = len(col)
        ok, what = _KIND_CHECKS[kind]
        if not _FAST_CHECKS[kind](col) and not all(map(ok, col)):
            i = next(i for i, x in enumerate(col) if not ok(x))
            path = f"trajectories[{i}].{name}"
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, f"{path}: {what} (got {col[i]!r:.60})", field=path
            )
        out[name] = col
    if n > 0 and min(out["prompt_len"]) < 1:
        i = next(i for i, x in enumerate(out["prompt_len"]) if x < 1)
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"trajectories[{i}].prompt_len: must be >= 1",
            field=f"trajectories[{i}].prompt_len",
        )
    return n, out


def decode_columns(
    meta_raw: Any,
    cols_raw: Any,
    frames: list[memoryview],
    *,
    max_tokens: int,
    max_trajectories: int,
    vocab_size: int = 0,
) -> tuple[dict[str, list[Any]], dict[str, np.ndarray]]:
    """Validate a batch's columns: (meta columns in wire order, token columns as read-only views
    into ``frames``). Raises ProtocolError naming the offending field."""
    if isinstance(meta_raw, dict) and isinstance(meta_raw.get("trajectory_id"), list):
        if len(meta_raw["trajectory_id"]) > max_trajectories:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"batch of {len(meta_raw['trajectory_id'])} trajectories exceeds the limit of {max_trajectories}",
            )
    n, meta = _decode_meta(meta_raw)
    if (
        not isinstance(cols_raw, list)
        or len(cols_raw) != len(COLUMNS)
        or len(frames) != len(COLUMNS)
    ):
        raise ProtocolError(
            ErrorCode.MALFORMED, f"batch must carry {len(COLUMNS)} column frames", field="columns"
        )
    plens, rlens = meta["prompt_len"], meta["response_len"]
    for i in range(n) if n and max(map(operator.add, plens, rlens)) > max_tokens else ():
        if plens[i] + rlens[i] > max_tokens:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"trajectories[{i}]: {plens[i] + rlens[i]} tokens exceed the limit of {max_tokens}",
                field=f"trajectories[{i}]",
            )
    n_prompt, n_resp = sum(plens), sum(rlens)
    cols = {}
    for (name, _attr, _dt, allowed), col, frame in zip(COLUMNS, cols_raw, frames, strict=True):
        if not (
            isinstance(col, list)
            and len(col) == 2
            and col[0] == name
            and type(col[1]) is str
            and col[1] in allowed
        ):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"columns: expected [{name!r}, one of {sorted(allowed)}], got {col!r:.80}",
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
    _check_values(cols, plens, rlens, vocab_size)
    return {k: meta[k] for k in (*SCALARS, "prompt_len", "response_len")}, cols


def _bad_index(name: str, bad: np.ndarray, lens: list[int], what: str) -> ProtocolError:
    """Map a flat index in a column back to trajectory and position, for the error message."""
    flat = int(np.flatnonzero(bad)[0])
    start = 0
    for i, n in enumerate(lens):
        if flat < start + n:
            path = f"trajectories[{i}].{name}[{flat - start}]"
            return ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: {what}", field=path)
        start += n
    return ProtocolError(ErrorCode.INVALID_FIELD, f"{name}: {what}", field=name)  # unreachable


def _ids_in_range(ids: np.ndarray, vocab_size: int) -> bool:
    """One pass: seen as unsigned, a negative id is huge, so ``max < vocab`` checks both bounds."""
    if not len(ids):
        return True
    if not vocab_size or vocab_size > 1 << (
        8 * ids.dtype.itemsize - 1
    ):  # (the trick needs vocab <= 2**31)
        return bool(ids.min() >= 0 and (not vocab_size or ids.max() < vocab_size))
    return bool(ids.view(np.dtype(f"<u{ids.dtype.itemsize}")).max() < vocab_size)


def _logprobs_ok(lp: np.ndarray) -> bool:
    """Finite and <= 0, in two reductions and no temporaries: max propagates NaN, min catches -inf."""
    return not len(lp) or bool(lp.max() <= 0 and np.isfinite(lp.min()))


def _check_values(
    cols: dict[str, np.ndarray], plens: list[int], rlens: list[int], vocab_size: int
) -> None:
    for name in ("prompt_ids", "response_ids"):
        ids = cols[name]
        metas = plens if name == "prompt_ids" else rlens
        if not _ids_in_range(ids, vocab_size):
            bad = (ids < 0) | ((ids >= vocab_size) if vocab_size else False)
            raise _bad_index(name, bad, metas, f"token id outside [0, {vocab_size or 'inf'})")
    mask = cols["response_mask"]
    # A bool column is checked as bytes too: numpy treats byte 2 as True, but a zero-copy hand-over
    # (torch.frombuffer, .view(uint8)) would see the 2.
    mask_bytes = mask.view(np.uint8)
    if len(mask) and mask_bytes.max() > 1:
        raise _bad_index("response_mask", mask_bytes > 1, rlens, "mask values must be 0 or 1")
    lp = cols["rollout_logprobs"]
    if not _logprobs_ok(lp):
        ok = np.isfinite(lp) & (lp <= 0)
        raise _bad_index("rollout_logprobs", ~ok, rlens, "logprobs must be finite and <= 0")
    ver = cols["versions"]
    if len(ver) and ver.min() < 0:
        raise _bad_index("versions", ver < 0, rlens, "policy versions must be >= 0")
