"""bench/vs_verl.py's pieces that need no GPU: the parquet it writes for verl reads back through our
own verl layout as the same rows, the verl plugins give our tool's and reward's answers, and verl's
per-step metrics are summarised as the report expects. The GPU run itself is bench/vs_verl.py's."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import verl_side, vs_verl  # noqa: E402
from bench import vs_verl_report as reporting  # noqa: E402
from bench._verl_data import write_verl_data  # noqa: E402


def test_verl_parquet_reads_back_as_our_rows(tmp_path: Path) -> None:
    from rollout_service.data import load_rows

    src = tmp_path / "src"
    src.mkdir()
    rows = [
        {"question": "Number 6402, step - 801.", "answer": "4800", "data_source": "longtail"},
        {"question": "Number 4608, step + 399.", "answer": "7800", "data_source": "longtail"},
    ]
    for split in ("train", "val"):
        (src / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = write_verl_data(src, tmp_path / "verl")
    back = load_rows(paths["train"])
    assert [r["question"] for r in back] == [r["question"] for r in rows]
    assert [str(r["answer"]) for r in back] == ["4800", "7800"]


def test_verl_plugins_answer_as_ours() -> None:
    pytest.importorskip("verl.tools.function_tool")
    from rollout_service.tools.calculator import Calculator

    spec = importlib.util.spec_from_file_location(
        "vs_verl_calc", ROOT / "bench/verl_plugins/calculator_tool.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from verl.tools.function_tool import FUNCTION_TOOL_REGISTRY

    tool = FUNCTION_TOOL_REGISTRY["calculator"]
    assert tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) == Calculator().schema
    assert mod.calculate("6402 - 801") == "5601"
    assert mod.calculate("import os").startswith("Error: ")

    from bench.verl_plugins.reward import compute_score

    assert (
        compute_score("longtail", "<tool_response>4800</tool_response> \\boxed{4800}", "4800")
        == 1.0
    )
    # no box: no fallback to the last number
    assert compute_score("longtail", "4800", "4800") == 0.0
    assert compute_score("longtail", "\\boxed{4801}", "4800") == 0.0


def test_verl_metrics_summary_per_version() -> None:
    """Records stamped as they appeared; a version's records merge; a step's wall-clock is the
    time between two versions; step 1 (start-up) is left out of the means."""
    g = verl_side.TRAINED
    recs = [
        {"t": 90.0, "step": 0, "data": {"fully_async/rollouter/version_time": 3.0}},  # no training
        {"t": 100.0, "step": 1, "data": {g: 1, "timing_s/gen": 20.0, "critic/score/mean": 0.1}},
        {"t": 110.0, "step": 2, "data": {g: 2, "timing_s/gen": 6.0, "critic/score/mean": 0.2}},
        {"t": 110.5, "step": 2, "data": {"perf/total_num_tokens": 1050.0}},
        {
            "t": 122.5,
            "step": 3,
            "data": {g: 3, "timing_s/gen": 8.0, "perf/total_num_tokens": 1200.0},
        },
        {"t": 123.0, "step": "x", "data": {}},
    ]
    out = verl_side.summarize(recs)
    assert out["steps_done"] == 3
    assert out["step_s_each"] == [10.5, 12.0]
    assert out["split_s"]["step"] == 11.25 and out["split_s"]["generate"] == 7.0
    assert out["clock_curve"] == [0.0, 10.5, 22.5]
    assert out["tokens_per_s"] == 100.0
    assert out["reward_curve"][:2] == [0.1, 0.2]


def test_v1_records_give_memory_and_separate_async_times_its_wait() -> None:
    """The stamped records of a real V1 sync run (docs/gpu): V1 logs the actor's memory under
    ``actor/perf/``; read as separate_async's, its ``timing_s/gen`` is the trainer's wait for
    samples, not generation."""
    path = ROOT / "docs/gpu/h200x2_vs_verl_v1sync_fair_stamped.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    out = verl_side.summarize(recs)
    assert out["verl_memory_gb"]["allocated"] > 1.0
    assert out["split_s"]["generate"] > 0 and "wait" not in out["split_s"]
    sep = verl_side.verl_config("separate-async-s2", 2)
    out = verl_side.summarize(recs, sep.timings)
    assert "generate" not in out["split_s"] and out["split_s"]["wait"] > 0
    g = verl_side.TRAINED
    stale = "training/off_policy/trajectory_staleness/max"
    recs = [{"t": float(i), "step": i, "data": {g: i, stale: float(i % 3)}} for i in range(1, 5)]
    assert verl_side.summarize(recs)["trajectory_staleness"] == {"max": 1.0}  # steps 2-4: 2, 0, 1


def test_fully_async_run_on_4_gpus_summarized_from_its_records() -> None:
    """The stamped records of a real verl fully-async run (docs/gpu, 4 H200s): the rollouter's own
    step-0 record is not a version, so the 10 trained versions give 9 walls of ~10 s."""
    path = ROOT / "docs/gpu/h200x4_vs_verl_fully_async_t1_stamped.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    out = verl_side.summarize(recs)
    assert out["steps_done"] == 10 and len(out["step_s_each"]) == 9
    assert 9.0 < out["split_s"]["step"] < 11.5
    assert all(r == r for r in out["reward_curve"])  # every version has its reward (no NaN)


def test_ours_configurations_name_the_placement() -> None:
    """bench/e2e.py's results (a real 4-GPU run, docs/gpu) in the report's terms: each run names
    the results' placement, though a run itself carries only the spec string."""
    e2e = json.loads((ROOT / "docs/gpu/h200x4_bench_e2e_longtail_s0_s2.json").read_text())
    out = reporting.ours_configs(e2e)
    assert [c["label"] for c in out] == ["ours-sync", "ours-async-s2"] * 2
    assert {c["placement"] for c in out} == {e2e["placement"]["description"]}
    assert all(c["split_s"]["step"] > 0 for c in out)


