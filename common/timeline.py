"""A process's timeline: ``RUN_DIR/timeline/<process>.jsonl``, what it did and when.

Design: each process of a run (the learner, every rollout server) appends typed records
(`Record`) to a file of its own, which ``tools/timeline.py`` reads back to draw the run: a Chrome /
Perfetto trace and a PNG. Times are wall-clock (``time.time()``), so the files of processes on one
machine line up without any exchange between them. Four kinds of record:

- ``process``: who writes the file (role, name, pid, host, ``CUDA_VISIBLE_DEVICES``), first in each
  process's part of it. A restarted process appends to the same file after a new one.
- ``span``: something that took time (``time`` its start, ``dur`` seconds): the learner's phases
  of a step, a rollout server's weight load.
- ``instant``: something that happened at ``time``: a weight version published, groups granted.
- ``sample``: counter values at ``time``, taken every `SAMPLE_INTERVAL_S` by `sample_every` (requests
  in flight, tokens sampled so far): the sampling rate, not the traffic, sets the file's growth.

The record names below (`Track`, the ``*_SPAN``/``*_EVENT`` constants, the counter names) are
the contract between writers and the reader: one home for them. Writing must never slow or stop
the process it describes: each record is one ``os.write`` of one line to a file opened with
O_APPEND (a few microseconds, never interleaved); a record JSON cannot hold is dropped (logged
once), an error of the file turns the writer off (logged), nothing is raised; and a file that
reaches `MAX_BYTES` gets one last record saying so and no more.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import anyio

from common.logging import get_logger

TIMELINE_DIR = "timeline"
"""The folder of the run directory that holds one ``<process>.jsonl`` per process."""
SAMPLE_INTERVAL_S = 0.5
"""How often counters are sampled: fine enough to see a step's phases (seconds on a GPU)."""
MAX_BYTES = 32 * 2**20
"""Per file: about 20 hours of samples at `SAMPLE_INTERVAL_S`, with room for the events."""


class Kind(StrEnum):
    PROCESS = "process"
    SPAN = "span"
    INSTANT = "instant"
    SAMPLE = "sample"
    TRUNCATED = "truncated"
    """The file reached `MAX_BYTES`: nothing after ``time`` was written."""


class Role(StrEnum):
    LEARNER = "learner"
    ROLLOUT = "rollout"


class Track(StrEnum):
    """The lane of a process a span or instant belongs to."""

    STEP = "step"  # learner: the phases of each training step, validation, checkpoints
    WEIGHTS = "weights"  # learner: versions published; rollout server: versions loaded
    ADMISSION = "admission"  # learner: groups granted to each rollout server


# Learner spans on Track.STEP: the trainer's phases, in order (its timing/<phase>_s metrics).
PHASES = ("wait", "prepare", "update", "broadcast")
VALIDATE_SPAN = "validate"
CHECKPOINT_SPAN = "checkpoint"
# A reference forward run inside a step's wait (learner.early_reference).
EARLY_REF_SPAN = "ref_early"
# A step's first mini-batch trained inside its wait (learner.early_update).
EARLY_UPDATE_SPAN = "update_early"
# Learner instants.
PUBLISH_EVENT = "publish"  # Track.WEIGHTS, args: version
GRANT_EVENT = "grant"  # Track.ADMISSION, args: server, groups, min_version
# Rollout-server span on Track.WEIGHTS, args: version, outcome ("ok", "failed": the old weights
# stay, "cancelled": the server stopped), via ("file" or "chunks").
APPLY_SPAN = "apply"

# Counter names in samples. Cumulative ones only grow within a process (the reader turns them into
# rates, and takes a drop for a restart); the others are levels.
LEARNER_COUNTERS = ("buffered_groups", "generating_groups", "received_trajectories")
ROLLOUT_COUNTERS = (
    "requests_in_flight",
    "episodes_in_flight",
    "granted_groups",
    "weight_version",
    "sampled_tokens",
)
CUMULATIVE = frozenset({"received_trajectories", "sampled_tokens"})


