"""The learner's metric sinks: JSONL, TensorBoard event files, the console and the optional wandb."""

from __future__ import annotations

import io
import json
import math
import re
import struct
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from common.console_format import short, step_line
from common.metrics_file import METRICS_FILE, read_metrics
from common.registry import UnknownEntry
from learner.sinks import SINKS, WANDB_MISSING, MetricSinks

STEP_METRICS: dict[str, float] = {
    "reward/mean": 0.53125,
    "reward/mean/gsm8k": 0.6,
    "actor/pg_loss": -0.012345,
    "actor/kl_loss": 0.0011234,
    "actor/entropy": 1.23456,
    "actor/grad_norm": 0.4567,
    "staleness/mean": 1.25,
    "staleness/max": 3,
    "perf/tokens_per_s": 12345.6,
    "timing/wait_s": 1.234,
    "timing/prepare_s": 0.3,
    "timing/update_s": 9.1,
    "timing/broadcast_s": 1.1,
    "timing/step_s": 12.34,
    "policy/version": 7,
}


def quiet_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=80), buf


def plain(terminal_output: str) -> str:
    """Terminal output without its escape sequences (colours, cursor moves)."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal_output)


# ---------------------------------------------------------------- JSONL


def test_jsonl_writes_one_flushed_line_per_step(tmp_path: Path) -> None:
    sinks = MetricSinks(["jsonl"], tmp_path, total_steps=3)
    sinks.log(1, STEP_METRICS)
    # Readable before close: each line is flushed as it is written.
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    sinks.log(2, {"reward/mean": 0.75})
    sinks.close()

    assert len(lines) == 1
    first = json.loads(lines[0])
    assert first["step"] == 1 and isinstance(first["time"], float)
    assert first["actor/pg_loss"] == pytest.approx(-0.012345)
    assert first["policy/version"] == 7 and isinstance(first["policy/version"], int)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["reward/mean"] == 0.75


def test_jsonl_non_finite_values_are_null_and_read_back_as_nan(tmp_path: Path) -> None:
    with MetricSinks(["jsonl"], tmp_path, total_steps=None) as sinks:
        sinks.log(1, {"actor/pg_loss": math.nan, "actor/grad_norm": math.inf, "x": -math.inf})
    raw = json.loads((tmp_path / METRICS_FILE).read_text())
    assert raw["actor/pg_loss"] is None and raw["actor/grad_norm"] is None and raw["x"] is None
    (record,) = read_metrics(tmp_path)
    assert math.isnan(record["actor/pg_loss"])


def test_jsonl_resumed_run_appends_and_read_metrics_drops_superseded_steps(tmp_path: Path) -> None:
    with MetricSinks(["jsonl"], tmp_path, total_steps=10) as sinks:
        for step in range(1, 6):
            sinks.log(step, {"reward/mean": 0.1 * step})
    # Resumed from the step-3 checkpoint: steps 4 and 5 of the first attempt are abandoned.
    with MetricSinks(["jsonl"], tmp_path, total_steps=10, start_step=3) as sinks:
        for step in range(4, 6):
            sinks.log(step, {"reward/mean": 1.0 + step})

    assert len((tmp_path / METRICS_FILE).read_text().splitlines()) == 7
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["reward/mean"] for r in records[3:]] == [5.0, 6.0]
    assert len(read_metrics(tmp_path, keep_superseded=True)) == 7


def test_same_step_logged_twice_is_kept(tmp_path: Path) -> None:
    with MetricSinks(["jsonl"], tmp_path, total_steps=2) as sinks:
        sinks.log(1, {"reward/mean": 0.5})
        sinks.log(1, {"val/reward/mean": 0.4})
        sinks.log(2, {"reward/mean": 0.6})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 1, 2]


def test_truncated_last_line_is_skipped_and_repaired_before_appending(tmp_path: Path) -> None:
    with MetricSinks(["jsonl"], tmp_path, total_steps=None) as sinks:
        sinks.log(1, {"reward/mean": 0.5})
    path = tmp_path / METRICS_FILE
    with path.open("a") as f:  # what a process killed mid-write leaves
        f.write('{"step": 2, "time": 1.0, "reward/me')

    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    with MetricSinks(["jsonl"], tmp_path, total_steps=None, start_step=1) as sinks:
        sinks.log(2, {"reward/mean": 0.7})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_file_holding_only_a_partial_line_starts_afresh(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "ti')
    assert read_metrics(tmp_path) == []
    with MetricSinks(["jsonl"], tmp_path, total_steps=None) as sinks:
        sinks.log(1, {"reward/mean": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_corrupt_line_in_the_middle_is_an_error(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_metric_named_like_a_record_field_is_refused(tmp_path: Path) -> None:
    with MetricSinks(["jsonl"], tmp_path, total_steps=None) as sinks:
        with pytest.raises(ValueError, match="step"):
            sinks.log(1, {"step": 3.0})


# ---------------------------------------------------------------- TensorBoard


def read_event_records(logdir: Path) -> list[Any]:
    """Every Event of the event files in `logdir`, read with the TFRecord framing and checked."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            header = data[pos : pos + 8]
            (length,) = struct.unpack("<Q", header)
            (header_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
            payload = data[pos + 12 : pos + 12 + length]
            (payload_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
            assert header_crc == masked_crc32c(header) and payload_crc == masked_crc32c(payload)
            events.append(event_pb2.Event.FromString(payload))
            pos += 16 + length
    return events


def scalars(events: list[Any]) -> dict[tuple[str, int], float]:
    return {
        (value.tag, event.step): value.simple_value
        for event in events
        if event.HasField("summary")
        for value in event.summary.value
    }


def test_tensorboard_writes_readable_scalars(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with MetricSinks(["tensorboard"], tmp_path, total_steps=2) as sinks:
        sinks.log(1, STEP_METRICS)
        sinks.log(2, {"reward/mean": 0.75, "actor/pg_loss": math.nan})

    found = scalars(read_event_records(tmp_path / "tensorboard"))
    assert found[("reward/mean", 1)] == pytest.approx(0.53125)
    assert found[("reward/mean/gsm8k", 1)] == pytest.approx(0.6)
    assert found[("policy/version", 1)] == 7
    assert found[("reward/mean", 2)] == 0.75
    assert ("actor/pg_loss", 2) not in found  # non-finite: skipped, without a warning
    assert "NaN" not in caplog.text


def test_tensorboard_resume_purges_abandoned_steps(tmp_path: Path) -> None:
    from tensorboardX.proto import event_pb2

    with MetricSinks(["tensorboard"], tmp_path, total_steps=10, start_step=4) as sinks:
        sinks.log(5, {"reward/mean": 0.5})
    events = read_event_records(tmp_path / "tensorboard")
    starts = [e.step for e in events if e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [5]


# ---------------------------------------------------------------- console


def test_short_number_formatting() -> None:
    assert short(0.53125) == "0.531"
    assert short(-0.012345) == "-0.0123"
    assert short(12345.6) == "12.3k"
    assert short(999.7) == "1k"
    assert short(2.5e9) == "2.5G"
    assert short(7) == "7"
    assert short(0) == "0"
    assert short(math.nan) == "nan"
    assert short(-math.inf) == "-inf"


def test_step_line_shows_key_figures_present() -> None:
    line = step_line(3, 10, STEP_METRICS).plain
    assert line == (
        "step 3/10  reward 0.531  pg_loss -0.0123  kl 0.00112  entropy 1.23  grad_norm 0.457"
        "  stale 1.25 (max 3)  tok/s 12.3k  time 12.3s (wait 1.23 prep 0.3 update 9.1 bcast 1.1)"
    )
    assert step_line(4, None, {"reward/mean": 0.5}).plain == "step 4  reward 0.5"
    # dynamic sampling, over-long shaping and rollout correction, when on
    shaped = {
        "rollout/filtered_frac": 0.375,
        "reward/overlong_frac": 0.25,
        "reward/overlong_penalty_mean": -0.1,
        "rollout_corr/kl": 0.002,
        "rollout_corr/rollout_rs_masked_fraction": 0.01,
    }
    assert step_line(5, None, shaped).plain == (
        "step 5  filtered 0.375  overlong 0.25 (-0.1)  mismatch 0.002 (rej 0.01)"
    )


def test_console_not_a_terminal_prints_only_the_step_lines(tmp_path: Path) -> None:
    console, buf = quiet_console()
    with MetricSinks(["console"], tmp_path, total_steps=3, console=console) as sinks:
        sinks.log(1, STEP_METRICS)
        sinks.log(2, {"reward/mean": math.nan, "timing/step_s": 1.5})
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2, lines  # long lines are not wrapped, and no bar is drawn
    assert lines[0].startswith("step 1/3  reward 0.531  pg_loss -0.0123")
    assert lines[0].endswith("bcast 1.1)")
    assert lines[1] == "step 2/3  reward nan  time 1.5s"
    assert "\x1b" not in buf.getvalue()


def test_console_terminal_draws_a_progress_bar(tmp_path: Path) -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    with MetricSinks(["console"], tmp_path, total_steps=10, start_step=2, console=console) as s:
        s.log(3, {"reward/mean": 0.5})
    out = plain(buf.getvalue())
    assert "step 3/10  reward 0.5\n" in out and " 3/10 steps" in out


def test_console_without_total_steps(tmp_path: Path) -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    with MetricSinks(["console"], tmp_path, total_steps=None, console=console) as s:
        s.log(1, {"reward/mean": 0.5})
    assert "1/? steps" in plain(buf.getvalue())


# ---------------------------------------------------------------- wandb and the fan-out


def test_wandb_missing_gives_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, installed or not
    with pytest.raises(ImportError) as info:
        MetricSinks(["jsonl", "wandb"], tmp_path, total_steps=1)
    assert str(info.value) == WANDB_MISSING


class FakeRun:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.finished = 0

    def log(self, data: Mapping[str, float], step: int) -> None:
        self.logged.append((step, dict(data)))

    def finish(self) -> None:
        self.finished += 1


def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[FakeRun]:
    runs: list[FakeRun] = []

    def init(**kwargs: Any) -> FakeRun:
        runs.append(FakeRun(**kwargs))
        return runs[-1]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return runs


def test_wandb_logs_offline_and_resumes_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = fake_wandb(monkeypatch)
    with MetricSinks(
        ["wandb"], tmp_path, total_steps=2, project="p", experiment="e", config={"lr": 1e-6}
    ) as sinks:
        sinks.log(1, {"reward/mean": 0.5})
    monkeypatch.setenv("WANDB_API_KEY", "x")
    MetricSinks(["wandb"], tmp_path, total_steps=2, start_step=1).close()

    first, second = runs
    assert first.kwargs["mode"] == "offline" and second.kwargs["mode"] is None
    assert first.kwargs["project"] == "p" and first.kwargs["name"] == "e"
    assert first.kwargs["config"] == {"lr": 1e-6} and first.kwargs["dir"] == str(tmp_path)
    assert first.kwargs["id"] == second.kwargs["id"] and second.kwargs["resume"] == "allow"
    assert first.logged == [(1, {"reward/mean": 0.5})]
    assert first.finished == 1 and second.finished == 1


def test_unknown_sink_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(UnknownEntry, match="known: console, jsonl, prometheus, tensorboard, wandb"):
        MetricSinks(["jsonl", "mlflow"], tmp_path, total_steps=1)
    assert not (tmp_path / METRICS_FILE).exists()  # checked before any sink opened
    assert SINKS.names() == ["console", "jsonl", "prometheus", "tensorboard", "wandb"]


def test_prometheus_serves_the_latest_step(tmp_path: Path) -> None:
    import urllib.request

    from learner.prometheus_sink import PrometheusSink, prometheus_name
    from learner.sink_api import SinkContext

    assert prometheus_name("rollout/waste_frac") == "agentrl_learner_rollout_waste_frac"
    sink = PrometheusSink(
        SinkContext(tmp_path, total_steps=3, config={"learner": {"metrics_port": 0}})
    )
    try:
        # loopback unless learner.metrics_host opens it
        assert sink._server.server_address[0] == "127.0.0.1"
        sink.log(1, {"rollout/waste_frac": 0.25, "reward/mean": float("nan")})
        sink.log(2, {"rollout/waste_frac": 0.0})
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=10)
            .read()
            .decode()
        )
    finally:
        sink.close()
    assert "agentrl_learner_rollout_waste_frac 0.0" in text and "agentrl_learner_step 2.0" in text
    assert "reward_mean" not in text  # a non-finite value is left out


class FailingSink:
    def __init__(self) -> None:
        self.closes = 0

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        self.closes += 1
        raise OSError("disk full")


def test_close_is_idempotent_and_closes_every_sink_when_one_fails(tmp_path: Path) -> None:
    console, _ = quiet_console()
    sinks = MetricSinks(["console", "jsonl"], tmp_path, total_steps=1, console=console)
    failing = FailingSink()
    sinks.sinks.insert(0, failing)  # type: ignore[arg-type]
    jsonl = sinks.sinks[2]
    with pytest.raises(OSError, match="disk full"):
        sinks.close()
    assert jsonl.file.closed  # type: ignore[attr-defined]
    sinks.close()  # second close: nothing happens, no error
    assert failing.closes == 1
    with pytest.raises(RuntimeError, match="after close"):
        sinks.log(1, {})


def test_all_sinks_together(tmp_path: Path) -> None:
    console, buf = quiet_console()
    with MetricSinks(
        ["console", "jsonl", "tensorboard", "jsonl"], tmp_path, total_steps=2, console=console
    ) as sinks:
        assert len(sinks.sinks) == 3  # a repeated name opens its sink once
        sinks.log(1, STEP_METRICS)
    assert len(read_metrics(tmp_path)) == 1
    assert ("actor/lr", 1) not in scalars(read_event_records(tmp_path / "tensorboard"))
    assert buf.getvalue().startswith("step 1/2")
