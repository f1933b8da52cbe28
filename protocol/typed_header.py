"""The header of a 1.5 TRAJECTORY_BATCH decoded straight into typed values: ``codec.decode``'s fast path.

The generic path (``codec._unpack``, then ``columns._header_lists``) builds every header value as a
plain msgpack object and then walks each list again in Python to check its types; for a batch of
256 trajectories that is ~1,500 strings and ~500 maps built, then looked at a second time. Here one
reusable ``msgspec`` decoder whose type is the header's schema (derived from
``trajectory.HEADER_FIELDS``) builds and type-checks them in one C pass. What types cannot say (every
list as long as the batch, numbers finite, counts >= 0) is checked after, a column at a time, with
the same whole-column tests the generic path uses.

This path only ever accepts what the generic path accepts, and hands back the same values. Anything
else (another type, an unknown key, an ext type, invalid UTF-8, nil, a 1.3/1.4 header, seq < 1, a
list of the wrong length, NaN) makes it give up (``decode`` returns None, ``lists`` raises
``Fallback``), and the caller decodes the message again by the generic path, which then accepts it
or names the error. So errors still come from one place and read as before; only valid batches of
the common form are sped up. Unknown keys make it give up rather than being skipped because msgspec
skips an unknown key's value unread, while the generic path refuses an ext type or bad UTF-8
anywhere in the header.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal, get_args

import msgspec

from protocol.trajectory import HEADER_FIELDS, TERMINATIONS


class Fallback(Exception):
    """The typed path cannot vouch for this header: decode it by the generic path."""


_Termination = Literal["answered", "no_tool_call", "length", "max_turns", "tool_error", "aborted"]
assert get_args(_Termination) == TERMINATIONS, "trajectory.TERMINATIONS changed: update this"

# Element type per value rule (``columns._VALUE``) of the fields that travel in ``meta``. msgspec is
# strict here as the rules are: no bool for a number, no int for a string; ``int | float`` keeps
# an int an int, as msgpack does.
_ELEMENT: dict[str, Any] = {
    "str": str,
    "termination": _Termination,
    "scalars": dict[str, bool | int | float | str],
    "floats": dict[str, int | float],
    "counts": dict[str, int | float],
}

# Optional fields may be absent or nil (the generic path defaults both); required ones may not.
# kw_only lets required and optional fields come in declaration order.
_Meta: Any = msgspec.defstruct(
    "BatchMeta",
    [
        (f.name, list[_ELEMENT[f.kind]])
        if f.required
        else (f.name, list[_ELEMENT[f.kind]] | None, None)
        for f in HEADER_FIELDS
    ],
    kw_only=True,
    forbid_unknown_fields=True,
    gc=False,
)
_Header: Any = msgspec.defstruct(
    "BatchHeader",
    [("seq", int), ("columns", list[list[str]]), ("meta", _Meta)],
    kw_only=True,
    forbid_unknown_fields=True,
    gc=False,
)
_DECODER = msgspec.msgpack.Decoder(_Header)


def decode(data: Any, columns: int) -> Any:
    """``data`` (a buffer) as a typed header with ``seq >= 1`` and ``columns`` column descriptors,
    or None: then only the generic path can tell whether it is valid."""
    try:
        header = _DECODER.decode(data)
    except Exception:  # msgspec raises DecodeError, ValidationError, UnicodeDecodeError, ...
        return None
    if header.seq < 1 or len(header.columns) != columns:
        return None
    return header


def _map_values(col: list[dict[str, Any]]) -> list[Any]:
    return list(itertools.chain.from_iterable(map(dict.values, col)))


def _finite(values: list[Any]) -> bool:
    """Every value finite (ints and floats only): inf and NaN propagate into the sum. A sum that
    overflows on finite values gives up too; the generic path then decides."""
    return math.isfinite(sum(values))


# What the element types leave to check, per rule (``columns._VALUE``); absent: nothing.
_CHECKS: dict[str, Any] = {
    "floats": lambda col: _finite(_map_values(col)),
    "counts": lambda col: _finite(v := _map_values(col)) and min(v, default=0) >= 0,
}
assert all(f.minimum == 0 for f in HEADER_FIELDS), "a header minimum would need a check here"


def lists(header: Any, n: int) -> dict[str, list[Any]]:
    """The ``meta`` lists of a header from ``decode`` for a batch of ``n``, as
    ``columns._header_lists`` returns them (defaults filled in); ``Fallback`` if any breaks a
    rule."""
    meta = header.meta
    out: dict[str, list[Any]] = {}
    for spec in HEADER_FIELDS:
        col = getattr(meta, spec.name)
        if col is None:
            d = spec.default  # a map default is a fresh {} per trajectory
            out[spec.name] = [{} for _ in range(n)] if d == {} else [d] * n
            continue
        check = _CHECKS.get(spec.kind)
        if len(col) != n or (check is not None and not check(col)):
            raise Fallback
        out[spec.name] = col
    return out
