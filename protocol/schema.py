"""Validation of decoded msgpack values into typed message dataclasses, by msgspec.

Messages are plain frozen dataclasses; their type annotations *are* the schema, and msgspec
enforces them (``msgspec.convert(..., strict=True)``: no bool for an int, no string for a number;
``Finite`` floats; ``Literal`` values; nested dataclasses; then each class's ``__post_init__``
checks across fields). So a message object that exists has been validated, and no string-keyed
dict travels past the codec. Keys the decoder does not know are ignored: that is what lets a newer
minor version append optional fields. msgspec's error, "what - at `$.path`", becomes an
INVALID_FIELD ProtocolError whose ``field`` is that path under the message type's name
(``HELLO.model.sha256``); a ``messages.FieldError`` from ``__post_init__`` adds the field it names.

``to_wire`` emits fields in declaration order, so the same message always encodes to the same
bytes (golden vectors rely on it).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from protocol.errors import ErrorCode, ProtocolError

Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
"""A float that is neither NaN nor infinite (both fail one of the bounds); ints are accepted."""

_AT = re.compile(r"(?s)(.*) - at `\$(.*)`")
_MISSING_FIELD = re.compile(r"Object missing required field `([^`]*)`")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _steps(where: str) -> list[tuple[str, ...]]:
    """msgspec's ``.name`` / ``[i]`` path as (name, "") / ("", index) steps."""
    return [m.groups("") for m in _STEP.finditer(where)]


def _at(obj: Any, steps: Sequence[tuple[str, ...]]) -> Any:
    """The value at ``steps`` in decoded ``obj``; LookupError where the path is not there."""
    for name, index in steps:
        if name and isinstance(obj, dict) and name in obj:
            obj = obj[name]
        elif index and isinstance(obj, list) and int(index) < len(obj):
            obj = obj[int(index)]
        else:
            raise LookupError
    return obj


def _replaced(obj: Any, steps: Sequence[tuple[str, ...]], new: Any) -> Any:
    """``obj`` with the value at ``steps`` replaced by ``new`` (containers on the way copied)."""
    if not steps:
        return new
    (name, index), rest = steps[0], steps[1:]
    if name and isinstance(obj, dict) and name in obj:
        return {**obj, name: _replaced(obj[name], rest, new)}
    if index and isinstance(obj, list) and int(index) < len(obj):
        i = int(index)
        return [*obj[:i], _replaced(obj[i], rest, new), *obj[i + 1 :]]
    raise LookupError


def _map_key(tp: Any, obj: Any, where: str, error: str) -> str:
    """msgspec names a bad map value ``m[...]``; find its key (only ever on a refused message):
    the key whose entry alone, in place of the map, is refused with the same error."""
    head, _, tail = where.partition("[...]")
    steps = _steps(head)
    try:
        parent = _at(obj, steps)
        if isinstance(parent, dict):
            for key, value in parent.items():
                try:
                    msgspec.convert(_replaced(obj, steps, {key: value}), type=tp, strict=True)
                except msgspec.ValidationError as e:
                    if str(e) == error:
                        return f"{head}.{key}{tail}"
    except (LookupError, TypeError, ValueError):
        pass
    return where


def _shown(obj: Any, where: str) -> str:
    """`` (got <the value at where>)``, at most 60 characters of it; "" if it cannot be found."""
    try:
        shown = repr(_at(obj, _steps(where)))
    except LookupError:
        return ""
    return f" (got {shown if len(shown) <= 60 else shown[:57] + '...'})"


def _error(e: msgspec.ValidationError, path: str, tp: Any, obj: Any) -> ProtocolError:
    what, where = str(e), ""
    if m := _AT.fullmatch(what):
        what, where = m.group(1), m.group(2)
    if "[...]" in where:
        where = _map_key(tp, obj, where, str(e))
    if m := _MISSING_FIELD.fullmatch(what):
        what, where = "missing required field", f"{where}.{m.group(1)}"
    elif e.__cause__ is None:  # a value of the wrong type or range (not __post_init__): show it
        what += _shown(obj, where)
    sub = getattr(e.__cause__, "field", None)  # messages.FieldError names the field it is about
    if isinstance(sub, str) and sub:
        where = f"{where}.{sub}"
    field = f"{path}{where}"
    return ProtocolError(ErrorCode.INVALID_FIELD, f"{field}: {what}", field=field)


def check(tp: Any, value: Any, path: str) -> Any:
    """Return ``value`` converted to ``tp`` or raise INVALID_FIELD naming ``path``."""
    try:
        return msgspec.convert(value, type=tp, strict=True)
    except msgspec.ValidationError as e:
        raise _error(e, path, tp, value) from e


def from_wire(cls: type, obj: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a decoded map, validating every field."""
    return check(cls, obj, path)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) per field; ``default`` is ``MISSING`` unless the field is marked
    ``omit_default`` (appended since 1.2: left out of the encoding at its default)."""
    return tuple(
        (f.name, f.default if f.metadata.get("omit_default") else dataclasses.MISSING)
        for f in dataclasses.fields(cls)
        if f.init
    )


def to_wire(obj: Any) -> Any:
    """Dataclass tree -> msgpack-ready map, in field declaration order (fields marked
    ``omit_default`` left out at their default, so older messages keep their exact bytes)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        wire = {}
        for name, omit_at in _fields(type(obj)):
            value = getattr(obj, name)
            if omit_at is dataclasses.MISSING or value != omit_at:
                wire[name] = to_wire(value)
        return wire
    if isinstance(obj, (list, tuple)):
        return [to_wire(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    return obj
