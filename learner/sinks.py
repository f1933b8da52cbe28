"""Where the learner's per-step metrics go: console, JSON lines, TensorBoard, Weights & Biases.

Design: each destination is a small `Sink` (``log(step, metrics)`` / ``close()``) registered in
`SINKS` under the name that ``trainer.logger`` uses; `MetricSinks` builds the configured ones from
one `SinkContext` and fans every step out to all of them. Metric names are slash-separated like
verl's (``actor/pg_loss``, ``reward/mean/<data_source>``, ``timing/step_s``); values are numbers,
and a NaN or infinity never crashes a sink (JSONL stores null, TensorBoard skips it, W&B takes the
float, the console prints "nan"), because a diverging run is when the metrics must keep flowing.

Resumption: a run restarted from a checkpoint passes ``start_step``; JSONL appends to the same
file (after dropping a half-written last line), TensorBoard purges the abandoned steps from its
view, W&B continues the same run id, and `read_metrics` hides records a restart superseded.
wandb is optional and imported only when configured; tensorboardX only when "tensorboard" is.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from common.registry import Registry
from learner.prometheus_sink import PrometheusSink

if TYPE_CHECKING:
    from common.config.root import Config

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
WANDB_MISSING = (
    "trainer.logger includes wandb but the wandb package is not installed: "
    "pip install wandb, or drop wandb from trainer.logger"
)
SINK_PACKAGES: dict[str, tuple[str, str]] = {
    "wandb": ("wandb", WANDB_MISSING),
    "tensorboard": (
        "tensorboardX",
        "trainer.logger includes tensorboard but the tensorboardX package is not "
        "installed: pip install tensorboardX, or drop tensorboard from trainer.logger",
    ),
}
"""Sinks whose package is optional: the package and the message that says how to get it."""


def missing_sink_packages(loggers: Sequence[str]) -> list[str]:
    """One message per configured sink whose package is not installed (found without importing
    it: `--check` stays fast), so a run refuses it before Ray starts rather than after."""
    import importlib.util
    import sys

    def installed(package: str) -> bool:
        if package in sys.modules:  # imported already (or blocked: None)
            return sys.modules[package] is not None
        return importlib.util.find_spec(package) is not None

    return [
        message
        for name in dict.fromkeys(loggers)
        if name in SINK_PACKAGES
        for package, message in [SINK_PACKAGES[name]]
        if not installed(package)
    ]


def preflight_issues(config: Config) -> tuple[list[str], list[str]]:
    """bin/learner --check (and bin/train's): the sinks this learner would fail to build."""
    return missing_sink_packages(config.trainer.logger), []


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


SINKS: Registry[type[Sink]] = Registry("metric sink")
SINKS.register("prometheus")(PrometheusSink)


def short(value: float) -> str:
    """A number in 3 significant digits with k/M/G/T for large magnitudes: 0.0123, 4.56k, 12.3M."""
    if isinstance(value, numbers.Integral) and abs(int(value)) < 1000:
        return str(int(value))
    v = float(value)
    if not math.isfinite(v):
        return str(v)  # "nan", "inf", "-inf"
    for suffix in ("", "k", "M", "G"):
        # 999.5 would print as "1e+03" at 3 digits, so it already belongs to the next unit.
        if abs(v) < 999.5:
            return f"{v:.3g}{suffix}"
        v /= 1000
    return f"{v:.3g}T"


# ---------------------------------------------------------------- console


# (metric, label) pairs of the step line, in order; metrics absent from a step are left out.
_HEADLINE = (
    ("reward/mean", "reward"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/kl_loss", "kl"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad_norm"),
    ("val/reward/mean", "val"),
)
_TIMING_SPLIT = (
    ("timing/wait_s", "wait"),
    ("timing/prepare_s", "prep"),
    ("timing/update_s", "update"),
    ("timing/broadcast_s", "bcast"),
)


def agent_parts(metrics: Mapping[str, float]) -> list[tuple[str, str]]:
    """What the agents did (``learner.agent_metrics``), compactly: StateLM's snapshots and
    deletions and the code agent's sandbox runs whenever their agent ran (so a model that does not
    act yet shows 0), tool calls per episode only when there were some, with the busiest tools."""
    out = []
    if "agent/snapshots_per_episode" in metrics:
        snap = f"{short(metrics['agent/snapshots_per_episode'])}/ep"
        if "agent/deletions_per_episode" in metrics:
            snap += f" (del {short(metrics['agent/deletions_per_episode'])})"
        out.append(("snap", snap))
    if "agent/sandbox_runs_per_episode" in metrics:
        episodes = metrics.get("agent/episodes", 1.0)
        runs = metrics["agent/sandbox_runs_per_episode"] * episodes
        errors = metrics.get("agent/sandbox_errors_per_episode", 0.0) * episodes
        out.append(("sbx", f"{short(round(runs))} ({short(round(errors))} err)"))
    calls = metrics.get("agent/tool_calls_per_episode", 0.0)
    if calls > 0:
        per_tool = sorted(
            (
                (v, k.removeprefix("agent/tool_calls/"))
                for k, v in metrics.items()
                if k.startswith("agent/tool_calls/") and v > 0
            ),
            reverse=True,
        )
        busiest = " ".join(f"{name} {short(v)}" for v, name in per_tool[:3])
        out.append(("tools", f"{short(calls)}/ep" + (f" ({busiest})" if busiest else "")))
    return out


def step_line(step: int, total_steps: int | None, metrics: Mapping[str, float]) -> Text:
    """The console's line for one step: ``step 3/10  reward 0.5  pg_loss -0.01 ... time 12.3s``."""
    line = Text()
    line.append(f"step {step}" + (f"/{total_steps}" if total_steps is not None else ""), "bold")

    def add(label: str, figure: str) -> None:
        line.append("  ")
        line.append(label + " ", "dim")
        line.append(figure)

    for key, label in _HEADLINE:
        if key in metrics:
            add(label, short(metrics[key]))
    if "staleness/mean" in metrics:
        stale = short(metrics["staleness/mean"])
        if "staleness/max" in metrics:
            stale += f" (max {short(metrics['staleness/max'])})"
        add("stale", stale)
    if "rollout/waste_frac" in metrics:
        add("waste", short(metrics["rollout/waste_frac"]))
    for label, figure in agent_parts(metrics):
        add(label, figure)
    if "perf/tokens_per_s" in metrics:
        add("tok/s", short(metrics["perf/tokens_per_s"]))
    split = " ".join(f"{lab} {short(metrics[k])}" for k, lab in _TIMING_SPLIT if k in metrics)
    if "timing/step_s" in metrics or split:
        total = f"{short(metrics['timing/step_s'])}s" if "timing/step_s" in metrics else ""
        add("time", " ".join(p for p in (total, f"({split})" if split else "") if p))
    return line


def step_progress(console: Console) -> Progress:
    """The progress bar over training steps (shared by the console sink and bin/train)."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        refresh_per_second=2,
        # rich drops speed samples older than this period; RL steps can take minutes, and with
        # rich's 30 s default the ETA would stay unknown. Its sample deque (1000) keeps it recent.
        speed_estimate_period=6 * 3600,
    )


@SINKS.register("console")
class ConsoleSink:
    """A rich progress bar (steps, elapsed, ETA) with one readable line per step printed above it.

    On a console that is not a terminal (CI, output piped to a file) the bar is not started at all:
    rich would not redraw it there anyway, but would still print it once, plus a blank line, at
    the end. The output is then exactly the step lines.
    """

    def __init__(self, ctx: SinkContext) -> None:
        self.console = ctx.console if ctx.console is not None else Console()
        self.total_steps = ctx.total_steps
        self.progress = step_progress(self.console)
        self.task = self.progress.add_task(
            "training", total=ctx.total_steps, completed=ctx.start_step
        )
        self.live = self.console.is_terminal or self.console.is_jupyter
        if self.live:
            self.progress.start()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.progress.console.print(step_line(step, self.total_steps, metrics), soft_wrap=True)
        # Set rather than advance: a step logged twice (train and validation) counts once.
        self.progress.update(self.task, completed=step)

    def close(self) -> None:
        if self.live:
            self.progress.stop()  # idempotent in rich


# ---------------------------------------------------------------- JSON lines


def _json_value(value: float) -> int | float | None:
    # Integral also covers numpy ints; keeping ints exact matters for counters like policy/version.
    if isinstance(value, numbers.Integral):
        return int(value)
    v = float(value)
    return v if math.isfinite(v) else None  # JSON has no NaN; null keeps the file strict JSON


def _drop_partial_line(path: Path) -> None:
    """Truncate a last line without its newline (the process was killed mid-write), so appended
    records start on a line of their own."""
    if not path.exists():
        return
    with path.open("rb+") as f:
        end = pos = f.seek(0, os.SEEK_END)
        while pos > 0:  # backwards in chunks: the file grows with the run, its tail is what matters
            start = max(0, pos - 65536)
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                if start + newline + 1 < end:
                    f.truncate(start + newline + 1)
                return
            pos = start
        f.truncate(0)


@SINKS.register("jsonl")
class JsonlSink:
    """Appends ``{"step": s, "time": unix_ts, **metrics}`` per step to ``run_dir/metrics.jsonl``,
    flushed per line so a killed process leaves only complete lines (bar at most a partial last)."""

    def __init__(self, ctx: SinkContext) -> None:
        self.path = ctx.run_dir / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_partial_line(self.path)
        self.file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clash = {"step", "time"} & metrics.keys()
        if clash:
            raise ValueError(
                f"metric names {sorted(clash)} clash with the JSONL record's own fields"
            )
        record = {"step": int(step), "time": time.time()}
        record.update({k: _json_value(v) for k, v in metrics.items()})
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()  # idempotent


def read_metrics(run_dir: Path, *, keep_superseded: bool = False) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``, with null values read back as NaN.

    A truncated last line (a killed writer) is skipped. When the step goes backwards (a run resumed
    from an earlier checkpoint), the records of the abandoned attempt from that step on are dropped
    unless `keep_superseded`, so the result is the history of the run that continued.
    """
    path = Path(run_dir) / METRICS_FILE
    lines = path.read_text(encoding="utf-8").split("\n")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: the writer died mid-line
                continue
            raise ValueError(f"{path}:{number}: not a JSON line: {line[:80]!r}") from None
        record = {k: (math.nan if v is None else v) for k, v in record.items()}
        if not keep_superseded and records and records[-1]["step"] > record["step"]:
            # A restart: equal steps are kept (a step may be logged twice), lower ones start over.
            while records and records[-1]["step"] >= record["step"]:
                records.pop()
        records.append(record)
    return records


# ---------------------------------------------------------------- TensorBoard


@SINKS.register("tensorboard")
class TensorboardSink:
    """One scalar per metric in ``run_dir/tensorboard`` (tensorboardX: no TensorFlow needed)."""

    def __init__(self, ctx: SinkContext) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            if e.name != "tensorboardX":
                raise
            raise ImportError(
                "trainer.logger includes tensorboard but the tensorboardX package is not "
                "installed: pip install tensorboardX, or drop tensorboard from trainer.logger"
            ) from e
        self.writer = SummaryWriter(
            logdir=str(ctx.run_dir / TENSORBOARD_DIR),
            # On resume, TensorBoard hides the abandoned attempt's events from this step on.
            purge_step=ctx.start_step + 1 if ctx.start_step > 0 else None,
            # Events are written by tensorboardX's thread, which flushes the file only every
            # flush_secs; 1 s keeps a live TensorBoard current (our flush() cannot reach its queue).
            flush_secs=1,
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            v = float(value)
            # Non-finite values are skipped: tensorboardX would log a warning for each of them on
            # every step, and the JSONL file and the console still show them.
            if math.isfinite(v):
                self.writer.add_scalar(name, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()  # idempotent in tensorboardX


# ---------------------------------------------------------------- Weights & Biases


def _wandb_mode() -> str | None:
    """Offline unless the user chose (WANDB_MODE) or can log in (WANDB_API_KEY): no network needed."""
    if "WANDB_MODE" in os.environ or os.environ.get("WANDB_API_KEY"):
        return None  # wandb reads the environment itself
    return "offline"


def _wandb_run_id(run_dir: Path) -> str:
    """The run's W&B id, kept in the run directory so a resumed run continues the same W&B run."""
    path = run_dir / WANDB_ID_FILE
    if path.exists():
        return path.read_text(encoding="utf-8").strip()
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


@SINKS.register("wandb")
class WandbSink:
    """Logs to Weights & Biases (``dir=run_dir``); wandb is imported only when this sink is used."""

    def __init__(self, ctx: SinkContext) -> None:
        try:
            import wandb  # pyright: ignore[reportMissingImports]
        except ImportError as e:
            if e.name != "wandb":  # wandb is there but broken: its own error says more
                raise
            raise ImportError(WANDB_MISSING) from e
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        self.run: Any = wandb.init(
            project=ctx.project,
            name=ctx.experiment,
            config=dict(ctx.config),
            dir=str(ctx.run_dir),
            mode=_wandb_mode(),
            id=_wandb_run_id(ctx.run_dir),
            resume="allow",
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


# ---------------------------------------------------------------- fan-out


class MetricSinks:
    """The sinks named by ``trainer.logger``, used as one: `log` fans out, `close` closes all.

    Unknown names fail with the registry's error (listing the known sinks) before any sink opens; a
    sink that cannot start (wandb not installed) fails the construction and closes those opened.
    """

    def __init__(
        self,
        names: Sequence[str],
        run_dir: Path,
        *,
        total_steps: int | None,
        start_step: int = 0,
        project: str = "agentrl",
        experiment: str = "run",
        config: Mapping[str, Any] | None = None,
        console: Console | None = None,
    ) -> None:
        ctx = SinkContext(
            run_dir=Path(run_dir),
            total_steps=total_steps,
            start_step=start_step,
            project=project,
            experiment=experiment,
            config=dict(config or {}),
            console=console,
        )
        classes = [SINKS.get(name) for name in dict.fromkeys(names)]  # dedupe, keep order
        self.sinks: list[Sink] = []
        self._closed = False
        try:
            for cls in classes:
                self.sinks.append(cls(ctx))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._closed:
            raise RuntimeError("MetricSinks.log called after close")
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        """Close every sink, even when one fails; raise its error (a group if several) afterwards."""
        if self._closed:
            return
        self._closed = True
        errors: list[Exception] = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # collected, not swallowed: re-raised below
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup("closing metric sinks failed", errors)

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