def test_ours_stage_passes_the_variants_to_e2e(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []

    def bounded(cmd: list[str], *_: Any) -> dict[str, Any]:
        seen.append(cmd)
        return {"exit_status": 0}

    monkeypatch.setattr(vs_verl, "run_bounded", bounded)
    a = vs_verl.parse_args(
        ["--gpus", "2", "--staleness", "0,2", "--variant", "early:a.b=true", "--variant", "x:c=1"]
    )
    vs_verl.stage_ours(a, tmp_path)
    (cmd,) = seen
    assert cmd[cmd.index("--variant") :][:4] == [
        "--variant",
        "early:a.b=true",
        "--variant",
        "x:c=1",
    ]


def test_metrics_watcher_stamps_lines_as_they_appear(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    out = tmp_path / "stamped.jsonl"
    with verl_side.MetricsWatcher(path, interval=0.01, out=out) as w:
        with path.open("w") as f:
            f.write(json.dumps({"step": 1, "data": {"a": 1}}) + "\n" + '{"step": 2, "da')
            f.flush()
            time.sleep(0.1)
            f.write('ta": {"a": 2}}\nnot json\n')
    assert [(r["step"], r["data"]) for r in w.records] == [(1, {"a": 1}), (2, {"a": 2})]
    assert w.records[0]["t"] <= w.records[1]["t"]
    assert [json.loads(line) for line in out.read_text().splitlines()] == w.records


def test_verl_configurations() -> None:
    a = vs_verl.parse_args(["--gpus", "2", "--steps", "4"])
    sync = verl_side.overrides(verl_side.verl_config("sync", 2), a, "/m", Path("/w"))
    assert "trainer.n_gpus_per_node=2" in sync and "trainer.v1.trainer_mode=sync" in sync
    assert "actor_rollout_ref.actor.strategy=fsdp2" in sync
    assert f"actor_rollout_ref.model.external_lib={verl_side.WORKER_LIB}" in sync
    cfg = verl_side.verl_config("fully-async-t1", 2)
    fa = verl_side.overrides(cfg, a, "/m", Path("/w"))
    assert cfg.module.endswith("fully_async_main")
    assert {"trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"} <= set(fa)
    assert "async_training.staleness_threshold=1.0" in fa
    assert "rollout.total_rollout_steps=80" in fa  # (4 steps + the start-up one) x 16 prompts
    sep = verl_side.overrides(verl_side.verl_config("separate-async-s2", 2), a, "/m", Path("/w"))
    assert {"trainer.v1.trainer_mode=separate_async", "transfer_queue.enable=true"} <= set(sep)
    # our max_staleness 2: a span of 3 steps in verl's count, 2 batches generated ahead
    assert "trainer.v1.sampler.max_off_policy_threshold=3" in sep
    assert "trainer.v1.separate_async.num_warmup_batches=2" in sep
    bad_names = (
        ("fully-async-t-1", 2),
        ("async", 2),
        ("fully-async-t1", 1),
        ("separate-async-s1.5", 2),
    )
    for bad, gpus in bad_names:
        with pytest.raises(ValueError, match=r"sync|GPUs"):
            verl_side.verl_config(bad, gpus)


def test_report_against_the_best_sync_and_each_verl_run(tmp_path: Path) -> None:
    def cfg(label: str, side: str, step: float, tps: float, repeat: int = 1) -> dict:
        return {
            "label": label,
            "side": side,
            "repeat": repeat,
            "steps_done": 3,
            "split_s": {"step": step},
            "tokens_per_s": tps,
        }

    verl = [cfg("verl-sync", "verl", 8.0, 1000.0), cfg("verl-fully-async-t1", "verl", 5.0, 1600.0)]
    verl.append(cfg("verl-fully-async-t1", "verl", 6.0, 1400.0, repeat=2))

    def e2e_run(k: int, step: float, tps: float, repeat: int = 1, steps: int = 3) -> dict:
        """A run as bench/e2e.py's results hold it (the report reads ours from there)."""
        label = "sync" if k == 0 else f"async-s{k}"
        means = {"timing/step_s": step, "perf/tokens_per_s": tps}
        return {
            "label": label,
            "max_staleness": k,
            "repeat": repeat,
            "steps_done": steps,
            "means": means,
        }

    ours = [e2e_run(0, 6.0, 1300.0), e2e_run(2, 2.0, 4000.0)]
    ours += [e2e_run(2, 3.0, 3000.0, 2), e2e_run(2, 2.5, 3500.0, 3)]
    ours.append(e2e_run(1, 1.0, 9.0, steps=0))  # failed: not a figure
    for c in verl:
        path = tmp_path / f"vs_verl-verl-{c['label']}-r{c['repeat']}.json"
        path.write_text(json.dumps({"configs": [c]}))
    (tmp_path / "ours-e2e.json").write_text(json.dumps({"runs": ours}))
    out = vs_verl.report(tmp_path, None)
    assert out["best_sync"] == "ours-sync"
    s2 = out["configurations"]["ours-async-s2"]
    assert s2["repeats"] == 3 and s2["figures"]["step_s"]["median"] == 2.5
    assert out["configurations"]["ours-async-s1"] == out["configurations"]["ours-async-s1"] | {
        "repeats": 0,
        "failed": [1],
    }
    assert out["speedup_vs"]["best_sync"]["ours-async-s2"]["step_speedup"] == 2.4
    vs_fa = out["speedup_vs"]["verl-fully-async-t1"]["ours-async-s2"]
    assert vs_fa["step_speedup"] == 2.2  # median 5.5 / median 2.5
    assert vs_fa["step_speedup_range"] == [round(5.0 / 3.0, 3), 3.0]
    assert vs_fa["tokens_per_s_ratio"] == round(3500 / 1500, 3)
    assert "ours-async-s1" not in out["speedup_vs"]["best_sync"]
    # these runs predate the digest: one model, unknown, and no caveat about it
    assert list(out["models"]) == ["unknown"]
    assert not any("different warmed models" in c for c in out["caveats"])


def test_report_says_when_the_runs_trained_different_models(tmp_path: Path) -> None:
    verl = {"label": "verl-fully-async-t1", "side": "verl", "repeat": 1, "steps_done": 3}
    verl |= {"split_s": {"step": 5.0}, "tokens_per_s": 1.0, "model_sha256": "a" * 64}
    (tmp_path / "vs_verl-verl-verl-fully-async-t1-r1.json").write_text(
        json.dumps({"configs": [verl]})
    )
    run = {"label": "async-s2", "max_staleness": 2, "repeat": 1, "steps_done": 3}
    run["means"] = {"timing/step_s": 2.0, "perf/tokens_per_s": 2.0}
    e2e = {"runs": [run], "warmup": {"weights_sha256": "b" * 64}}
    (tmp_path / "ours-e2e.json").write_text(json.dumps(e2e))
    out = vs_verl.report(tmp_path, None)
    assert out["models"] == {"a" * 64: ["verl-fully-async-t1"], "b" * 64: ["ours-async-s2"]}
    assert out["caveats"][0].startswith("the runs trained 2 different warmed models")
    e2e["warmup"]["weights_sha256"] = "a" * 64  # the same model on both sides: no such caveat
    (tmp_path / "ours-e2e.json").write_text(json.dumps(e2e))
    out = vs_verl.report(tmp_path, None)
    assert list(out["models"]) == ["a" * 64]
    assert not any("different warmed models" in c for c in out["caveats"])


def test_report_pools_every_e2e_results_file_and_names_a_bad_one(tmp_path: Path) -> None:
    def e2e(staleness: int, *repeats: int) -> str:
        runs = [
            {"label": f"async-s{staleness}", "max_staleness": staleness, "repeat": r}
            | {"steps_done": 3, "means": {"timing/step_s": 1.0 + r, "perf/tokens_per_s": 9.0}}
            | {"clock_curve": [0.0, 1.0, 2.0], "reward_curve": [0.1, 0.2, 0.4]}
            for r in repeats
        ]
        return json.dumps({"runs": runs, "warmup": {"weights_sha256": "a" * 64}})

    (tmp_path / "ours-e2e.json").write_text(e2e(2, 1, 2))
    (tmp_path / "ours-e2e-s4.json").write_text(e2e(4, 1))
    # a timeline's trace shares the prefix and is no results file
    (tmp_path / "ours-e2e-async-s4-r1.timeline.trace.json").write_text("[]")
    out = vs_verl.report(tmp_path, tmp_path / "report.json")
    assert {k: c["repeats"] for k, c in out["configurations"].items()} == {
        "ours-async-s2": 2,
        "ours-async-s4": 1,
    }
    assert json.loads((tmp_path / "report.json").read_text())["models"] == {
        "a" * 64: list(out["configurations"])
    }
    assert reporting.plot(tmp_path / "curves.png", out["runs"], "t") is None  # and drawn:
    assert (tmp_path / "curves.png").stat().st_size > 0 and (tmp_path / "report.png").is_file()
    (tmp_path / "ours-e2e-again.json").write_text(e2e(2, 2))  # r2 of s2 a second time
    with pytest.raises(
        reporting.BadInput,
        match=r"ours-e2e-again.json and \S*ours-e2e.json both hold ours-async-s2 r2",
    ):
        vs_verl.report(tmp_path, None)
    (tmp_path / "ours-e2e-again.json").write_text('{"runs": [')  # cut while being written
    assert vs_verl.main(["--stage", "report", "--work-dir", str(tmp_path)]) == 2
    with pytest.raises(reporting.BadInput, match=r"ours-e2e-again.json: not a JSON file"):
        vs_verl.report(tmp_path, None)


def verl_record(repeat: int, steps_done: int, **extra: Any) -> dict[str, Any]:
    """One verl run's record as the verl stage writes it, reduced to what is read back."""
    rec = {"label": "verl-fully-async-t1", "side": "verl", "repeat": repeat, "wall_s": 400.0}
    return rec | {"steps_done": steps_done, "split_s": {"step": 5.0}, "tokens_per_s": 1.0} | extra


def test_a_run_cut_before_its_steps_is_no_repeat(tmp_path: Path) -> None:
    for r, done in ((1, 11), (2, 2)):  # the second cut by its limit after 2 of 10 versions
        path = tmp_path / f"vs_verl-verl-verl-fully-async-t1-r{r}.json"
        path.write_text(json.dumps({"configs": [verl_record(r, done, steps_asked=10)]}))
    ok = {"label": "async-s2", "max_staleness": 2, "repeat": 1, "steps_done": 3, "ok": True}
    ok["means"] = {"timing/step_s": 2.0, "perf/tokens_per_s": 2.0}
    failed = ok | {"repeat": 2, "ok": False}  # bench/e2e.py's verdict stands
    (tmp_path / "ours-e2e.json").write_text(json.dumps({"runs": [ok, failed]}))
    confs = vs_verl.report(tmp_path, None)["configurations"]
    assert (confs["verl-fully-async-t1"]["repeats"], confs["verl-fully-async-t1"]["failed"]) == (
        1,
        [2],
    )
    assert (confs["ours-async-s2"]["repeats"], confs["ours-async-s2"]["failed"]) == (1, [2])
    assert reporting.finished(verl_record(1, 9), asked=10) is False  # a record without the ask
    assert reporting.finished(verl_record(1, 9)) is True  # nothing to compare with


def test_verl_stage_brings_each_configuration_to_its_repeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[int, float]] = []

    def fake_run(a: Any, work: Path, prep: Any, cfg: Any, repeat: int, limit: float) -> dict:
        started.append((repeat, limit))
        return verl_record(repeat, 11, steps_asked=a.steps)

    monkeypatch.setattr(vs_verl, "check_plugin", lambda *a: {"ok": True, "varlen_kernel": True})
    monkeypatch.setattr(vs_verl, "run_verl", fake_run)
    # an earlier lease's finished run, and one cut short: one run is still owed for 2 repeats
    for r, done in ((1, 11), (2, 2)):
        path = tmp_path / f"vs_verl-verl-verl-fully-async-t1-r{r}.json"
        path.write_text(json.dumps({"configs": [verl_record(r, done, steps_asked=10)]}))
    argv = ["--stage", "verl", "--work-dir", str(tmp_path), "--gpus", "2"]
    argv += ["--verl", "fully-async-t1", "--steps", "10", "--timeout-s", "500"]
    a = vs_verl.parse_args([*argv, "--repeats", "2"])
    assert [r["repeat"] for r in vs_verl.stage_verl(a, tmp_path, {"model": "m"})] == [3]
    assert (
        started == [(3, 500.0)] and (tmp_path / "vs_verl-verl-verl-fully-async-t1-r3.json").exists()
    )
    assert vs_verl.stage_verl(a, tmp_path, {"model": "m"}) == []  # 2 reached their steps
    # a deadline shorter than a verl run starts none
    a = vs_verl.parse_args([*argv, "--repeats", "3", "--deadline-s", "300"])
    assert vs_verl.stage_verl(a, tmp_path, {"model": "m"}) == [] and len(started) == 1
    a = vs_verl.parse_args([*argv, "--repeats", "3", "--deadline-s", "460"])
    assert [r["repeat"] for r in vs_verl.stage_verl(a, tmp_path, {"model": "m"})] == [4]
    assert started[-1][1] <= 460.0


def test_placement_reaches_both_sides() -> None:
    a = vs_verl.parse_args(["--placement", "learner=0;rollout=0;rollout=1"])
    assert a.gpus == 2 and a.placement.spec == "learner=0;rollout=0;rollout=1"
    assert vs_verl.parse_args([]).placement.spec == "learner=0;rollout=0"
    for bad in (["--gpus", "3"], ["--placement", "rollout=0"], ["--gpus", "2", "--placement", "x"]):
        with pytest.raises(SystemExit):
            vs_verl.parse_args(bad)


def test_the_watcher_says_when_the_versions_asked_for_are_in(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    w = verl_side.MetricsWatcher(path)
    old = time.time() - 10
    w.records = [
        {"t": old, "step": 0, "data": {"fully_async/rollouter/active_time": 1.0}},
        {"t": old, "step": 1, "data": {verl_side.TRAINED: 1.0}},
        {"t": old, "step": 2, "data": {verl_side.TRAINED: 3.0}},
    ]
    assert w.has_versions(2) and not w.has_versions(3)  # the rollouter's step 0 is no version
    w.records.append({"t": time.time(), "step": 2, "data": {"timing_s/step": 1.0}})
    assert not w.has_versions(2)  # a record just came: the version may not be complete yet
    assert w.has_versions(2, settle_s=0.0)


@pytest.mark.integration
def test_a_run_is_stopped_once_done(tmp_path: Path) -> None:
    """verl's trainers do not exit after the versions asked for: the bench stops them then."""
    calls = []

    def done() -> bool:
        calls.append(time.monotonic())
        # done once the child is up: on a loaded machine its interpreter may take over a second
        # to start, and a run stopped before it printed leaves an empty log
        log = tmp_path / "log"
        return len(calls) >= 2 and log.is_file() and log.read_text().startswith("up")

    cmd = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]
    run = vs_verl.run_bounded(cmd, tmp_path / "log", 60, dict(os.environ), done=done)
    assert run["stopped_done"] and not run["timed_out"]
    assert run["wall_s"] < 30 and run["exit_status"] != 0
    assert (tmp_path / "log").read_text().startswith("up")
    bounded = vs_verl.run_bounded(cmd, tmp_path / "log2", 1.5, dict(os.environ))
    assert bounded["timed_out"] and not bounded["stopped_done"]
