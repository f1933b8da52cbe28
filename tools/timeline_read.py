"""A run's timeline read back from ``RUN_DIR/timeline/*.jsonl``, and the series drawn from it.

Design: one `Process` per file (a process of the run, all its incarnations when it was restarted),
its records split by kind and sorted by time; the series (`level`, `rate`, `steps`) are plain
functions of the records, so they are tested on hand-built lists. The records and their names
come from ``common.timeline``, their one home. Used by ``tools.timeline`` (the trace) and
``tools.timeline_png`` (the PNG).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.timeline import PHASES, TIMELINE_DIR, Kind, Record, Role


@dataclass
class Process:
    """What one file holds: one process of the run (all its incarnations, when it was restarted)."""

    key: str  # the file's stem: "learner", "rollout-rs0"
    role: Role = Role.LEARNER
    name: str = ""
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES: None unset (all visible), "" none
    pids: list[int] = field(default_factory=list)
    spans: list[Record] = field(default_factory=list)
    instants: list[Record] = field(default_factory=list)
    samples: list[Record] = field(default_factory=list)
    truncated_at: float | None = None

    @property
    def label(self) -> str:
        who = "learner" if self.role is Role.LEARNER else f"rollout {self.name}"
        if self.gpus is None:
            return who
        return f"{who} · GPU {self.gpus}" if self.gpus else f"{who} · no GPU"


@dataclass
class Timeline:
    processes: list[Process]

    @property
    def learner(self) -> Process | None:
        return next((p for p in self.processes if p.role is Role.LEARNER), None)

    @property
    def servers(self) -> list[Process]:
        return [p for p in self.processes if p.role is Role.ROLLOUT]

    @property
    def start(self) -> float:
        """The earliest record's time (the origin of the trace and the PNG)."""
        return min((t for p in self.processes for t in _times(p)), default=0.0)

    @property
    def serving_start(self) -> float | None:
        """When the first rollout server served (its first record): what comes before is start-up
        (models loading, engines compiling). None without a rollout server's timeline."""
        return min((t for p in self.servers for t in _times(p)), default=None)

    @property
    def end(self) -> float:
        ends = [r.time + r.dur for p in self.processes for r in p.spans]
        return max([*ends, *(t for p in self.processes for t in _times(p))], default=0.0)


def _times(p: Process) -> Iterable[float]:
    for group in (p.spans, p.instants, p.samples):
        for r in group:
            yield r.time


def parse_records(lines: Iterable[str]) -> list[Record]:
    """The records of a file's lines; a line that is not a whole JSON record (a half-written last
    line, a kind a newer writer added) is skipped."""
    out = []
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and (r := Record.parse(obj)) is not None:
            out.append(r)
    return out


def build_process(key: str, records: Sequence[Record]) -> Process:
    p = Process(key, name=key)
    for r in records:
        if r.kind is Kind.PROCESS:
            try:
                p.role = Role(r.args.get("role", p.role))
            except ValueError:
                continue
            p.name = r.name or p.name
            gpus = r.args.get("gpus")
            p.gpus = None if gpus is None else str(gpus)
            if isinstance(pid := r.args.get("pid"), int):
                p.pids.append(pid)
        elif r.kind is Kind.SPAN:
            p.spans.append(r)
        elif r.kind is Kind.INSTANT:
            p.instants.append(r)
        elif r.kind is Kind.SAMPLE:
            p.samples.append(r)
        elif r.kind is Kind.TRUNCATED:
            p.truncated_at = r.time
    for group in (p.spans, p.instants, p.samples):
        group.sort(key=lambda r: r.time)
    return p


def read_timeline(run_dir: Path) -> Timeline:
    """Every process's timeline in ``run_dir``; ValueError naming the folder when there is none."""
    folder = Path(run_dir) / TIMELINE_DIR
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    processes = []
    for f in files:
        with f.open(encoding="utf-8", errors="replace") as lines:
            processes.append(build_process(f.stem, parse_records(lines)))
    processes = [p for p in processes if p.spans or p.instants or p.samples]
    if not processes:
        raise ValueError(f"no timeline in {folder}: the run recorded nothing there")
    # The learner first, then the rollout servers by name.
    processes.sort(key=lambda p: (p.role is not Role.LEARNER, p.name))
    return Timeline(processes)


# -- derived series ----------------------------------------------------------------------------


def level(samples: Sequence[Record], name: str) -> tuple[list[float], list[float]]:
    """(times, values) of a sampled level; samples without it are left out."""
    ts, vs = [], []
    for r in samples:
        v = r.args.get(name)
        if isinstance(v, int | float):
            ts.append(r.time)
            vs.append(float(v))
    return ts, vs


def rate(
    samples: Sequence[Record], name: str, window_s: float = 0.0
) -> tuple[list[float], list[float]]:
    """(times, per-second rate) of a cumulative counter, each over the samples of the last
    ``window_s`` seconds (at least the previous sample). A drop is a restarted process: counting
    goes on from the value before it."""
    ts, raw = level(samples, name)
    total, offset, prev = [], 0.0, None
    for v in raw:
        if prev is not None and v < prev:
            offset += prev
        total.append(v + offset)
        prev = v
    out_t, out_v = [], []
    j = 0
    for i in range(1, len(ts)):
        while j < i - 1 and ts[i] - ts[j + 1] >= window_s:
            j += 1
        dt = ts[i] - ts[j]
        if dt > 0:
            out_t.append(ts[i])
            out_v.append((total[i] - total[j]) / dt)
    return out_t, out_v


@dataclass(frozen=True)
class Step:
    step: int
    start: float
    end: float
    phases: dict[str, float]  # phase -> seconds


def steps(learner: Process | None) -> list[Step]:
    """The learner's steps, from their phase spans (a step is its phases' extent)."""
    if learner is None:
        return []
    by_step: dict[int, list[Record]] = {}
    for r in learner.spans:
        s = r.args.get("step")
        if r.name in PHASES and isinstance(s, int):
            by_step.setdefault(s, []).append(r)
    return [
        Step(
            s,
            min(r.time for r in rs),
            max(r.time + r.dur for r in rs),
            {r.name: r.dur for r in rs},
        )
        for s, rs in sorted(by_step.items())
    ]
