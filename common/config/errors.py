"""Configuration errors that name the file (or command-line override), the dotted key and the fault.

Design: every problem is an `Issue` (key, message, where it came from); `ConfigError` carries all
issues of one load so a user fixes them in one round. Pydantic's messages are rewritten into short
"must be ..." phrases with the offending value, and unknown keys get a difflib suggestion, because
the message is the whole user interface of a config mistake.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails


@dataclass(frozen=True)
class Issue:
    """One problem with a configuration."""

    key: str
    """Dotted key (`data.datasets.0.ratio`); empty for the document as a whole."""
    message: str
    """What is wrong, e.g. `must be greater than 0 (got -1)`."""
    source: str | None = None
    """Where the offending value came from: a file path or `command line override 'k=v'`."""
    related: tuple[str, ...] = ()
    """Other keys involved (a cross-field check); an override of any of them is blamed too."""

    def __str__(self) -> str:
        parts = [p for p in (self.source, self.key) if p]
        return ": ".join([*parts, self.message])


class ConfigError(Exception):
    """The configuration is invalid; `issues` lists every problem found.

    Deliberately not a ValueError: pydantic converts ValueErrors raised in validators into its own
    errors, while this one must travel unchanged from the root validator to the loader.
    """

    def __init__(self, issues: Iterable[Issue] | str) -> None:
        self.issues: tuple[Issue, ...] = (
            (Issue("", issues),) if isinstance(issues, str) else tuple(issues)
        )
        super().__init__("\n".join(str(i) for i in self.issues))

    def with_sources(self, blame: Callable[[Issue], str | None]) -> ConfigError:
        """A copy whose issues without a source get `blame(issue)` as their source."""
        return ConfigError(i if i.source else replace(i, source=blame(i)) for i in self.issues)


def dotted(loc: Sequence[str | int]) -> str:
    """`('data', 'datasets', 0, 'ratio')` -> `data.datasets.0.ratio` (the override syntax)."""
    return ".".join(str(p) for p in loc)


def show(value: Any, limit: int = 60) -> str:
    """A value as a user typed it in YAML: null/true/false, quoted strings, short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_MESSAGES = {
    "missing": "required key is missing",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "literal_error": "must be one of {expected}",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "model_type": "must be a mapping of keys",
    "dict_type": "must be a mapping of keys",
    "too_short": "must have at least {min_length} item(s)",
    "string_too_short": "must not be empty",
    "too_long": "must have at most {max_length} item(s)",
}
Suggest = Callable[[Sequence[str | int]], list[str]]
"""Given the location of a section, the keys it allows (for "did you mean" hints)."""
_NO_VALUE_SHOWN = {"missing", "extra_forbidden", "model_type", "dict_type"}


def issues_from_validation_error(
    error: ValidationError, suggest: Suggest | None = None
) -> list[Issue]:
    """Translate pydantic errors; `suggest(loc)` returns the valid keys next to an unknown key."""
    return [_issue(e, suggest) for e in error.errors(include_url=False)]


def _issue(error: ErrorDetails, suggest: Suggest | None) -> Issue:
    kind, loc = error["type"], error["loc"]
    key = dotted(loc)
    if kind == "extra_forbidden":
        message = "unknown key"
        candidates = suggest(loc[:-1]) if suggest else []
        close = difflib.get_close_matches(str(loc[-1]), candidates, n=1, cutoff=0.6)
        if close:
            message += f" (did you mean {close[0]}?)"
        return Issue(key, message)
    if kind in _MESSAGES:
        message = _MESSAGES[kind].format(**error.get("ctx", {}))
    else:
        message = error["msg"]
        # Our own validators raise ValueError("must ..."); pydantic prefixes it.
        message = message.removeprefix("Value error, ")
        message = message[:1].lower() + message[1:]
    if kind not in _NO_VALUE_SHOWN and "(got " not in message:
        message += f" (got {show(error['input'])})"
    return Issue(key, message)