@dataclass(frozen=True)
class Record:
    kind: Kind
    time: float
    """Wall clock (``time.time()``); a span's start."""
    name: str = ""
    track: str = ""
    dur: float = 0.0
    """Seconds, for spans."""
    args: dict[str, Any] = field(default_factory=dict)
    """A span's or instant's details; a sample's counter values; a process's identity."""

    def to_json(self) -> str:
        out: dict[str, Any] = {"kind": self.kind.value, "time": round(self.time, 6)}
        if self.name:
            out["name"] = self.name
        if self.track:
            out["track"] = self.track
        if self.kind is Kind.SPAN:
            out["dur"] = round(self.dur, 6)
        if self.args:
            out["args"] = self.args
        return json.dumps(out, separators=(",", ":"))

    @classmethod
    def parse(cls, record: Mapping[str, Any]) -> Record | None:
        """The record a JSON object holds; None for one of an unknown kind (a newer writer) or one
        without a usable time."""
        try:
            kind = Kind(record.get("kind"))
            t = float(record["time"])
            dur = float(record.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            return None
        args = record.get("args")
        return cls(
            kind,
            t,
            str(record.get("name", "")),
            str(record.get("track", "")),
            dur,
            dict(args) if isinstance(args, Mapping) else {},
        )


def timeline_path(run_dir: Path, role: Role, name: str) -> Path:
    """Where a process's timeline goes: ``learner.jsonl``, ``rollout-<server id>.jsonl``."""
    stem = role.value if role is Role.LEARNER else f"{role.value}-{name}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)
    return Path(run_dir) / TIMELINE_DIR / f"{safe}.jsonl"


class TimelineWriter:
    """Appends a process's records to its file. ``TimelineWriter.off()`` writes nothing (a part
    used without a run, e.g. in a test)."""

    def __init__(
        self,
        path: Path | None,
        *,
        role: Role = Role.LEARNER,
        name: str = "",
        max_bytes: int = MAX_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path, self.clock, self.max_bytes = path, clock, max_bytes
        self._fd: int | None = None
        self._written = 0
        self._bad_record = False
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._written = os.fstat(self._fd).st_size  # a restarted process appends
        except OSError as e:
            self._failed(e)
            return
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        identity = {"role": role.value, "pid": os.getpid(), "host": socket.gethostname()}
        self.write(
            Record(Kind.PROCESS, clock(), name or role.value, args=identity | {"gpus": gpus})
        )

    @classmethod
    def off(cls) -> TimelineWriter:
        return cls(None)

    @property
    def on(self) -> bool:
        return self._fd is not None

    def span(self, track: Track, name: str, start: float, end: float, **args: Any) -> None:
        """Something that ran from ``start`` to ``end`` (wall clock)."""
        if self._fd is not None:
            self.write(Record(Kind.SPAN, start, name, track.value, max(0.0, end - start), args))

    def instant(self, track: Track, name: str, **args: Any) -> None:
        if self._fd is not None:
            self.write(Record(Kind.INSTANT, self.clock(), name, track.value, args=args))

    def sample(self, values: Mapping[str, float]) -> None:
        if self._fd is not None:
            self.write(Record(Kind.SAMPLE, self.clock(), args=dict(values)))

    def write(self, record: Record) -> None:
        """One line, one write; never raises."""
        if self._fd is None:
            return
        try:
            line = (record.to_json() + "\n").encode()
        except (TypeError, ValueError) as e:  # a value JSON cannot hold: this record is lost
            if not self._bad_record:
                self._bad_record = True
                get_logger("timeline").warning(
                    "timeline record dropped", name=record.name, error=f"{type(e).__name__}: {e}"
                )
            return
        try:
            if self._written + len(line) > self.max_bytes:
                end = Record(Kind.TRUNCATED, record.time, args={"max_bytes": self.max_bytes})
                os.write(self._fd, (end.to_json() + "\n").encode())
                get_logger("timeline").warning(
                    "timeline file full: no more records", path=str(self.path), bytes=self._written
                )
                self.close()
                return
            os.write(self._fd, line)
            self._written += len(line)
        except OSError as e:
            self._failed(e)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _failed(self, e: Exception) -> None:
        get_logger("timeline").warning(
            "timeline off: could not write it",
            path=str(self.path),
            error=f"{type(e).__name__}: {e}",
        )
        self.close()


async def sample_every(
    writer: TimelineWriter,
    read: Callable[[], Mapping[str, float]],
    interval_s: float = SAMPLE_INTERVAL_S,
) -> None:
    """Write ``read()`` now, every ``interval_s``, and once more when cancelled (run it in the task
    group that owns the process's work: its last values are those at the stop). A ``read`` that
    raises is logged once and skipped, never fatal."""
    warned = False

    def sample() -> None:
        nonlocal warned
        try:
            writer.sample(read())
        except Exception as e:
            if not warned:
                warned = True
                get_logger("timeline").warning(
                    "timeline sample failed", error=f"{type(e).__name__}: {e}"
                )

    try:
        while writer.on:
            sample()
            await anyio.sleep(interval_s)
    finally:
        sample()
