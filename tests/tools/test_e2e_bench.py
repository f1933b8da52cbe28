"""bench/e2e.py's pure parts: reading metrics.jsonl, the per-run summary, the refusal watch, the
argument checks, and tools/warmup.py's device choice on a machine without CUDA. (The whole bench
runs bin/train twice: too slow for the suite; run it by hand, see bench/README.md.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import _e2e_runs, _e2e_summary  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
import e2e  # noqa: E402


def test_read_metrics_and_summary(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    recs = [
        {
            "step": s,
            "timing/step_s": 10.0 if s == 1 else 2.0,
            "timing/wait_s": 1.0,
            "reward/mean": 0.1 * s,
            "episode/turns_mean": 1.5,
            "weights/applied_s": 0.5 * s,
        }
        for s in (1, 2, 3)
    ]
    lines = [json.dumps(r) for r in recs] + [
        json.dumps({"step": 0, "val/reward/mean": 0.2}),
        '{"step": 4, "tim',
    ]
    path.write_text("\n".join(lines))
    got = _e2e_runs.read_metrics(path)
    # the validation record and the half line are skipped
    assert [r["step"] for r in got] == [1, 2, 3]
    s = _e2e_summary.summarize(got)
    assert s["steps_done"] == 3 and s["mean_over_steps"] == [2, 3]
    assert s["means"]["timing/step_s"] == 2.0 and s["means"]["timing/prepare_s"] is None
    assert s["weights"] == {"weights/applied_s": 1.25} and s["step1"]["timing/step_s"] == 10.0
    assert s["reward_curve"] == [0.1, 0.2, 0.3] and s["turns_mean"] == 1.5
    assert _e2e_summary.summarize([]) == {"steps_done": 0}
    # tokens/s is the steps' tokens over their time: a 1 s step and a 9 s step of 9,000 tokens
    # each make 1,800 tokens/s, not the 5,500 of their per-step figures' mean
    paced = [
        {"step": 1},
        *({"step": t, "timing/step_s": t, "perf/tokens_per_s": 9000 / t} for t in (1, 9)),
    ]
    assert _e2e_summary.summarize(paced)["means"]["perf/tokens_per_s"] == 1800.0
    assert _e2e_summary.summarize(got[:1])["mean_over_steps"] == [1]  # one step: it is the mean
    assert "FAILED" in _e2e_summary.table([{"max_staleness": 0, "ok": False, "error": "x", **s}])


def test_the_last_steps_an_async_run_trains_from_groups_admitted_before_are_left_out() -> None:
    # max_staleness 2 over 8 steps: steps 7 and 8 take no generation (1 s each), the rest 3 s
    recs = [{"step": s, "timing/step_s": 1.0 if s > 6 else 3.0} for s in range(1, 9)]
    s = _e2e_summary.summarize(recs, drain=2)
    assert s["mean_over_steps"] == [2, 3, 4, 5, 6] and s["means"]["timing/step_s"] == 3.0
    assert _e2e_summary.summarize(recs)["means"]["timing/step_s"] == 2.4286
    assert "mean over steps 2-6 " in _e2e_summary.table([{"max_staleness": 2, "ok": True, **s}])
    # too few steps for the window: the steps after the first, as before
    assert _e2e_summary.summarize(recs[:3], drain=2)["mean_over_steps"] == [2, 3]


def test_the_window_leaves_out_as_many_steps_as_the_largest_staleness() -> None:
    from bench._e2e_args import parse_args

    assert parse_args(["--staleness", "4,0"], "").drain_steps == 4
    assert parse_args(["--staleness", "0"], "").drain_steps == 0
    assert parse_args(["--staleness", "2,0", "--drain-steps", "0"], "").drain_steps == 0


def test_refusal_watch(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    watch = _e2e_runs.RefusalWatch(log)
    assert not watch.poll()  # no file yet
    log.write_text(
        "ok\n" + "x [warning] invalid message error='token id outside'\n" * 2 + "invalid mess"
    )
    assert not watch.poll() and watch.count == 2 and "token id outside" in watch.first
    with log.open("a") as f:
        f.write("age again\n")
    assert not watch.poll() and watch.count == 3  # a whole line at last
    # what the learner writes once it stops logging each one: its count is of refusals
    with log.open("a") as f:
        f.write(
            "y [warning] suppressed 11 invalid messages [learner.intake] logged=5 suppressed=11\n"
        )
    assert watch.poll() and watch.count == 14 and "token id outside" in watch.first


def test_arguments() -> None:
    a = e2e.parse_args(["--staleness", "0,2", "--steps", "3", "trainer.seed=1"])
    assert a.staleness_values == [0, 2] and a.overrides == ["trainer.seed=1"]
    for bad in (["--staleness", "x"], ["--staleness", "-1"], ["--steps", "0"], ["notanoverride"]):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)


def test_warmup_refuses_cuda_without_a_gpu(tmp_path: Path) -> None:
    import torch

    from tools.warmup import warmup

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="cuda"):
        warmup(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "o", device="cuda")
    with pytest.raises(ValueError, match="device"):
        warmup(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "o", device="tpu")


def test_weight_updates_bound_counts_the_prefetch_and_the_slowest_server(tmp_path: Path) -> None:
    """The bound of a version's update is the slowest server's copy of the file onto the device
    (``prefetch_s``, 0 where it did not prefetch) plus its reload, plus the best device-to-host
    copy of the run; lines of other events and versions nobody applied are left out."""
    line = (
        "2026-11-29T04:25:26Z [info     ] weights applied  [rollout_service.server] check_s=0.0002 "
        "policy=keep prefetch_s={p} reload_s={r} seconds=0.5 server_id={s} version={v} via=file\n"
    )
    (tmp_path / "rollout-0.log").write_text(
        line.format(p=0.3, r=0.1, s="rs0", v=2)
        + "2026-11-29T04:25:27Z [info     ] weights received version=3 reload_s=9\n"
    )
    (tmp_path / "rollout-1.log").write_text(
        line.replace("prefetch_s={p} ", "").format(r=0.5, s="rs1", v=2)
    )
    records = [
        {"step": 1, "weights/copy_s": 0.05},
        {"step": 2, "weights/copy_s": 0.02, "weights/applied_s": 1.04, "weights/version": 2},
        {"step": 3, "weights/applied_s": 2.0, "weights/version": 3},
    ]
    out = _e2e_runs.weight_updates(records, tmp_path)
    (row,) = out["versions"]
    assert row["version"] == 2 and row["reload_s"] == pytest.approx(0.5)  # rs1: 0.5 > 0.3 + 0.1
    assert row["bound_s"] == pytest.approx(0.52) and row["ratio"] == pytest.approx(2.0)
