"""Repeated runs: bench/_repeats.py's figures over the repeats (median, spread, the failed repeats
left out) and headline ratios (median of the per-repeat ratios against the ratio of the medians
and the pooled ratio), and bench/e2e.py's run loop around them without bin/train: interleaving,
--deadline-s leaving runs for --resume, --resume keeping finished runs, and a warm-up below
--min-probe refused before any run. Plus bench/_common.py's pieces."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import _common, _e2e_runs, _e2e_setup, _e2e_variants  # noqa: E402
from bench._repeats import spread, summarize_repeats, summary_text  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
import e2e  # noqa: E402


def run(label: str, repeat: int, step_s: float, tok_s: float, **extra: Any) -> dict[str, Any]:
    """A run record as bench/e2e.py writes it, reduced to what the summary reads."""
    return {
        "label": label,
        "repeat": repeat,
        "ok": True,
        "steps_done": 10,
        "means": {"timing/step_s": step_s, "perf/tokens_per_s": tok_s, "timing/wait_s": 1.0},
        "mean_over_steps": list(range(2, 11)),
        "reward_curve": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
        "gpu_memory": {"peak_gpu_mib": 1000 * repeat},
        **extra,
    }


def test_spread() -> None:
    s = spread([3.0, None, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert s["values"] == [3.0, None, 1.0, 2.0] and s["rel_spread"] == 1.0
    assert spread([None])["median"] is None and spread([])["n"] == 0


def test_median_of_ratios_is_not_the_ratio_of_medians() -> None:
    # sync 10, 10, 10 s a step; async 5, 4, 8: per-repeat ratios 2.0, 2.5, 1.25
    runs = [
        run("sync", 1, 10.0, 100.0),
        run("async-s2", 1, 5.0, 250.0),
        run("sync", 2, 10.0, 100.0),
        run("async-s2", 2, 4.0, 300.0),
        run("sync", 3, 10.0, 100.0),
        run("async-s2", 3, 8.0, 110.0),
    ]
    runs[5]["mean_over_steps"] = list(range(2, 29))  # three times the steps: weighs 3x in the pool
    s = summarize_repeats(runs)
    step = s["vs_sync"]["async-s2"]["step_time_ratio"]
    assert step["values"] == [2.0, 2.5, 1.25] and step["repeats"] == [1, 2, 3]
    assert (step["median"], step["min"], step["max"]) == (2.0, 1.25, 2.5)
    assert step["ratio_of_medians"] == 2.0  # 10 / median(5, 4, 8) = 10 / 5
    assert step["pooled"] == round(10.0 / ((5 * 9 + 4 * 9 + 8 * 27) / 45), 3)  # 1.515
    tok = s["vs_sync"]["async-s2"]["tokens_per_s_ratio"]
    assert tok["values"] == [2.5, 3.0, 1.1] and tok["median"] == 2.5
    assert tok["ratio_of_medians"] == 2.5
    fig = s["configurations"]["async-s2"]["figures"]
    assert fig["step_s"]["median"] == 5.0 and fig["peak_gpu_mib"]["values"] == [1000, 2000, 3000]
    assert fig["final_reward"]["median"] == 0.4  # mean of the last 5 steps
    assert "async-s2 vs sync step_time_ratio: median 2.0 [1.25, 2.5] over 3 repeats" in (
        summary_text(s)
    )


def test_a_failed_run_is_listed_not_averaged() -> None:
    runs = [
        run("sync", 1, 10.0, 100.0),
        run("async-s1", 1, 5.0, 200.0),
        run("sync", 2, 12.0, 100.0),
        run("async-s1", 2, 1.0, 900.0) | {"ok": False},  # cut short: not a figure
    ]
    s = summarize_repeats(runs)
    c = s["configurations"]["async-s1"]
    assert c["repeats"] == [1] and c["failed_repeats"] == [2]
    assert s["vs_sync"]["async-s1"]["step_time_ratio"]["values"] == [2.0]  # repeat 2 unpaired
    assert "vs_sync" not in summarize_repeats([runs[1]])  # no sync run: no ratio


def test_runs_interleave_and_the_deadline_leaves_runs_for_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done: list[tuple[str, int]] = []
    fake_prepare(monkeypatch, probe=0.8)
    # the deadline counts from the bench's start (e2e.T0, set at import): this test's start here,
    # not whenever the suite first imported the module
    monkeypatch.setattr(e2e, "T0", e2e.time.monotonic())

    def fake_train(args: Any, s: int, repeat: int, *_: Any) -> dict[str, Any]:
        done.append((_e2e_variants.label(s), repeat))
        if len(done) == 3:  # the third run takes the time the deadline leaves
            monkeypatch.setattr(e2e, "T0", e2e.T0 - 1000)
        # no timeline in its run_dir: none drawn
        return run(
            _e2e_variants.label(s),
            repeat,
            10.0 if s == 0 else 5.0,
            100.0,
            wall_s=50.0,
            max_staleness=s,
        ) | {"run_dir": str(tmp_path / f"run-{s}-{repeat}")}

    monkeypatch.setattr(e2e, "run_train", fake_train)
    results = tmp_path / "r.json"
    argv = ["--device", "cpu", "--work-dir", str(tmp_path), "--results", str(results)]
    argv += ["--staleness", "0,2", "--repeats", "2", "--deadline-s", "900"]
    assert e2e.main(argv) == 1
    assert done == [("sync", 1), ("async-s2", 1), ("sync", 2)]  # interleaved
    out = json.loads(results.read_text())
    assert (
        out["pending"] == [{"repeat": 2, "max_staleness": 2, "variant": ""}]
        and "--resume" in out["error"]
    )
    assert out["placement"]["spec"] == "learner=0;rollout=0"
    # --resume keeps the three and runs the fourth only
    monkeypatch.setattr(e2e, "T0", e2e.time.monotonic())
    assert e2e.main([*argv, "--resume"]) == 0
    assert done[3:] == [("async-s2", 2)]
    out = json.loads(results.read_text())
    assert [(r["label"], r["repeat"]) for r in out["runs"]] == [*done[:3], ("async-s2", 2)]
    assert out["summary"]["vs_sync"]["async-s2"]["step_time_ratio"]["values"] == [2.0, 2.0]
    assert set(out["comparisons"]) == {"1", "2"} and "comparison" not in out
    # another placement's runs are not mixed in, nor overwritten
    assert e2e.main([*argv, "--resume", "--gpus", "2"]) == 2
    assert json.loads(results.read_text()) == out
    # nor those of another warm-up: the same model path, other weights (another lease's warm-up)
    keep = dict(out, warmup={**out["warmup"], "weights_sha256": "a" * 64})
    results.write_text(json.dumps(keep))
    assert e2e.main([*argv, "--resume", "--staleness", "0,2,4"]) == 2
    assert json.loads(results.read_text()) == keep and done[4:] == []


def test_a_warmup_below_min_probe_times_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_prepare(monkeypatch, probe=0.05)
    monkeypatch.setattr(e2e, "run_train", lambda *a: pytest.fail("a run was timed"))
    results = tmp_path / "r.json"
    argv = ["--device", "cpu", "--workload", "calc", "--work-dir", str(tmp_path)]
    assert e2e.main([*argv, "--results", str(results)]) == e2e.EXIT_WARMUP_MISSED
    out = json.loads(results.read_text())
    assert out["warmup"]["probe"] == 0.05 and out["warmup"]["min_probe"] == 0.15
    assert out["warmup"]["probe_ok"] is False and "--min-probe 0.15" in out["error"]
    assert e2e.main([*argv, "--results", str(results), "--prepare-only"]) == 3  # refused at once
    assert e2e.main([*argv, "--results", str(results), "--prepare-only", "--min-probe", "0"]) == 0


def fake_prepare(monkeypatch: pytest.MonkeyPatch, probe: float) -> None:
    """prepare() without bin/train --check, model files or a warm-up process."""
    monkeypatch.setattr(e2e, "preflight", lambda *a: None)
    monkeypatch.setattr(e2e, "write_model", lambda out, *a: out)
    monkeypatch.setattr(e2e, "params_of", lambda _: 1)
    monkeypatch.setattr(e2e, "write_data", lambda out, _: out)
    monkeypatch.setattr(e2e, "read_episodes", lambda _: [])
    monkeypatch.setattr(e2e, "plot", lambda *a: None)
    summary = {"steps": 40, "stopped": "max_seconds", "probe": probe, "seconds": 60.0}
    monkeypatch.setattr(_e2e_setup, "run_warmup", lambda *a: summary)


def test_common_pieces(tmp_path: Path) -> None:
    assert (
        _common.ratio(3, 2) == 1.5 and _common.ratio(1, 0) is None and _common.ratio("1", 2) is None
    )
    assert _common.parse_memory_used("0, 1200\n1, 300\n\n") == {0: 1200.0, 1: 300.0}
    mem = _common.GpuMemory()
    assert mem.summary() is None
    mem.add({0: 1000.0, 1: 500.0})
    mem.add({0: 200.0, 1: 2000.0})
    assert mem.summary() == {
        "peak_gpu_mib": 2200,
        "peak_per_gpu_mib": {"0": 1000, "1": 2000},
        "samples": 2,
    }
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert _common.tail(log, 2) == "line 98\nline 99" and _common.tail(tmp_path / "none") == ""


@pytest.mark.parametrize(
    ("steps_logged", "timed_out", "exit_status", "ok"),
    [
        (10, False, 0, True),
        (10, True, -15, True),  # the limit fell in the final checkpoint: every figure is in
        (7, True, -15, False),  # cut short: not a figure
        (10, False, 1, False),  # bin/train failed after its steps
    ],
)
def test_a_run_is_a_figure_once_all_its_steps_are_in(
    tmp_path: Path, steps_logged: int, timed_out: bool, exit_status: int, ok: bool
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [json.dumps({"step": s, "timing/step_s": 1.0}) for s in range(1, steps_logged + 1)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    log = tmp_path / "train.log"
    log.write_text("bin/train's output\n")
    args = e2e.parse_args(["--device", "cpu", "--steps", "10"])
    result: dict[str, Any] = {"timed_out": timed_out, "exit_status": exit_status, "wall_s": 9.0}
    _e2e_runs.close_run(args, result, run_dir, log, 100.0, "sync r1")
    assert result["ok"] is ok and result["steps_done"] == steps_logged
    assert ("error" in result) is not ok
