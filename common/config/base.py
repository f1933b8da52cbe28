"""Base class and small shared types for configuration sections.

Design: every section is a pydantic model that rejects unknown keys (typos fail loudly instead of
being ignored), validates strictly (a YAML `true` is not an integer, a quoted "3" is not a number)
and takes each field's description from the docstring written under it, as vLLM's configs do, so
the documentation sits next to the default. Assignments are validated too, so code that adjusts a
loaded config cannot put it into a state the loader would have refused.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Section(BaseModel):
    """A configuration section: strict, closed to unknown keys, documented by field docstrings."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        validate_assignment=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )


_ZMQ_ENDPOINT = re.compile(r"^(tcp|ipc|inproc)://\S+$")


def _check_endpoint(value: str) -> str:
    if not _ZMQ_ENDPOINT.match(value):
        raise ValueError(
            f"must be a ZeroMQ endpoint like tcp://host:port or ipc:///path (got {value!r})"
        )
    return value


ZmqEndpoint = Annotated[str, AfterValidator(_check_endpoint)]
"""A ZeroMQ endpoint string (tcp://, ipc:// or inproc://)."""

MiB = 1024 * 1024
