"""tools/run_waits.py: a run's waits set against the arrival of the groups each step must train,
from a hand-built run directory (learner and server timelines, a server's recording)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from common.fileio import atomic_write_bytes  # noqa: E402
from common.rundir import RESOLVED_CONFIG_NAME  # noqa: E402
from common.timeline import (  # noqa: E402
    APPLY_SPAN,
    GRANT_EVENT,
    Role,
    TimelineWriter,
    Track,
    timeline_path,
)
from protocol.sender import encode_batch  # noqa: E402
from protocol.trajectory import Trajectory  # noqa: E402
from rollout_service.recording import batch_path, pack_batch_file  # noqa: E402
from tools import run_waits  # noqa: E402
from tools.timeline_read import read_timeline  # noqa: E402

T0 = 1_700_000_000.0
IDS = itertools.count()


def traj(group: str, version: int) -> Trajectory:
    n = 4
    return Trajectory(
        trajectory_id=f"{group}-{next(IDS)}",
        group_uid=group,
        prompt_ids=np.arange(3, dtype=np.int32),
        response_ids=np.arange(n, dtype=np.int32),
        response_mask=np.ones(n, np.uint8),
        rollout_logprobs=np.zeros(n, np.float32),
        versions=np.full(n, version, np.int32),
    )


def write_run(run: Path) -> None:
    """max_staleness 1. Steps of 1 s compute. Step 2 (version 1) waits 1.5 s for the last group
    started on 0; step 3 does not wait; step 4 waits 1.0 s though the last group started on 2 came
    0.3 s into its wait (it waited for something else)."""
    (run / RESOLVED_CONFIG_NAME).parent.mkdir(parents=True, exist_ok=True)
    (run / RESOLVED_CONFIG_NAME).write_text(
        "actor_rollout_ref:\n  rollout:\n    max_staleness: 1\n"
    )
    clock = lambda: T0  # noqa: E731
    learner = TimelineWriter(timeline_path(run, Role.LEARNER, "learner"), clock=clock)
    server = TimelineWriter(
        timeline_path(run, Role.ROLLOUT, "rs0"), role=Role.ROLLOUT, name="rs0", clock=clock
    )
    learner.instant(Track.ADMISSION, GRANT_EVENT, server="rs0", groups=3, min_version=0)
    t = T0
    for step, wait in ((1, 2.0), (2, 1.5), (3, 0.0), (4, 1.0)):
        learner.span(Track.STEP, "wait", t, t + wait, step=step)
        t += wait
        learner.span(Track.STEP, "prepare", t, t + 0.3, step=step)
        learner.span(Track.STEP, "update", t + 0.3, t + 0.9, step=step)
        learner.span(Track.STEP, "broadcast", t + 0.9, t + 1.0, step=step, version=step)
        t += 1.0
        server.span(Track.WEIGHTS, APPLY_SPAN, t + 0.1, t + 0.4, version=step, outcome="ok")
    learner.close()
    server.close()
    rec = run / "recordings" / "rs0"
    rec.mkdir(parents=True)
    batches = [
        (1.0, [("a", 0), ("b", 0)]),
        (4.0, [("d", 1)]),
        (4.5, [("c", 0)]),
        (5.0, [("e", 1)]),
        (6.8, [("f", 2)]),
        (8.0, [("g", 3)]),
    ]
    for i, (at, groups) in enumerate(batches, 1):
        trajs = [traj(g, v) for g, v in groups for _ in range(2)]
        frames = encode_batch(i, trajs)
        atomic_write_bytes(
            batch_path(rec, i),
            pack_batch_file(frames, server_id="rs0", seq=i, at=T0 + at),
            durable=False,
        )


def test_each_wait_is_set_against_the_wave_it_must_train(tmp_path: Path) -> None:
    write_run(tmp_path)
    out = run_waits.explain(
        read_timeline(tmp_path), run_waits.group_arrivals(tmp_path / "recordings"), 1
    )
    steps = {s["step"]: s for s in out["steps"]}
    assert [steps[s]["version"] for s in (1, 2, 3, 4)] == [0, 1, 2, 3]
    assert (steps[2]["wait_s"], steps[2]["late_s"], steps[2]["for_wave"]) == (1.5, 1.5, True)
    assert (steps[3]["wait_s"], steps[3]["late_s"], steps[3]["for_wave"]) == (0.0, 0.0, True)
    assert (steps[4]["wait_s"], steps[4]["late_s"], steps[4]["for_wave"]) == (1.0, 0.3, False)
    assert (out["waiting_steps"], out["waiting_steps_for_their_wave"]) == (2, 1)
    # wave 0 from the first grant, the others from the server's weight load
    assert out["waves"] == [
        {"version": 0, "G_s": 4.5, "budget_s": 3.0},
        {"version": 1, "G_s": 1.6, "budget_s": 2.1},
        {"version": 2, "G_s": 0.9, "budget_s": 0.6},
    ]


def test_the_command_reads_k_from_the_run_and_ends_with_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path)
    assert run_waits.main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["max_staleness"] == 1 and out["waiting_steps_for_their_wave"] == 1
    assert "waited for something else" in captured.err
