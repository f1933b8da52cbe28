"""The learner's per-step metrics file, ``RUN_DIR/metrics.jsonl``: how a record is written and read.

Design: one JSON object per line, ``{"step": s, "time": unix_ts, **metrics}``, strict JSON (NaN and
infinities stored as null, read back as NaN). The learner's JSONL sink writes it
(`learner.sinks.JsonlSink`); bin/train's console, its end-of-run plot and bin/plot read it, so the
format lives here, where both sides can import it without the learner's packages.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def json_value(value: float) -> int | float | None:
    # Integral also covers numpy ints; keeping ints exact matters for counters like policy/version.
    if isinstance(value, numbers.Integral):
        return int(value)
    v = float(value)
    return v if math.isfinite(v) else None  # JSON has no NaN; null keeps the file strict JSON


def drop_partial_line(path: Path) -> None:
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
