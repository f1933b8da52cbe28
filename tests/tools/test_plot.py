"""tools/plot.py and bin/plot: training curves from a synthetic metrics.jsonl; missing metrics leave
a panel empty, a missing or empty file is a clear error naming it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tools.plot import PANELS, load_records, panel_series, plot_run

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run: Path, records: list[dict[str, object]]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def full_record(step: int) -> dict[str, object]:
    return {
        "step": step,
        "time": 1.7e9 + step,
        "reward/mean": 0.1 * step,
        "reward/mean/arith": 0.2 * step,
        "reward/mean/qa": 0.05 * step,
        "actor/kl_loss": 0.001 * step,
        "kl_in_reward/kl": 0.002,
        "actor/entropy": 3.0 - 0.1 * step,
        "staleness/mean": 0.5,
        "staleness/max": 1,
        "perf/tokens_per_s": 1000.0 + step,
        "perf/update_tokens_per_s": None,
    }


def panel(title: str):  # type: ignore[no-untyped-def]
    return next(p for p in PANELS if p.title.startswith(title))


def test_full_metrics_draw_a_png(tmp_path: Path) -> None:
    run = tmp_path / "run"
    records = [full_record(s) for s in range(1, 6)]
    # validation, logged at step 5
    records.append({"step": 5, "time": 1.7e9, "val/reward/mean": 0.4})
    write_metrics(run, records)
    out = plot_run(run)
    assert out == run / "training_curves.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    custom = plot_run(run, tmp_path / "elsewhere" / "curves.png")
    assert custom.read_bytes()[:8] == PNG_MAGIC


def test_series_per_panel() -> None:
    records = [full_record(s) for s in range(1, 4)] + [{"step": 3, "val/reward/mean": 0.25}]
    rewards = panel_series(records, panel("reward"))
    assert list(rewards) == ["reward/mean", "reward/mean/arith", "reward/mean/qa"]
    assert rewards["reward/mean"][0] == [1.0, 2.0, 3.0]
    assert list(panel_series(records, panel("KL"))) == ["actor/kl_loss", "kl_in_reward/kl"]
    # null (a non-finite value in the file) is left out, so an all-null series is not drawn.
    assert list(panel_series(records, panel("throughput"))) == ["perf/tokens_per_s"]
    assert panel_series(records, panel("validation")) == {"val/reward/mean": ([3.0], [0.25])}


def test_missing_metrics_leave_panels_empty(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_metrics(
        run,
        [
            {"step": 1, "time": 1.0, "reward/mean": 0.0},
            {"step": 2, "time": 2.0, "reward/mean": math.nan},
        ],
    )
    records = load_records(run)
    assert panel_series(records, panel("entropy")) == {}
    assert panel_series(records, panel("reward")) == {"reward/mean": ([1.0], [0.0])}
    assert plot_run(run).read_bytes()[:8] == PNG_MAGIC


def test_missing_or_empty_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"metrics\.jsonl does not exist"):
        plot_run(tmp_path)
    write_metrics(tmp_path, [])
    with pytest.raises(ValueError, match=r"no metrics in .*metrics\.jsonl"):
        plot_run(tmp_path)


@pytest.mark.integration
def test_bin_plot(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_metrics(run, [full_record(1), full_record(2)])
    out = tmp_path / "c.png"
    ok = subprocess.run(
        [sys.executable, str(REPO / "bin" / "plot"), str(run), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(out) and out.read_bytes()[:8] == PNG_MAGIC
    missing = subprocess.run(
        [sys.executable, str(REPO / "bin" / "plot"), str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1
    assert "metrics.jsonl" in missing.stderr and "Traceback" not in missing.stderr


def test_tool_use_panel_draws_turns_per_episode() -> None:
    """The demo's story, the tool-call rate, has its own panel (training and validation)."""
    records = [
        {"step": 1, "episode/turns_mean": 1.3, "val/episode/turns_mean": 1.2},
        {"step": 2, "episode/turns_mean": 1.8},
    ]
    series = panel_series(records, panel("tool use"))
    assert series == {
        "episode/turns_mean": ([1.0, 2.0], [1.3, 1.8]),
        "val/episode/turns_mean": ([1.0], [1.2]),
    }


def test_dynamic_sampling_has_a_panel_only_when_on() -> None:
    records = [
        {"step": 1, "rollout/filtered_frac": 0.5, "rollout/filtered_frac/math": 0.5},
        {"step": 2, "rollout/filtered_frac": 0.25, "rollout/filter_pass_rate": 0.7},
    ]
    p = panel("groups filtered")
    assert p.only_with_data
    assert panel_series(records, p) == {
        "rollout/filtered_frac": ([1.0, 2.0], [0.5, 0.25]),
        "rollout/filter_pass_rate": ([2.0], [0.7]),
        "rollout/filtered_frac/math": ([1.0], [0.5]),
    }
    assert panel_series([{"step": 1, "reward/mean": 0.1}], p) == {}
