"""bench/e2e.py's async-vs-sync report: workload defaults, waste, wall-clock curves, the comparison
with the sync run (throughput and the reward criterion), length quantiles, episodes read from
recordings, and the reward plot. (The bench itself runs bin/train once per staleness: by hand.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
# bench/protocol.py must not shadow the protocol package: imported first
sys.path.insert(0, str(REPO))
from bench import _e2e_runs, _e2e_summary, _e2e_variants  # noqa: E402
from protocol.sender import encode_batch  # noqa: E402
from protocol.trajectory import Trajectory  # noqa: E402
from rollout_service.recording import batch_path, write_batch_file  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))

import e2e  # noqa: E402


def records(
    rewards: list[float],
    step_s: float,
    *,
    dropped: float = 0.0,
    waste: float | None = None,
    t0: float = 1000.0,
) -> list[dict[str, Any]]:
    out, t = [], t0
    for i, r in enumerate(rewards, 1):
        t += step_s
        rec = {
            "step": i,
            "time": t,
            "timing/step_s": step_s,
            "perf/tokens_per_s": 1000.0 / step_s,
            "reward/mean": r,
            "batch/trajectories": 16.0,
            "rollout/n": 4.0,
            "staleness/max": float(i % 3),
            "intake/dropped_stale_total": dropped * i,
        }
        if waste is not None:
            rec["rollout/waste_frac"] = waste
        out.append(rec)
    return out


def run(staleness: int, recs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "label": _e2e_variants.label(staleness),
        "max_staleness": staleness,
        "ok": True,
        **_e2e_summary.summarize(recs),
    }


def test_workload_defaults_and_labels() -> None:
    a = e2e.parse_args([])
    assert a.workload == "longtail" and a.staleness_values == [0, 1, 2, 4]
    assert a.config == REPO / "configs" / "longtail_e2e.yaml"
    e2e.apply_device_defaults(a, "cuda")
    assert (a.steps, a.timeout_s) == (10, 240.0)
    c = e2e.parse_args(["--workload", "calc", "--steps", "2"])
    assert c.staleness_values == [0, 2] and c.config == REPO / "configs" / "gpu_e2e.yaml"
    e2e.apply_device_defaults(c, "cpu")
    assert c.steps == 2 and c.warmup_steps == 500
    assert [_e2e_variants.label(s) for s in (0, 1, 4)] == ["sync", "async-s1", "async-s4"]
    with pytest.raises(SystemExit):
        e2e.parse_args(["--staleness", "1,1"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--gpus", "3"])


def test_waste_from_the_learner_or_from_intake_drops() -> None:
    w = _e2e_summary.waste(records([0.1] * 4, 1.0, waste=0.25))
    assert w["frac"] == 0.25 and w["source"] == "rollout/waste_frac"
    # 8 groups dropped, 4 steps x 4 groups trained
    w = _e2e_summary.waste(records([0.1] * 4, 1.0, dropped=2.0))
    assert (
        w["dropped_groups"] == 8.0
        and w["trained_groups"] == 16.0
        and w["frac"] == pytest.approx(8 / 24, abs=1e-4)
    )
    assert _e2e_summary.waste([]) == {}


def test_compare_throughput_and_reward_criterion() -> None:
    # final mean of 5: 0.4, 50 s after step 1
    sync = run(0, records([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 10.0))
    fast = run(2, records([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 4.0))
    slow = run(4, records([0.0] * 6, 5.0))
    assert sync["clock_curve"] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0] and sync["train_s"] == 50.0
    assert sync["staleness_max"] == 2.0
    c = _e2e_summary.compare([sync, fast, slow])
    assert c["throughput_vs_sync"]["async-s2"] == {
        "step_time_ratio": 2.5,
        "tokens_per_s_ratio": 2.5,
    }
    crit = c["reward_vs_sync"]
    assert crit["window"] == 5 and crit["sync_final_reward"] == 0.4 and crit["sync_total_s"] == 50.0
    assert crit["runs"]["async-s2"] == {"reach_step": 6, "reach_s": 20.0, "vs_sync_total": 0.4}
    assert crit["runs"]["async-s4"] == {"reach_step": None, "reach_s": None, "vs_sync_total": None}
    # a short sync run: the window shrinks to its length
    c = _e2e_summary.compare(
        [run(0, records([0.2, 0.4], 3.0)), run(1, records([0.5, 0.1, 0.2], 1.0))]
    )
    assert (
        c["reward_vs_sync"]["window"] == 2
        and c["reward_vs_sync"]["runs"]["async-s1"]["reach_step"] == 2
    )
    assert _e2e_summary.compare([fast]) == {}  # no sync run, nothing to compare with
    text = _e2e_summary.comparison_text(_e2e_summary.compare([sync, fast, slow]))
    assert (
        "async-s2: reaches it at step 6, 20.0 s (0.4 of sync's time)" in text
        and "async-s4: reaches it never" in text
    )


def test_variants_are_configurations_against_the_base_sync_run() -> None:
    a = e2e.parse_args(
        ["--staleness", "0,2", "--variant", "early:a.b=true c.d=1", "--variant", "off:a.b=false"]
    )
    names = [v.name for v in a.configs]
    assert names == ["", "early", "off"] and a.configs[1].overrides == ("a.b=true", "c.d=1")
    order = _e2e_variants.schedule(a.staleness_values, 2, a.configs)
    assert [(r, s, v.name) for r, s, v in order[:4]] == [
        (1, 0, ""),
        (1, 0, "early"),
        (1, 0, "off"),
        (1, 2, ""),
    ]
    assert len(order) == 12
    assert _e2e_variants.label(2, a.configs[1]) == "async-s2+early"
    assert _e2e_variants.label(0, a.configs[2]) == "sync+off"
    for bad in ("early", "Early:a=1", "early:", "early:novalue", "x" * 33 + ":a=1"):
        with pytest.raises(SystemExit):
            e2e.parse_args(["--variant", bad])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--variant", "v:a=1", "--variant", "v:a=2"])
    # the variant's overrides come last in bin/train's command: they win
    cmd = _e2e_runs.train_command(a, 2, ["a.b=base"], Path("/tmp/r"), a.configs[1].overrides)
    assert cmd[-2:] == ["a.b=true", "c.d=1"] and cmd.index("a.b=base") < cmd.index("a.b=true")
    # a variant's sync run is compared with the base sync run, never taken for it
    sync = run(0, records([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 10.0))
    sync_v = run(0, records([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 5.0)) | {
        "variant": "off",
        "label": "sync+off",
    }
    c = _e2e_summary.compare([sync_v, sync])
    assert c["throughput_vs_sync"] == {
        "sync+off": {"step_time_ratio": 2.0, "tokens_per_s_ratio": 2.0}
    }
    assert _e2e_variants.run_key(sync_v) == (1, 0, "off")
    assert _e2e_variants.run_key({"max_staleness": 2}) == (1, 2, "")


def test_quantiles_and_length_summary() -> None:
    q = _e2e_summary.quantiles([float(x) for x in range(1, 101)])
    assert (q["median"], q["p90"], q["p99"], q["max"]) == (50.5, 90.0, 99.0, 100.0)
    assert _e2e_summary.quantiles([]) == {}
    eps = [
        {
            "response_tokens": 10 * k,
            "model_tokens": 6 * k,
            "turns": k,
            "version": k % 2,
            "termination": "x",
            "reward": 1.0,
        }
        for k in range(1, 11)
    ]
    s = _e2e_summary.episode_lengths(eps)
    assert s["all"]["episodes"] == 10 and s["warmed_model"]["episodes"] == 5
    assert s["all"]["turns"]["max"] == 10 and s["all"]["terminations"] == {"x": 10}
    assert _e2e_summary.length_summary([]) == {"episodes": 0}


def test_read_episodes_from_recordings(tmp_path: Path) -> None:
    def traj(i: int, n: int, version: int) -> Trajectory:
        return Trajectory(
            trajectory_id=f"t{i}",
            group_uid="g",
            prompt_ids=np.arange(3, dtype=np.int32),
            response_ids=np.arange(n, dtype=np.int32),
            response_mask=np.array([1, 0] * (n // 2), np.uint8),
            rollout_logprobs=np.zeros(n, np.float32),
            versions=np.full(n, version, np.int32),
            reward=0.5,
            num_turns=n // 2,
            termination="no_tool_call",
        )

    server = tmp_path / "recordings" / "rs0"
    server.mkdir(parents=True)
    write_batch_file(
        batch_path(server, 1),
        encode_batch(1, [traj(0, 4, 0), traj(1, 8, 1)]),
        server_id="rs0",
        seq=1,
        durable=False,
    )
    eps = _e2e_summary.read_episodes(tmp_path / "recordings")
    assert [(e["response_tokens"], e["model_tokens"], e["turns"], e["version"]) for e in eps] == [
        (4, 2, 2, 0),
        (8, 4, 4, 1),
    ]
    assert _e2e_summary.read_episodes(tmp_path / "none") == []


def test_plot_writes_a_png(tmp_path: Path) -> None:
    sync, fast = run(0, records([0.1, 0.3, 0.2], 10.0)), run(1, records([0.1, 0.2, 0.4], 4.0))
    result = {
        "workload": "longtail",
        "device": "cpu",
        "shape": "tiny",
        "runs": [sync, fast],
        "comparison": _e2e_summary.compare([sync, fast]),
    }
    _e2e_summary.plot(tmp_path / "r.png", result)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
