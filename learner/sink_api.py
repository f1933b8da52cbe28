"""What a metric sink is: the `Sink` protocol and the `SinkContext` it is built from.

Design: apart from `learner.sinks` (which registers the sinks and fans steps out to them), so that a
sink kept in a module of its own (`learner.prometheus_sink`) implements the protocol without
importing the registry that imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console


@dataclass(frozen=True)
class SinkContext:
    """Everything a sink may need at construction; each sink reads only its part."""

    run_dir: Path
    total_steps: int | None
    start_step: int = 0
    project: str = "agentrl"
    experiment: str = "run"
    config: Mapping[str, Any] = field(default_factory=dict)
    console: Console | None = None


class Sink(Protocol):
    """One destination of metrics. `step` is the global step just finished (verl counts from 1)."""

    def __init__(self, ctx: SinkContext) -> None: ...

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...
