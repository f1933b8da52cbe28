"""Structured logging for every process, built on structlog and routed through stdlib `logging`.

Design: structlog events and plain stdlib records (urllib3, filelock ...) end in the same
handlers, so library logs share the format and the fields. Ray's and vLLM's loggers are the
exception: importing Ray, or starting a vLLM engine, gives them their own handler and turns off
their propagation to the root.
Every record carries the process's static context (`component`, plus `server_id` or `rank`) added
by a processor rather than by contextvars, because threads and executor pools do not inherit
contextvars. Per-request context is bound by the caller, by convention with these names:

    log = get_logger(trajectory_id=tid, policy_version=v)     # a logger bound for one episode
    with structlog.contextvars.bound_contextvars(trajectory_id=tid):   # or for an asyncio task
        ...

Output: readable console lines (with timestamps) or JSON lines on stderr, plus optionally JSON
lines appended to a file in the run directory. `configure_logging` may be called again; it
replaces only the handlers it installed.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Literal, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

LogFormat = Literal["console", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]
FORMAT_ENV = "AGENTRL_LOG_FORMAT"
"""Environment variable that selects the log format (`console` or `json`)."""


class _StaticContext:
    """Adds the process-wide fields to every event without overwriting fields the caller set."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __call__(self, _logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
        for key, value in self.fields.items():
            event_dict.setdefault(key, value)
        return event_dict


class _OurHandler(logging.Handler):
    """Marker mixin: handlers installed by configure_logging (removed when it is called again)."""


class _StreamHandler(logging.StreamHandler, _OurHandler):  # type: ignore[type-arg]
    """With no fixed stream, writes to whatever sys.stderr is at the time: a live progress bar
    (rich) redirects sys.stderr so log lines print above the bar instead of through it."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self._follow = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow:
            self.stream = sys.stderr
        super().emit(record)


class _FileHandler(logging.FileHandler, _OurHandler):
    pass


def format_from_env(default: LogFormat = "console") -> LogFormat:
    """The format named by AGENTRL_LOG_FORMAT, or `default` when it is unset or unknown."""
    value = os.environ.get(FORMAT_ENV, "").strip().lower()
    return value if value in ("console", "json") else default  # type: ignore[return-value]


def configure_logging(
    fmt: LogFormat = "console",
    level: LogLevel = "info",
    *,
    component: str,
    file: str | Path | None = None,
    stream: TextIO | None = None,
    **context: Any,
) -> None:
    """Set up structlog and stdlib logging for this process.

    `component` (e.g. "learner", "rollout-server") and `context` (e.g. server_id=..., rank=...)
    are added to every record. `file`, if given, receives JSON lines whatever `fmt` is, so run
    directories are machine-readable. `stream` defaults to stderr, keeping stdout for program output.
    """
    static = _StaticContext({"component": component, **context})
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    # Applied to stdlib records before rendering, so they look like structlog events.
    foreign: list[Processor] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        timestamper,
        static,
    ]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.PositionalArgumentsFormatter(),
            timestamper,
            static,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.UnicodeDecoder(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        # Skip this module's frames so get_logger() names the caller's module, not ours.
        logger_factory=structlog.stdlib.LoggerFactory(ignore_frame_names=[__name__]),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: a later configure_logging call (tests, a worker re-binding its rank) must
        # take effect on loggers that already exist.
        cache_logger_on_first_use=False,
    )

    out = stream if stream is not None else sys.stderr
    handlers: list[logging.Handler] = [_StreamHandler(stream)]
    handlers[0].setFormatter(_formatter(fmt, foreign, colors=_is_tty(out)))
    if file is not None:
        path = Path(file)
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = _FileHandler(path, encoding="utf-8")
        file_handler.setFormatter(_formatter("json", foreign, colors=False))
        handlers.append(file_handler)

    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _OurHandler)]:
        root.removeHandler(old)
        old.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)


def get_logger(name: str | None = None, **context: Any) -> structlog.stdlib.BoundLogger:
    """A structlog logger (named `name`, default the caller's module) with `context` bound."""
    # No positional name lets the factory find the caller's module (getLogger(None) is the root).
    args = (name,) if name else ()
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(*args)
    return logger.bind(**context) if context else logger


def _formatter(fmt: LogFormat, foreign: list[Processor], *, colors: bool) -> logging.Formatter:
    renderer: Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        tail: list[Processor] = [structlog.processors.dict_tracebacks]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=colors)
        tail = []
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=foreign,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *tail,
            renderer,
        ],
    )


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
