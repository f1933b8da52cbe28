"""bench/update_pause.py's summary: each kind against the rounds without updates, and the seconds
of generation an update costs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import update_pause


def test_an_update_costs_the_rounds_time_beyond_the_bound_over_its_updates() -> None:
    part = {k: 0.1 for k in update_pause.PARTS} | {"continued_cached": 0.9}
    rounds = {
        "none": [(1000.0, 0), (800.0, 0), (1200.0, 0)],  # bound: 1000 tokens/s
        "prefetch": [(500.0, 4), (800.0, 2)],  # 2 s for 1,000 tokens, 1 s lost; then 0.25 s
        "direct": [(1000.0, 3)],
        "file": [(250.0, 0)],  # no update landed: no cost to share
        "recompute": [(400.0, 3)],
    }
    pauses = {k: [part] * sum(n for _, n in v) for k, v in rounds.items()}
    out = update_pause.summarize(rounds, pauses, tokens=1000)
    assert out["none"] == {"tok_s_median": 1000}
    assert out["prefetch"]["ratios"] == [0.5, 0.8]
    assert out["prefetch"]["lost_s_per_update_rounds"] == pytest.approx([0.25, 0.125])
    assert out["direct"]["lost_s_per_update"] == 0.0
    assert out["file"]["lost_s_per_update"] is None and out["file"]["updates"] == 0
    assert out["recompute"]["lost_s_per_update"] == pytest.approx(0.5)
    assert out["recompute"]["continued_cached"] == 0.9
