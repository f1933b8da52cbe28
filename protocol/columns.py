"""Validation of a TRAJECTORY_BATCH's columns, in both wire forms, from ``trajectory.FIELDS``.

1.5 form: ``header.columns`` names 5 token columns and then the ``NUMBERS`` (lengths, reward,
snapshot index, flags, turns); each is one little-endian frame. A number column is checked with one
numpy reduction, so decoding costs the same for 8 trajectories or 4,000. ``meta`` holds only the
strings and maps. 1.3/1.4 form (still decoded: old peers, journals, spool files): 5 token frames,
and every per-trajectory field is a list in ``meta``; those lists are checked in one pass per
column (``_FAST``), and value by value (``_VALUE``) only to name the first bad one.

Either way the result is the same: per-trajectory values as Python lists (what ``Trajectory``
holds; a 256-element ``tolist`` costs microseconds) and token columns as read-only views into the
frames. Every failure is a ProtocolError naming the field.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from protocol.errors import ErrorCode, ProtocolError
from protocol.limits import CodecLimits
from protocol.trajectory import (
    COLUMNS,
    FIELDS,
    HEADER_FIELDS,
    NUMBERS,
    TERMINATIONS,
    Field,
)

# The 1.3/1.4 meta map: every per-trajectory field, validated in declaration order.
LEGACY_META = tuple(f for f in FIELDS if f.placement != "token")
NUMBER_NAMES = tuple(f.name for f in NUMBERS)
FRAMES_LEGACY, FRAMES_NUMBERS = len(COLUMNS), len(COLUMNS) + len(NUMBERS)


def _invalid(path: str, what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: {what}", field=path)


# -- value rules per kind (header lists) ---------------------------------------------------------------
def _is_float(x: Any) -> bool:
    return (type(x) is float and math.isfinite(x)) or type(x) is int


_VALUE: dict[str, tuple[Any, str]] = {
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


# Whole-column checks for the common case: each only passes a column every value of which would
# pass its ``_VALUE`` rule, so the per-value rules (which find the first bad value for the error
# message) run only on columns about to be rejected. Same verdicts, same errors.
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


def _number_maps(col: list[Any], nonnegative: bool) -> bool:
    if not (_types(col) <= {dict} and _str_keys(col)):
        return False
    values = _dict_values(col)
    return (
        _types(values) <= {float, int}
        and _finite_sum(values)
        and (not nonnegative or min(values, default=0) >= 0)
    )


_TERMINATION_SET = frozenset(TERMINATIONS)
_FAST: dict[str, Any] = {
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
    "floats": lambda col: _number_maps(col, False),
    "counts": lambda col: _number_maps(col, True),
}


def _header_lists(raw: Any, specs: Sequence[Field], n: int) -> tuple[int, dict[str, list[Any]]]:
    """Validate the ``meta`` lists of ``specs``; ``n`` < 0: the first list sets the batch size."""
    if not isinstance(raw, dict):
        raise _invalid("meta", "expected a map of columns")
    out: dict[str, list[Any]] = {}
    for spec in specs:
        name = spec.name
        col = raw.get(name)
        if col is None:
            if spec.required:
                raise _invalid(f"meta.{name}", "missing required field")
            d = spec.default  # a map default is a fresh {} per trajectory
            out[name] = [{} for _ in range(max(n, 0))] if d == {} else [d] * max(n, 0)
            continue
        if not isinstance(col, list) or (n >= 0 and len(col) != n):
            raise _invalid(f"meta.{name}", f"expected a list of {max(n, 0)} values")
        n = len(col)
        ok, what = _VALUE[spec.kind]
        if not _FAST[spec.kind](col) and not all(map(ok, col)):
            i = next(i for i, x in enumerate(col) if not ok(x))
            raise _invalid(f"trajectories[{i}].{name}", f"{what} (got {col[i]!r:.60})")
        if spec.minimum > 0 and col and min(col) < spec.minimum:
            i = next(i for i, x in enumerate(col) if x < spec.minimum)
            raise _invalid(f"trajectories[{i}].{name}", f"must be >= {spec.minimum}")
        out[name] = col
    return n, out


# -- limits ----------------------------------------------------------------------------------------
def _too_many(n: int, limits: CodecLimits) -> None:
    if n > limits.max_trajectories_per_batch:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"batch of {n} trajectories exceeds the limit of {limits.max_trajectories_per_batch}",
        )


def _check_model_lengths(p: np.ndarray, r: np.ndarray, limits: CodecLimits) -> None:
    """Trajectory lengths against the model and the run (``max_model_len``, response budget)."""
    checks = (
        ("response_len", r, limits.max_response_tokens, "response token limit"),
        ("prompt_len+response_len", p + r, limits.max_model_len, "max_model_len"),
    )
    for name, values, limit, what in checks:
        if limit and len(values) and values.max() > limit:
            i = int(np.argmax(values > limit))
            path = f"trajectories[{i}].{name}"
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"{path} = {int(values[i])} exceeds the learner's {what} of {limit}",
                field=path,
            )


def _legacy_model_lengths(meta: Any, limits: CodecLimits) -> None:
    """The same check on 1.3/1.4 header lists, before anything else is looked at: only what can
    be read as integer columns is checked here; ``_header_lists`` reports the rest."""
    if not (limits.max_model_len or limits.max_response_tokens) or not isinstance(meta, dict):
        return
    plens, rlens = meta.get("prompt_len"), meta.get("response_len")
    if not (
        isinstance(plens, list) and isinstance(rlens, list) and len(plens) == len(rlens) and plens
    ):
        return
    try:
        p, r = np.asarray(plens, dtype=np.int64), np.asarray(rlens, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return
    if p.ndim == 1 and r.ndim == 1:
        _check_model_lengths(p, r, limits)


# -- binary columns --------------------------------------------------------------------------------------
def _descriptor(spec_name: str, allowed: Sequence[str], col: Any) -> np.dtype:
    if not (
        isinstance(col, list)
        and len(col) == 2
        and col[0] == spec_name
        and type(col[1]) is str
        and col[1] in allowed
    ):
        raise _invalid(
            f"columns.{spec_name}",
            f"expected [{spec_name!r}, one of {sorted(allowed)}], got {col!r:.80}",
        )
    return np.dtype(col[1]).newbyteorder("<")


def _numbers(cols_raw: list[Any], frames: list[memoryview], limits: CodecLimits) -> dict[str, Any]:
    """The 1.5 number frames as arrays, every value checked (one reduction per column)."""
    arrays: dict[str, np.ndarray] = {}
    n = -1
    for spec, col, frame in zip(NUMBERS, cols_raw, frames, strict=True):
        dt = _descriptor(spec.name, spec.dtypes, col)
        if n < 0:
            if frame.nbytes % dt.itemsize:
                raise _invalid(spec.name, f"frame of {frame.nbytes} bytes is no {dt} column")
            n = frame.nbytes // dt.itemsize
            _too_many(n, limits)
        elif frame.nbytes != n * dt.itemsize:
            raise _invalid(
                spec.name,
                f"frame has {frame.nbytes} bytes, {n} trajectories need {n * dt.itemsize}",
            )
        arrays[spec.name] = np.frombuffer(frame, dtype=dt)
    for spec in NUMBERS:
        a = arrays[spec.name]
        if not len(a):
            continue
        if spec.kind == "count":
            bad = a < spec.minimum if a.min() < spec.minimum else None
            what = f"expected an integer >= {spec.minimum}"
        elif spec.kind == "float":
            bad = None if np.isfinite(a).all() else ~np.isfinite(a)
            what = "expected a finite number"
        else:  # bool, checked as bytes: numpy reads byte 2 as True, a zero-copy consumer would not
            a = a.view(np.uint8)
            bad = a > 1 if a.max() > 1 else None
            what = "expected a boolean (0 or 1)"
        if bad is not None:
            i = int(np.flatnonzero(bad)[0])
            raise _invalid(f"trajectories[{i}].{spec.name}", f"{what} (got {a[i]!r})")
    return arrays


def _tokens(
    cols_raw: list[Any],
    frames: list[memoryview],
    plens: Sequence[int],
    rlens: Sequence[int],
    n_prompt: int,
    n_resp: int,
    vocab_size: int,
) -> dict[str, np.ndarray]:
    cols = {}
    for (name, _attr, _dt, allowed), col, frame in zip(COLUMNS, cols_raw, frames, strict=True):
        dt = _descriptor(name, tuple(allowed), col)
        want = (n_prompt if name == "prompt_ids" else n_resp) * dt.itemsize
        if frame.nbytes != want:
            raise _invalid(
                name, f"frame has {frame.nbytes} bytes, lengths in the header need {want}"
            )
        cols[name] = np.frombuffer(frame, dtype=dt)
    _check_values(cols, plens, rlens, vocab_size)
    return cols


def _bad_index(name: str, bad: np.ndarray, lens: Sequence[int], what: str) -> ProtocolError:
    """Map a flat index in a column back to trajectory and position, for the error message."""
    flat = int(np.flatnonzero(bad)[0])
    ends = np.cumsum(np.asarray(lens, dtype=np.int64))
    i = int(np.searchsorted(ends, flat, side="right"))
    start = int(ends[i - 1]) if i else 0
    return _invalid(f"trajectories[{i}].{name}[{flat - start}]", what)


def _ids_in_range(ids: np.ndarray, vocab_size: int) -> bool:
    """One pass: seen as unsigned, a negative id is huge, so ``max < vocab`` checks both bounds."""
    if not len(ids):
        return True
    # the trick needs vocab <= 2**31
    if not vocab_size or vocab_size > 1 << (8 * ids.dtype.itemsize - 1):
        return bool(ids.min() >= 0 and (not vocab_size or ids.max() < vocab_size))
    return bool(ids.view(np.dtype(f"<u{ids.dtype.itemsize}")).max() < vocab_size)


def _logprobs_ok(lp: np.ndarray) -> bool:
    """Finite and <= 0, in two reductions and no temporaries: max propagates NaN, min catches -inf."""
    return not len(lp) or bool(lp.max() <= 0 and np.isfinite(lp.min()))


def _check_values(
    cols: dict[str, np.ndarray], plens: Sequence[int], rlens: Sequence[int], vocab_size: int
) -> None:
    for name in ("prompt_ids", "response_ids"):
        ids = cols[name]
        if not _ids_in_range(ids, vocab_size):
            bad = (ids < 0) | ((ids >= vocab_size) if vocab_size else False)
            lens = plens if name == "prompt_ids" else rlens
            raise _bad_index(name, bad, lens, f"token id outside [0, {vocab_size or 'inf'})")
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


def _malformed() -> ProtocolError:
    return ProtocolError(
        ErrorCode.MALFORMED,
        f"batch must carry {FRAMES_LEGACY} column frames (or {FRAMES_NUMBERS} since 1.5)",
        field="columns",
    )


# -- the two forms -----------------------------------------------------------------------------------------
def decode_columns(
    meta_raw: Any, cols_raw: Any, frames: list[memoryview], limits: CodecLimits
) -> tuple[dict[str, list[Any]], dict[str, np.ndarray]]:
    """Validate a batch's columns: (per-trajectory values as lists, keyed as ``LEGACY_META``;
    token columns as read-only views into ``frames``). Raises ProtocolError naming the field."""
    if isinstance(cols_raw, list) and len(cols_raw) == FRAMES_NUMBERS:
        return decode_numbers_form(
            lambda n: _header_lists(meta_raw, HEADER_FIELDS, n)[1], cols_raw, frames, limits
        )
    return _decode_header_form(meta_raw, cols_raw, frames, limits)


def decode_numbers_form(
    header_lists: Callable[[int], dict[str, list[Any]]],
    cols_raw: list[Any],
    frames: list[memoryview],
    limits: CodecLimits,
) -> tuple[dict[str, list[Any]], dict[str, np.ndarray]]:
    """``decode_columns`` of the 1.5 form; ``header_lists(n)`` validates the ``meta`` lists of a
    batch of ``n`` (generic, or ``typed_header.lists``), at the point where the generic path
    would, so an invalid batch fails on the same check either way."""
    if len(frames) != FRAMES_NUMBERS:
        raise _malformed()
    nums = _numbers(cols_raw[FRAMES_LEGACY:], frames[FRAMES_LEGACY:], limits)
    p, r = nums["prompt_len"], nums["response_len"]
    _check_model_lengths(p, r, limits)
    total = p.astype(np.int64) + r
    if len(total) and total.max() > limits.max_tokens_per_trajectory:
        i = int(np.argmax(total > limits.max_tokens_per_trajectory))
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"trajectories[{i}]: {int(total[i])} tokens exceed the limit of "
            f"{limits.max_tokens_per_trajectory}",
            field=f"trajectories[{i}]",
        )
    meta = header_lists(len(p))
    tokens = _tokens(
        cols_raw[:FRAMES_LEGACY],
        frames[:FRAMES_LEGACY],
        p,
        r,
        int(p.sum()),
        int(r.sum()),
        limits.vocab_size,
    )
    for name, a in nums.items():
        meta[name] = (a.view(np.uint8) != 0).tolist() if name == "is_snapshot" else a.tolist()
    return {f.name: meta[f.name] for f in LEGACY_META}, tokens


def _decode_header_form(
    meta_raw: Any, cols_raw: Any, frames: list[memoryview], limits: CodecLimits
) -> tuple[dict[str, list[Any]], dict[str, np.ndarray]]:
    if isinstance(meta_raw, dict) and isinstance(meta_raw.get("trajectory_id"), list):
        _too_many(len(meta_raw["trajectory_id"]), limits)
    _legacy_model_lengths(meta_raw, limits)
    n, meta = _header_lists(meta_raw, LEGACY_META, -1)
    if (
        not isinstance(cols_raw, list)
        or len(cols_raw) != FRAMES_LEGACY
        or len(frames) != FRAMES_LEGACY
    ):
        raise _malformed()
    plens, rlens = meta["prompt_len"], meta["response_len"]
    max_tokens = limits.max_tokens_per_trajectory
    # Python ints here (a hostile header may hold 2**64), so no numpy until they are bounded.
    for i in range(n) if n and max(map(operator.add, plens, rlens)) > max_tokens else ():
        if plens[i] + rlens[i] > max_tokens:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"trajectories[{i}]: {plens[i] + rlens[i]} tokens exceed the limit of {max_tokens}",
                field=f"trajectories[{i}]",
            )
    tokens = _tokens(cols_raw, frames, plens, rlens, sum(plens), sum(rlens), limits.vocab_size)
    return meta, tokens
