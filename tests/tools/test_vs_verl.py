"""bench/vs_verl.py's pieces that need no GPU: the parquet it writes for verl reads back through our
own verl layout as the same rows, the verl plugins give our tool's and reward's answers, and verl's
per-step metrics are summarised as the report expects. The GPU run itself is bench/vs_verl.py's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import vs_verl  # noqa: E402


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
    paths = vs_verl.write_verl_data(src, tmp_path / "verl")
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
    assert (
        compute_score("longtail", "4800", "4800") == 0.0
    )  # no box: no fallback to the last number
    assert compute_score("longtail", "\\boxed{4801}", "4800") == 0.0


def test_verl_metrics_summary() -> None:
    recs = [
        {
            "step": s,
            "timing_s/step": t,
            "timing_s/gen": g,
            "perf/total_num_tokens": 1000.0,
            "critic/score/mean": r,
        }
        for s, t, g, r in ((1, 30.0, 20.0, 0.1), (2, 10.0, 6.0, 0.2), (3, 12.0, 8.0, 0.4))
    ]
    out = vs_verl.summarize_verl(recs)
    assert out["steps_done"] == 3
    assert out["split_s"]["step"] == 11.0 and out["split_s"]["generate"] == 7.0
    assert out["clock_curve"] == [0.0, 10.0, 22.0]  # seconds since the end of step 1
    assert out["tokens_per_s"] == round((100.0 + 1000 / 12) / 2, 1)


def test_two_gpus_reach_both_sides_and_the_report(tmp_path: Path) -> None:
    a = vs_verl.parse_args(["--gpus", "2", "--work-dir", str(tmp_path)])
    assert "trainer.n_gpus_per_node=2" in vs_verl.verl_overrides(a, "/m", tmp_path)
    verl = {"label": "verl-sync", "gpus": 2, "steps_done": 3, "split_s": {"step": 20.0}}
    ours = {"label": "ours-sync", "gpus": 2, "steps_done": 3, "split_s": {"step": 5.0}}
    for stage, configs in (("verl", [verl]), ("ours", [ours])):
        (tmp_path / f"vs_verl-{stage}.json").write_text(json.dumps({"configs": configs}))
    out = vs_verl.report(tmp_path, None)
    assert out["gpus"] == 2 and out["caveats"][-1] == vs_verl.PLACEMENT[2]
    assert out["per_step_speedup_vs_verl_sync"]["ours-sync"]["verl_step_over_ours"] == 4.0
    with pytest.raises(SystemExit):
        vs_verl.parse_args(["--gpus", "3"])
