"""The run timeline: records written by common/timeline.py, read back, turned into a Chrome/Perfetto
trace and a PNG (tools/timeline*.py, bin/plot --timeline), on hand-built timelines. The timeline of
a real run is checked in tests/tools/test_train.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from common.timeline import (
    APPLY_SPAN,
    GRANT_EVENT,
    LEARNER_COUNTERS,
    PUBLISH_EVENT,
    ROLLOUT_COUNTERS,
    Kind,
    Record,
    Role,
    TimelineWriter,
    Track,
    sample_every,
    timeline_path,
)
from tools.timeline import draw_beside, trace_events
from tools.timeline_read import build_process, level, parse_records, rate, read_timeline, steps

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def write_run(run: Path, steps_n: int = 3) -> None:
    """A learner and two rollout servers (rs1 restarted once): 2 s steps, the first waiting 1 s."""
    clock = Clock()
    learner = TimelineWriter(timeline_path(run, Role.LEARNER, "learner"), clock=clock)
    servers = {
        n: TimelineWriter(
            timeline_path(run, Role.ROLLOUT, n), role=Role.ROLLOUT, name=n, clock=clock
        )
        for n in ("rs0", "rs1")
    }
    tokens = dict.fromkeys(servers, 0)
    learner.instant(Track.WEIGHTS, PUBLISH_EVENT, version=0)
    t = T0
    for step in range(1, steps_n + 1):
        learner.instant(Track.ADMISSION, GRANT_EVENT, server="rs0", groups=2, min_version=step - 1)
        for phase, dur in (("wait", 1.0 if step == 1 else 0.1), ("prepare", 0.3), ("update", 0.5)):
            learner.span(Track.STEP, phase, t, t + dur, step=step)
            t += dur
        learner.span(Track.STEP, "broadcast", t, t + 0.2, step=step, version=step)
        for k in range(4):
            clock.now = t - 1.0 + 0.5 * k
            learner.sample(dict.fromkeys(LEARNER_COUNTERS, 1.0))
            for name, w in servers.items():
                tokens[name] += 100
                w.sample({"requests_in_flight": 4, "sampled_tokens": tokens[name]})
        t += 0.2
        clock.now = t
        learner.instant(Track.WEIGHTS, PUBLISH_EVENT, version=step)
        servers["rs0"].span(Track.WEIGHTS, APPLY_SPAN, t, t + 0.05, version=step, outcome="ok")
    servers["rs1"].close()
    restarted = TimelineWriter(
        timeline_path(run, Role.ROLLOUT, "rs1"), role=Role.ROLLOUT, name="rs1", clock=clock
    )
    clock.now += 0.5
    restarted.sample({"requests_in_flight": 1, "sampled_tokens": 10})  # counting restarts at 0
    for w in (learner, servers["rs0"], restarted):
        w.close()


def test_records_round_trip_and_a_writer_never_raises(tmp_path: Path) -> None:
    r = Record(Kind.SPAN, T0, "update", Track.STEP.value, 0.5, {"step": 3})
    assert Record.parse(json.loads(r.to_json())) == r
    assert Record.parse({"kind": "some future kind", "time": 1}) is None
    assert Record.parse({"kind": "span"}) is None  # no time
    off = TimelineWriter.off()
    off.span(Track.STEP, "wait", 0, 1)
    assert not off.on
    blocked = tmp_path / "file"
    blocked.write_text("")
    broken = TimelineWriter(blocked / "timeline" / "x.jsonl")  # a file where a folder must be
    broken.instant(Track.WEIGHTS, PUBLISH_EVENT, version=1)
    assert not broken.on
    small = TimelineWriter(tmp_path / "small.jsonl", max_bytes=400)
    small.instant(Track.WEIGHTS, PUBLISH_EVENT, version=object())  # dropped, the writer stays on
    assert small.on
    for v in range(20):
        small.instant(Track.WEIGHTS, PUBLISH_EVENT, version=v)
    assert not small.on  # full: turned itself off
    records = parse_records((tmp_path / "small.jsonl").read_text().splitlines())
    assert records[0].kind is Kind.PROCESS and records[-1].kind is Kind.TRUNCATED
    assert (tmp_path / "small.jsonl").stat().st_size <= 400 + len(records[-1].to_json()) + 1
    assert build_process("small", records).truncated_at == records[-1].time


@pytest.mark.anyio
async def test_sampling_survives_a_failing_read(tmp_path: Path) -> None:
    writer = TimelineWriter(tmp_path / "s.jsonl")
    calls = 0

    def read() -> dict[str, float]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("boom")
        return {"requests_in_flight": calls}

    with anyio.move_on_after(0.35):
        await sample_every(writer, read, interval_s=0.05)
    samples = [
        r
        for r in parse_records((tmp_path / "s.jsonl").read_text().splitlines())
        if r.kind is Kind.SAMPLE
    ]
    assert calls >= 4 and [r.args["requests_in_flight"] for r in samples[:2]] == [1, 3]


def test_reading_a_run(tmp_path: Path) -> None:
    write_run(tmp_path)
    (tmp_path / "timeline" / "learner.jsonl").open("a").write('{"kind": "span", "ti')  # torn
    tl = read_timeline(tmp_path)
    assert [p.key for p in tl.processes] == ["learner", "rollout-rs0", "rollout-rs1"]
    learner, rs0, rs1 = tl.processes
    assert learner.role is Role.LEARNER and rs1.role is Role.ROLLOUT and len(rs1.pids) == 2
    got = steps(learner)
    assert [s.step for s in got] == [1, 2, 3]
    assert got[0].phases == {"wait": 1.0, "prepare": 0.3, "update": 0.5, "broadcast": 0.2}
    assert got[0].start == T0 and got[0].end == pytest.approx(T0 + 2.0)
    assert tl.start == T0 and tl.end >= got[-1].end
    assert tl.serving_start == pytest.approx(T0 + 0.8)  # the servers' first samples
    ts, vs = level(rs0.samples, "requests_in_flight")
    assert len(ts) == 12 and set(vs) == {4.0}
    with pytest.raises(ValueError, match="no timeline in"):
        read_timeline(tmp_path / "elsewhere")


def test_rates_of_cumulative_counters() -> None:
    samples = [
        Record(Kind.SAMPLE, T0 + t, args={"sampled_tokens": v})
        for t, v in ((0, 0), (1, 100), (2, 300), (3, 50), (4, 150))  # a restart after 2 s
    ]
    assert rate(samples, "sampled_tokens") == (
        [T0 + 1, T0 + 2, T0 + 3, T0 + 4],
        [100, 200, 50, 100],
    )
    _, windowed = rate(samples, "sampled_tokens", window_s=2.0)
    assert windowed == [100, 150, 125, 75]
    assert rate(samples[:1], "sampled_tokens") == ([], [])


def test_trace_has_a_track_per_process_and_every_kind_of_event(tmp_path: Path) -> None:
    write_run(tmp_path)
    trace = json.loads(json.dumps(trace_events(read_timeline(tmp_path))))  # JSON as written
    events: list[dict[str, Any]] = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names.values()) == ["learner", "rollout rs0", "rollout rs1"]
    learner = next(pid for pid, n in names.items() if n == "learner")
    spans = [e for e in events if e["ph"] == "X"]
    phases = [(e["name"], e["args"]["step"]) for e in spans if e["cat"] == "step"]
    assert phases[:4] == [("wait", 1), ("prepare", 1), ("update", 1), ("broadcast", 1)]
    step1 = next(e for e in spans if e["name"] == "step 1")
    assert step1["pid"] == learner and step1["ts"] == 0 and step1["dur"] == pytest.approx(2e6)
    assert any(e["name"] == APPLY_SPAN and e["cat"] == "weights" for e in spans)
    instants = {e["name"] for e in events if e["ph"] == "i"}
    assert {"publish v0", "publish v3", "grant 2 to rs0"} <= instants
    counters = {(names[e["pid"]], e["name"]) for e in events if e["ph"] == "C"}
    assert ("rollout rs0", "sampled_tokens_per_s") in counters
    assert ("rollout rs1", "requests_in_flight") in counters
    assert ("learner", "received_trajectories_per_s") in counters
    assert all(e["ts"] >= 0 for e in events if "ts" in e)
    assert trace["otherData"]["start_time"] == T0


def test_gpu_labels() -> None:
    header = {"kind": "process", "time": T0, "name": "rs0", "args": {"role": "rollout"}}
    for gpus, label in (
        (None, "rollout rs0"),
        ("", "rollout rs0 · no GPU"),
        ("1", "rollout rs0 · GPU 1"),
    ):
        rec = Record.parse(header | {"args": {"role": "rollout", "gpus": gpus}})
        assert rec is not None and build_process("rollout-rs0", [rec]).label == label


def test_counter_names_are_those_the_processes_sample() -> None:
    from rollout_service.metrics import RolloutStats

    assert tuple(RolloutStats().timeline_counters()) == ROLLOUT_COUNTERS


@pytest.mark.integration
def test_draw_and_bin_plot(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_run(run)
    out = subprocess.run(
        [sys.executable, str(REPO / "bin" / "plot"), str(run), "--timeline"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    png, trace = run / "timeline.png", run / "timeline.trace.json"  # the defaults
    assert out.stdout.split() == [str(png), str(trace)]
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 20_000
    assert json.loads(trace.read_text())["traceEvents"]
    # What bench/e2e.py calls after each run: beside its results JSON, never raising.
    results = tmp_path / "out" / "e2e-results-calc.json"
    assert draw_beside(run, results, "sync") == {
        "png": str(tmp_path / "out" / "e2e-results-calc-sync.timeline.png"),
        "trace": str(tmp_path / "out" / "e2e-results-calc-sync.timeline.trace.json"),
    }
    assert (tmp_path / "out" / "e2e-results-calc-sync.timeline.png").is_file()
    assert "no timeline in" in draw_beside(tmp_path / "nothing", results, "sync")["error"]
    missing = subprocess.run(
        [sys.executable, str(REPO / "bin" / "plot"), str(tmp_path), "--timeline"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "no timeline in" in missing.stderr
    assert "Traceback" not in missing.stderr
    wrong = subprocess.run(
        [sys.executable, str(REPO / "bin" / "plot"), str(run), "--trace", str(tmp_path / "t")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode == 2 and "--trace goes with --timeline" in wrong.stderr
