"""bin/chaos's shared records: the faults scheduled, the report, and what a fault or the check
may read or set of a run (`RunState`, which `tools.chaos.run.Chaos` is)."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tools.chaos.disk import SmallDisk
    from tools.chaos.netproxy import FaultProxy


@dataclass
class Fault:
    at_s: float  # seconds after the job trained its first step (of this start)
    kind: str
    target: str = ""
    done_at_s: float | None = None
    note: str = ""


@dataclass
class Report:
    seed: int
    steps: int
    faults: list[Fault] = field(default_factory=list)
    restarts_of_the_job: int = 0
    violations: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    growth: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def landed(self) -> list[Fault]:
        """The faults injected that found their target (not "no such process", "no connection")."""
        return [f for f in self.faults if f.done_at_s is not None and not f.note.startswith("no ")]

    @property
    def verdict(self) -> str:
        kinds = sorted({f.kind for f in self.landed})
        head = "PASS" if not self.violations else f"FAIL ({len(self.violations)} violations)"
        done = sum(f.done_at_s is not None for f in self.faults)
        return (
            f"{head}: seed {self.seed}, {self.facts.get('steps_reached', 0)}/{self.steps} steps, "
            f"{done} faults, {len(self.landed)} landed ({', '.join(kinds)}), "
            f"{self.restarts_of_the_job} job restarts"
        )


class RunState(Protocol):
    """What a fault (`tools.chaos.faults`) and the check (`tools.chaos.check`) use of the run."""

    args: argparse.Namespace
    rng: random.Random
    run: Path
    proxy: FaultProxy | None
    disk: SmallDisk | None
    job_must_restart: bool
    job_may_stop: bool
    samples: dict[str, list[tuple[float, float, int]]]
    seen: dict[int, float]

    def sample(self) -> None: ...

    def job_alive(self) -> bool: ...

    def steps_reached(self) -> int: ...
