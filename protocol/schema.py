"""Declarative validation of decoded msgpack values into typed dataclasses.

Messages are plain frozen dataclasses; their type annotations *are* the schema. ``from_wire`` walks
the annotations and checks every value, so a message object that exists has been validated (no
string-keyed dicts travel past the codec). Keys the decoder does not know are ignored: that is what
lets a newer minor version append optional fields. ``to_wire`` emits fields in declaration order, so
the same message always encodes to the same bytes (golden vectors rely on it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any

from protocol.errors import ErrorCode, ProtocolError

_MISSING = dataclasses.MISSING


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, annotation, required) per field, resolved once per class (defaults stay with the
    dataclass constructor)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, hints[f.name], f.default is _MISSING and f.default_factory is _MISSING)
        for f in dataclasses.fields(cls)
        if f.init
    )


def _fail(path: str, what: str, value: Any) -> ProtocolError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: {what} (got {shown})", field=path)


def check(tp: Any, value: Any, path: str) -> Any:
    """Return ``value`` converted to ``tp`` or raise INVALID_FIELD naming ``path``."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _fail(path, "must not be null", value)
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return check(inner[0], value, path)
        for a in inner:
            try:
                return check(a, value, path)
            except ProtocolError:
                continue
        raise _fail(path, f"expected one of {inner}", value)
    if origin is list or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _fail(path, "expected an array", value)
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return [check(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(path, "expected a map", value)
        kt, vt = typing.get_args(tp)
        return {
            check(kt, k, f"{path}.<key>"): check(vt, v, f"{path}.{k}") for k, v in value.items()
        }
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise _fail(path, f"expected one of {list(typing.get_args(tp))}", value)
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_wire(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(path, "expected a boolean", value)
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(path, "expected an integer", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, "expected a number", value)
        if not math.isfinite(value):
            raise _fail(path, "must be finite", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(path, "expected a string", value)
        return value
    if tp is bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise _fail(path, "expected binary", value)
        return bytes(value)
    raise TypeError(f"schema: unsupported annotation {tp!r} at {path}")  # a bug in a message class


def from_wire(cls: type, obj: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a decoded map, validating every field."""
    if not isinstance(obj, dict):
        raise _fail(path, "expected a map", obj)
    kwargs = {}
    for name, tp, required in _fields(cls):
        if name in obj:
            kwargs[name] = check(tp, obj[name], f"{path}.{name}")
        elif required:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"{path}.{name}: missing required field",
                field=f"{path}.{name}",
            )
    try:
        return cls(**kwargs)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as e:  # __post_init__ checks of cross-field invariants
        sub = getattr(e, "field", None)  # messages.FieldError names the field it is about
        where = f"{path}.{sub}" if isinstance(sub, str) and sub else path
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where}: {e}", field=where) from e


@functools.cache
def _omitted_defaults(cls: type) -> dict[str, Any]:
    """Fields marked ``omit_default`` (appended since 1.2) and the default they are omitted at."""
    return {
        f.name: f.default
        for f in dataclasses.fields(cls)
        if f.metadata.get("omit_default") and f.default is not _MISSING
    }


def to_wire(obj: Any) -> Any:
    """Dataclass tree -> msgpack-ready map, in field declaration order (fields marked
    ``omit_default`` left out at their default, so older messages keep their exact bytes)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        skip = _omitted_defaults(type(obj))
        wire = {}
        for name, *_ in _fields(type(obj)):
            value = getattr(obj, name)
            if not (name in skip and value == skip[name]):
                wire[name] = to_wire(value)
        return wire
    if isinstance(obj, (list, tuple)):
        return [to_wire(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    return obj
