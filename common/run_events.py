"""The run's event channel: ``RUN_DIR/events.jsonl``, one typed JSON record per line.

Design: bin/train (``launcher/``) learns what its children do from this file, never from their log
text, so rewording a log line cannot break a launch. The learner appends `Kind.LISTENING` (the
address its intake actually bound: a port 0 resolved, which is how bin/train binds every port once)
and `Kind.READY` (its workers are up and it trains); each rollout server appends `Kind.CONNECTED`
and `Kind.DISCONNECTED` as its session with the learner starts and ends; the launcher itself appends
`Kind.STARTED` and `Kind.EXITED` for every child it runs (deaths included). A process writes only
when the launcher named the file in its environment (`EVENTS_ENV`): started by hand, it writes
nothing. Each event is a single ``write`` of one line to a file opened with O_APPEND, so writers in
several processes never interleave within a line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

EVENTS_ENV = "AGENTRL_EVENTS_FILE"
"""Environment variable naming the events file a process appends to (set by bin/train)."""
EVENTS_FILE = "events.jsonl"
"""Its name in the run directory."""


class Kind(StrEnum):
    LISTENING = "listening"
    """The learner's intake is bound; ``address`` is the endpoint with its real port."""
    READY = "ready"
    """The learner's workers are up: it trains from here on."""
    CONNECTED = "connected"
    """A rollout server (``source`` = its server id) has a session with the learner."""
    DISCONNECTED = "disconnected"
    """That session ended (the learner closed it or went silent)."""
    STARTED = "started"
    """bin/train started a child (``source`` = its name; ``pid``)."""
    EXITED = "exited"
    """A child of bin/train ended (``code``: its exit status, negative for a signal)."""


@dataclass(frozen=True)
class Event:
    kind: Kind
    source: str
    """Who it is about: "learner", a rollout server's id, or a child's name for STARTED/EXITED."""
    time: float
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {"event": self.kind.value, "source": self.source, "time": self.time, **self.data}
        )

    @classmethod
    def parse(cls, record: Mapping[str, Any]) -> Event | None:
        """The event a JSON record holds, or None for a record of an unknown kind (a newer writer)."""
        try:
            kind = Kind(record.get("event"))
        except ValueError:
            return None
        data = {k: v for k, v in record.items() if k not in ("event", "source", "time")}
        return cls(kind, str(record.get("source", "")), float(record.get("time", 0.0)), data)


def append(path: Path, event: Event) -> None:
    """Append one event to `path` (one write of one line: atomic against other appenders)."""
    line = (event.to_json() + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def emit(kind: Kind, source: str, **data: Any) -> None:
    """Append an event to the file bin/train named in `EVENTS_ENV`; nothing when it named none.
    Never raises: the channel informs the launcher, it must not take a process down."""
    target = os.environ.get(EVENTS_ENV)
    if not target:
        return
    try:
        append(Path(target), Event(kind, source, time.time(), data))
    except OSError:
        pass
