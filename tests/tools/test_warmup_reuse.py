"""bench/e2e.py's warm-up cache (bench/_e2e_setup.py): a kept warm-up is reused under other step and
time caps when it stopped at its target within them, and trained again when a cap stopped it, or
when anything that shapes it (seed, target, rows, device) differs. Reuse is read through
run_warmup itself (a warm-up it did not reuse would start a child, which this tier forbids); the
refusals through the decision it makes, so that no warm-up is trained here."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import _e2e_setup  # noqa: E402

EXTRA = ["--target", "0.2", "--seed", "0"]


def keep(tmp_path: Path, summary: dict[str, Any], steps: int = 1500, seconds: float = 480.0):
    """A warm-up kept as run_warmup leaves one: its folder with warmup.json, and the stamp."""
    model, rows, out = tmp_path / "absent-model", tmp_path / "rows.jsonl", tmp_path / "warm"
    rows.write_text('{"q": 1}\n')
    out.mkdir()
    (out / "warmup.json").write_text(json.dumps(summary))
    want = {
        "source_model": str(model),
        "device": "cuda",
        "max_steps": steps,
        "cap_seconds": seconds,
        "args": EXTRA,
        "data": _e2e_setup.file_digest(rows),
    }
    (tmp_path / "warm.json").write_text(json.dumps({"want": want, "summary": summary}))
    return model, rows, out


AT_TARGET = {"stopped": "target", "steps": 660, "seconds": 424.1, "probe": 0.21}


@pytest.mark.parametrize("steps,seconds", [(1500, 480.0), (1500, 500.0), (700, 430.0)])
def test_a_warm_up_that_reached_its_target_within_the_new_caps_is_reused(
    tmp_path: Path, steps: int, seconds: float
) -> None:
    model, rows, out = keep(tmp_path, AT_TARGET)
    got = _e2e_setup.run_warmup(model, rows, out, "cuda", steps, seconds, EXTRA)
    assert got == AT_TARGET


@pytest.mark.parametrize(
    "summary,steps,seconds,extra",
    [
        (AT_TARGET, 1500, 400.0, EXTRA),  # the new time cap would have stopped it earlier
        (AT_TARGET, 600, 480.0, EXTRA),  # the new step cap likewise
        (AT_TARGET, 1500, 480.0, ["--target", "0.2", "--seed", "1"]),  # another seed
        ({**AT_TARGET, "stopped": "seconds"}, 1500, 500.0, EXTRA),  # a cap stopped it
    ],
)
def test_a_warm_up_is_trained_again_when_the_kept_one_is_not_what_was_asked(
    tmp_path: Path, summary: dict[str, Any], steps: int, seconds: float, extra: list[str]
) -> None:
    keep(tmp_path, summary)
    kept = json.loads((tmp_path / "warm.json").read_text())["want"]
    want = {**kept, "max_steps": steps, "cap_seconds": seconds, "args": extra}
    assert not _e2e_setup.warmup_reusable(kept, summary, want)
    assert _e2e_setup.warmup_reusable(kept, summary, kept)  # the same settings: always reused


def test_a_cap_stopped_warm_up_is_reused_under_the_same_caps(tmp_path: Path) -> None:
    summary = {**AT_TARGET, "stopped": "seconds", "seconds": 480.0}
    model, rows, out = keep(tmp_path, summary)
    assert _e2e_setup.run_warmup(model, rows, out, "cuda", 1500, 480.0, EXTRA) == summary
