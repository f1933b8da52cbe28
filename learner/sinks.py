"""Where the learner's per-step metrics go: console, JSON lines, TensorBoard, Weights & Biases.

Design: each destination is a small `Sink` (``log(step, metrics)`` / ``close()``) registered in
`SINKS` under the name that ``trainer.logger`` uses; `MetricSinks` builds the configured ones from
one `SinkContext` and fans every step out to all of them. Metric names are slash-separated like
verl's (``actor/pg_loss``, ``reward/mean/<data_source>``, ``timing/step_s``); values are numbers,
and a NaN or infinity never crashes a sink (JSONL stores null, TensorBoard skips it, W&B takes the
float, the console prints "nan"), because a diverging run is when the metrics must keep flowing.

Resumption: a run restarted from a checkpoint passes ``start_step``; JSONL appends to the same
file (after dropping a half-written last line), TensorBoard purges the abandoned steps from its
view, W&B continues the same run id, and `common.metrics_file.read_metrics` hides records a restart superseded.
wandb is optional and imported only when configured; tensorboardX only when "tensorboard" is.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rich.console import Console

from common.console_format import step_line, step_progress
from common.metrics_file import METRICS_FILE, drop_partial_line, json_value
from common.registry import Registry
from learner.prometheus_sink import PrometheusSink
from learner.sink_api import Sink, SinkContext

if TYPE_CHECKING:
    from common.config.root import Config

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


SINKS: Registry[type[Sink]] = Registry("metric sink")
SINKS.register("prometheus")(PrometheusSink)


# ---------------------------------------------------------------- console


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


@SINKS.register("jsonl")
class JsonlSink:
    """Appends ``{"step": s, "time": unix_ts, **metrics}`` per step to ``run_dir/metrics.jsonl``,
    flushed per line so a killed process leaves only complete lines (bar at most a partial last)."""

    def __init__(self, ctx: SinkContext) -> None:
        self.path = ctx.run_dir / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_partial_line(self.path)
        self.file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clash = {"step", "time"} & metrics.keys()
        if clash:
            raise ValueError(
                f"metric names {sorted(clash)} clash with the JSONL record's own fields"
            )
        record = {"step": int(step), "time": time.time()}
        record.update({k: json_value(v) for k, v in metrics.items()})
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()  # idempotent


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
