"""What bin/train reads while its children run, and what it shows: progress and step lines.

Design: bin/train learns what its children do only from files they write, read incrementally
from where they ended when the launch began (a resumed run appends to them): the event channel
(``RUN_DIR/events.jsonl``, `common.run_events`: typed records, never log text) tells where the
learner listens, when it is ready and which rollout servers are connected, and
``RUN_DIR/metrics.jsonl`` brings one record per finished step. The console shows a rich progress bar over the steps with the learner's own step
line (`common.console_format.step_line`) above it; when stdout is not a terminal only the lines are printed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

from common.console_format import short, step_line, step_progress
from common.file_tail import JsonlTail
from common.run_events import Event, Kind


class Connections:
    """Where the learner and tool server listen, whether the learner is ready and which rollout
    servers are connected, from the event channel."""

    def __init__(self, events_file: Path, expected: list[str]) -> None:
        self.tail = JsonlTail(events_file)
        self.expected = expected
        self.connected: set[str] = set()
        self.ever: set[str] = set()
        self.learner_ready = False
        self.learner_address: str | None = None
        self.tool_port: int | None = None

    def poll(self) -> list[tuple[str, str]]:
        """(event, who) pairs since the last call: ("joined" | "rejoined" | "left", server id),
        ("listening", address) when the learner's intake is bound, ("tool listening", port), and
        ("ready", "") once the learner's workers are up."""

        events = []
        for record in self.tail.read():
            event = Event.parse(record)
            if event is None:
                continue
            if event.kind is Kind.CONNECTED:
                peer = event.source
                events.append(("rejoined" if peer in self.ever else "joined", peer))
                self.connected.add(peer)
                self.ever.add(peer)
            elif event.kind is Kind.DISCONNECTED:
                self.connected.discard(event.source)
                events.append(("left", event.source))
            elif event.kind is Kind.LISTENING and event.source == "learner":
                self.learner_address = str(event.data.get("address"))
                events.append(("listening", self.learner_address))
            elif event.kind is Kind.LISTENING and event.source == "tool-server":
                self.tool_port = int(event.data.get("port", 0))
                events.append(("tool listening", str(self.tool_port)))
            elif event.kind is Kind.READY and not self.learner_ready:
                self.learner_ready = True
                events.append(("ready", ""))
        return events

    @property
    def missing(self) -> list[str]:
        """Expected servers that have not connected yet (even once)."""
        return [s for s in self.expected if s not in self.ever]


def metric_values(record: Mapping[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as the step line wants it: numbers only, null read as NaN."""
    return {
        k: (math.nan if v is None else float(v))
        for k, v in record.items()
        if k not in ("step", "time") and (v is None or isinstance(v, int | float))
    }


class Display:
    """The launch's console: a progress bar over the steps (on a terminal) and one line per step."""

    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self.console = console if console is not None else Console()
        self.total = total_steps
        self.progress = step_progress(self.console)
        self.task = self.progress.add_task("starting", total=total_steps)
        self.live = self.console.is_terminal
        if self.live:
            self.progress.start()

    def status(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        self.console.print(step_line(step, self.total, metrics), soft_wrap=True)
        self.progress.update(self.task, completed=step, description="training")

    def print(self, text: str, style: str | None = None) -> None:
        self.console.print(text, style=style, soft_wrap=True, highlight=False)

    def close(self) -> None:
        if self.live:
            self.progress.stop()
            self.live = False


def summary_lines(
    run_dir: Path,
    records: list[dict[str, Any]],
    total: int,
    wall_s: float,
    restarts: Mapping[str, int],
    plot: Path | None,
    checkpoints: Path,
    timeline: tuple[Path, Path] | None = None,
) -> list[str]:
    """The final summary: steps, wall time, reward from first to last step, where things are."""
    steps = records[-1]["step"] if records else 0
    lines = [f"done: {steps}/{total} steps in {time.strftime('%H:%M:%S', time.gmtime(wall_s))}"]
    rewards = [
        (r["step"], r["reward/mean"])
        for r in records
        if isinstance(r.get("reward/mean"), int | float)
    ]
    if rewards:
        (s0, r0), (s1, r1) = rewards[0], rewards[-1]
        lines.append(f"reward mean: {short(r0)} at step {s0} -> {short(r1)} at step {s1}")
    restarted = {name: n for name, n in restarts.items() if n}
    if restarted:
        lines.append("restarted: " + ", ".join(f"{name} x{n}" for name, n in restarted.items()))
    lines.append(f"run directory: {run_dir}")
    where = [
        ("config", run_dir / "config.resolved.yaml"),
        ("metrics", run_dir / "metrics.jsonl"),
        ("plot", plot),
        *((("timeline", timeline[0]), ("trace", timeline[1])) if timeline else ()),
        ("logs", run_dir / "logs"),
        ("checkpoints", checkpoints),
        ("model", run_dir / "final-hf"),
        ("tensorboard", run_dir / "tensorboard"),
        ("recordings", run_dir / "recordings"),
    ]
    lines += [f"  {label:<12}{path}" for label, path in where if path is not None and path.exists()]
    return lines
