#!/usr/bin/env python3
"""What each wait of a run was for, from the run's own records: per learner step, its wait (the
timeline's ``wait`` span) against the arrival of the last group started ``k`` versions before it
(the rollout servers' recordings: each batch's time and its groups' oldest versions).

A group whose oldest token is version ``u`` must be in the step of version ``u + k``
(``learner/admission.py``). So the step of version ``V`` cannot start before the last group of
``V - k`` (its "wave") has arrived; ``late_s`` is how long after the step's wait began that was.
Where the wait is ``late_s`` (plus a batch's hand-over, milliseconds), the step waited for that
wave; where it is longer, for something else (too few groups: generation not keeping up). Per
wave: ``G_s``, from the first server running version ``u`` (its weight load; the first grant for
version 0) to the wave's last arrival, and ``budget_s``, from then to the start of the wait of the
step of ``u + k``. ``bench/sim_waits.py`` reports the same quantities from the simulator.

The run needs ``rollout_server.record: true`` (``bench/e2e.py`` sets it) and its timeline.

    .venv/bin/python tools/run_waits.py RUN_DIR                  # k from the run's resolved config
    .venv/bin/python tools/run_waits.py RUN_DIR --max-staleness 2

The table goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.rundir import RESOLVED_CONFIG_NAME  # noqa: E402
from common.timeline import APPLY_SPAN, GRANT_EVENT  # noqa: E402
from learner.buffer import oldest_version  # noqa: E402
from rollout_service.recording import read_recording  # noqa: E402
from tools.timeline_read import Timeline, read_timeline  # noqa: E402

HANDOVER_S = 0.05
"""A wait within this of ``late_s`` counts as the wait for that wave (shipping a batch and the
learner taking it in are milliseconds)."""


def group_arrivals(recordings: Path) -> list[tuple[float, int]]:
    """(time the batch was shipped, oldest version) of every group the servers recorded; groups
    without a response token are left out (they are never stale)."""
    out = []
    for server in sorted(p for p in recordings.iterdir() if p.is_dir()):
        for meta, trajectories in read_recording(server):
            groups: dict[str, list[int]] = {}
            for t in trajectories:
                v = oldest_version(t)
                if v is not None:
                    groups.setdefault(t.group_uid, []).append(v)
            out += [(meta.time, min(vs)) for vs in groups.values()]
    return sorted(out)


def max_staleness_of(run_dir: Path) -> int:
    cfg = yaml.safe_load((run_dir / RESOLVED_CONFIG_NAME).read_text())
    return int(cfg["actor_rollout_ref"]["rollout"]["max_staleness"])


def explain(tl: Timeline, arrivals: list[tuple[float, int]], k: int) -> dict[str, Any]:
    """Per step and per wave, as the module's docstring says."""
    learner = tl.learner
    if learner is None:
        raise ValueError("the timeline has no learner")
    waits = {r.args["step"]: r for r in learner.spans if r.name == "wait" and "step" in r.args}
    trained = {  # step -> the version it trained (broadcast spans carry the version after it)
        r.args["step"]: int(r.args["version"]) - 1
        for r in learner.spans
        if r.name == "broadcast" and "version" in r.args
    }
    grants = [r.time for r in learner.instants if r.name == GRANT_EVENT]
    running: dict[int, float] = {0: min(grants)} if grants else {}
    for server in tl.servers:
        for r in server.spans:
            if r.name == APPLY_SPAN and r.args.get("outcome") == "ok":
                v = int(r.args["version"])
                running[v] = min(running.get(v, float("inf")), r.time + r.dur)
    last_in: dict[int, float] = {}
    for t, v in arrivals:
        last_in[v] = max(last_in.get(v, t), t)
    start_of = {trained[s]: w.time for s, w in waits.items() if s in trained}

    steps = []
    for s in sorted(set(waits) & set(trained)):
        w, version = waits[s], trained[s]
        last = last_in.get(version - k)
        late = max(0.0, last - w.time) if last is not None else 0.0
        steps.append(
            {
                "step": s,
                "version": version,
                "wait_s": round(w.dur, 3),
                "late_s": round(late, 3),
                "for_wave": abs(w.dur - late) <= HANDOVER_S,
            }
        )
    waves = []
    for u in sorted(last_in):
        if u not in running or u + k not in start_of:
            continue
        waves.append(
            {
                "version": u,
                "G_s": round(last_in[u] - running[u], 3),
                "budget_s": round(start_of[u + k] - running[u], 3),
            }
        )
    later = [x for x in steps if x["step"] > 1]  # step 1 waits for the start-up
    return {
        "max_staleness": k,
        "steps": steps,
        "waves": waves,
        "wait_s": round(sum(x["wait_s"] for x in later) / len(later), 3) if later else None,
        "waiting_steps_for_their_wave": sum(
            x["wait_s"] > HANDOVER_S and x["for_wave"] for x in later
        ),
        "waiting_steps": sum(x["wait_s"] > HANDOVER_S for x in later),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tools/run_waits.py", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("--max-staleness", type=int, help="default: the run's resolved config")
    args = p.parse_args(argv)
    k = max_staleness_of(args.run_dir) if args.max_staleness is None else args.max_staleness
    out = explain(read_timeline(args.run_dir), group_arrivals(args.run_dir / "recordings"), k)
    for x in out["steps"]:
        print(
            f"step {x['step']:3d} (version {x['version']}): waited {x['wait_s']:6.2f} s; the last "
            f"group started on {x['version'] - k} came {x['late_s']:6.2f} s into the wait"
            + ("" if x["for_wave"] else "  <- waited for something else"),
            file=sys.stderr,
        )
    for w in out["waves"]:
        print(
            f"wave {w['version']:3d}: G {w['G_s']:6.2f} s, budget {w['budget_s']:6.2f} s"
            + ("  late" if w["G_s"] > w["budget_s"] else ""),
            file=sys.stderr,
        )
    print(
        f"{out['waiting_steps_for_their_wave']} of {out['waiting_steps']} waiting steps (after "
        f"step 1) waited for the groups started {k} versions before; mean wait {out['wait_s']} s",
        file=sys.stderr,
    )
    print(json.dumps({"tool": "run_waits", "run_dir": str(args.run_dir), **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
