"""A run's timeline as a Chrome / Perfetto trace and a PNG: ``draw_timeline`` and ``bin/plot --timeline``.

Design: the trace (`trace_events`) is a plain function of the records read by
``tools.timeline_read``; only `draw_timeline` touches the disk, and matplotlib only through
``tools.timeline_png`` (imported when drawing). The trace puts one process track per process of
the run, named by role and GPUs ("learner · GPU 0", "rollout rs0 · GPU 1"): complete events ('X')
for spans (the learner's phases, each step as a whole, validations, checkpoints, the rollout
servers' weight loads), instant events ('i') for weight versions published and groups granted, and
counter events ('C') for every sampled counter, a cumulative one (tokens sampled, trajectories
received) as its rate per second. Timestamps are microseconds since the run's first record
(``otherData.start_time`` holds that wall-clock time), so chrome://tracing and ui.perfetto.dev open
it as is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.timeline import CUMULATIVE, PHASES, Record, Role, Track
from tools.timeline_png import draw_png
from tools.timeline_read import Timeline, level, rate, read_timeline, steps

PNG_FILE = "timeline.png"
TRACE_FILE = "timeline.trace.json"


# -- the trace ---------------------------------------------------------------------------------

_TIDS = {"steps": 1, Track.STEP.value: 2, Track.WEIGHTS.value: 3, Track.ADMISSION.value: 4}


def _us(t: float, origin: float) -> float:
    return round((t - origin) * 1e6, 1)


def trace_events(tl: Timeline) -> dict[str, Any]:
    """The Chrome / Perfetto trace of ``tl`` (JSON object format)."""
    origin = tl.start
    events: list[dict[str, Any]] = []
    for pid, p in enumerate(tl.processes, start=1):
        events.append(_meta("process_name", pid, name=p.label))
        events.append(_meta("process_sort_index", pid, sort_index=pid))
        tracks = {r.track for r in (*p.spans, *p.instants)}
        if p.role is Role.LEARNER and any(r.name in PHASES for r in p.spans):
            tracks.add("steps")
        for track in sorted(tracks, key=lambda t: _TIDS.get(t, 99)):
            events.append(_meta("thread_name", pid, _TIDS.get(track, 99), name=track))
        if p.role is Role.LEARNER:
            for s in steps(p):
                events.append(
                    _complete(f"step {s.step}", "steps", pid, s.start, s.end - s.start, origin)
                    | {"args": {k: round(v, 4) for k, v in s.phases.items()}}
                )
        for r in p.spans:
            events.append(_complete(r.name, r.track, pid, r.time, r.dur, origin) | {"args": r.args})
        for r in p.instants:
            events.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": _instant_name(r),
                    "cat": r.track,
                    "pid": pid,
                    "tid": _TIDS.get(r.track, 99),
                    "ts": _us(r.time, origin),
                    "args": r.args,
                }
            )
        names = sorted({k for r in p.samples for k in r.args})
        for name in names:
            if name in CUMULATIVE:
                ts, vs = rate(p.samples, name)
                name = f"{name}_per_s"
            else:
                ts, vs = level(p.samples, name)
            events.extend(
                {"ph": "C", "name": name, "pid": pid, "ts": _us(t, origin), "args": {name: v}}
                for t, v in zip(ts, vs, strict=True)
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"start_time": origin, "processes": [p.key for p in tl.processes]},
    }


def _meta(kind: str, pid: int, tid: int = 0, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def _complete(
    name: str, track: str, pid: int, start: float, dur: float, origin: float
) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": name,
        "cat": track,
        "pid": pid,
        "tid": _TIDS.get(track, 99),
        "ts": _us(start, origin),
        "dur": round(dur * 1e6, 1),
    }


def _instant_name(r: Record) -> str:
    a = r.args
    if "version" in a:
        return f"{r.name} v{a['version']}"
    if "groups" in a:
        return f"{r.name} {a['groups']} to {a.get('server', '?')}"
    return r.name


# -- drawing ---------------------------------------------------------------------------------------


def draw_timeline(
    run_dir: Path, png: Path | None = None, trace: Path | None = None
) -> tuple[Path, Path]:
    """Write the trace and the PNG of ``run_dir``'s timeline (default: ``RUN_DIR/timeline.png`` and
    ``RUN_DIR/timeline.trace.json``); their paths. ValueError when the run recorded no timeline,
    ImportError when matplotlib is missing (the trace is written first)."""
    run_dir = Path(run_dir)
    tl = read_timeline(run_dir)
    png = Path(png) if png is not None else run_dir / PNG_FILE
    trace = Path(trace) if trace is not None else run_dir / TRACE_FILE
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text(json.dumps(trace_events(tl), separators=(",", ":")) + "\n")

    draw_png(tl, png, title=run_dir.resolve().name)
    return png, trace


def draw_beside(run_dir: Path, results: Path, name: str) -> dict[str, str]:
    """For a bench: ``run_dir``'s timeline drawn beside its ``results`` JSON, as
    ``<results stem>-<name>.timeline.png`` and ``.trace.json``. Their paths, or ``{"error": why}``:
    never raises, a missing timeline is not a failed bench."""
    stem = f"{results.stem}-{name}.timeline"
    try:
        png, trace = draw_timeline(
            run_dir, results.with_name(f"{stem}.png"), results.with_name(f"{stem}.trace.json")
        )
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"png": str(png), "trace": str(trace)}
