#!/usr/bin/env python3
"""Why an async run waits for data: per-step waits at one learner GPU and one rollout server, and
the groups each wait is for, in the cluster simulator (``bench/clustersim``).

The simulator runs the project's own admission, buffer and server rule (``docs/simulate.md``).
The costs are those of the 2-H200 long-tail run (``--run``): its episode lengths, learner timers
and weight hand-over, and ``tau0`` calibrated on its sync run as ``bench/simulate.py`` does.
``--prepare-s`` / ``--update-s`` set the learner's step instead (the learner got faster since that
run), and ``--tau0-ms``, ``--apply-s``, ``--applied-s``, ``--servers`` and ``--learner-gpu-share``
(a server on the learner's GPU that generates while the learner waits) change generation, to see
which cost a wait comes from. ``--early-update`` has the learner train each step's first
mini-batch in its wait (``actor.first_mini_batch_in_waits``).

A group whose oldest token is version ``v`` must be trained by the step of version ``v + k``. So
for each step of version ``V`` the report compares the arrival of the last group started on
``V - k`` (the "wave" of ``V - k``) with the publish of ``V``, when that step could have started:
its lateness. The learner waits exactly that long when nothing else holds it back
(``max_wait_minus_lateness_s``, over the steps after the start-up, is 0); anything else (too few
groups: a throughput bound) shows as a difference. The wave had ``budget_s`` from its first start to that publish, and took ``G``.

    .venv/bin/python bench/sim_waits.py                                 # k = 1, 2, 4 (~1 min)
    .venv/bin/python bench/sim_waits.py --staleness 2 --prepare-s 0.45 --update-s 0.85 --waves

Text goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.clustersim.costs import GPU_DIR, GenCosts, WeightCosts, read_json, rollout_bound  # noqa: E402
from bench.clustersim.model import Setup, Simulation, summarize  # noqa: E402
from bench.simulate import DEFAULT_ROLLOUT, calibrate, load_runs, setup_for  # noqa: E402

RUN = GPU_DIR / "h200x2_bench_e2e_longtail_s0_s2.json"
WAITING_S = 0.1
"""A step counts as waiting when its wait is longer than this."""


def lateness(sim: Simulation) -> list[float]:
    """Per step: how long after the publish of its version ``V`` (when it could have started) the
    last group started on ``V - k`` arrived; 0 when it was there in time or there is none."""
    k = sim.setup.max_staleness
    out = []
    for version in range(len(sim.learner.steps)):  # step version + 1 trains version
        published = sim.learner.steps[version - 1].end if version else 0.0
        wave = sim.waves.get(version - k)
        out.append(max(0.0, wave.last_in - published) if wave is not None else 0.0)
    return out


def waves(sim: Simulation) -> list[dict[str, Any]]:
    """Per version ``v`` that groups started on: when, how long the last took (``G``), the time to
    the publish of ``v + k`` (``budget``) and the wait of the step of ``v + k``."""
    k = sim.setup.max_staleness
    steps = sim.learner.steps
    rows = []
    for v, w in sorted(sim.waves.items()):
        if v + k + 1 > len(steps) or v + k == 0:
            continue
        published = steps[v + k - 1].end
        rows.append(
            {
                "version": v,
                "started_s": round(w.started, 3),
                "last_in_s": round(w.last_in, 3),
                "groups": w.groups,
                "G_s": round(w.last_in - w.started, 3),
                "budget_s": round(published - w.started, 3),
                "step": v + k + 1,
                "wait_s": round(steps[v + k].wait_s, 3),
                "longest_tokens": w.longest_tokens,
            }
        )
    return rows


def gaps(waits: list[float]) -> Counter[int]:
    """How many steps apart consecutive waiting steps are."""
    idx = [i for i, w in enumerate(waits) if w > WAITING_S]
    return Counter(b - a for a, b in itertools.pairwise(idx))


def settled(k: int) -> int:
    """The steps before this one are the start-up: the first window, all granted on version 0,
    is still being worked off, and a step may also wait for the server to fill the buffer."""
    return 2 * (k + 1)


def run_k(setup: Setup, seeds: int) -> tuple[dict[str, Any], list[Simulation]]:
    k = setup.max_staleness
    sims = [Simulation(setup, seed).run() for seed in range(seeds)]
    s = summarize(sims)
    waits = [[r.wait_s for r in sim.learner.steps] for sim in sims]
    late = [lateness(sim) for sim in sims]
    period: Counter[int] = Counter()
    for w in waits:
        period.update(gaps(w[1:]))
    rows = [r for sim in sims for r in waves(sim)[1:]]  # the first wave is the start-up
    t = sum(sim.clock.now for sim in sims)
    return {
        "max_staleness": setup.max_staleness,
        "step_s": round(s.step_s, 3),
        "wait_s": round(s.wait_s, 3),
        "learner_s": round(s.learn_s, 3),
        "staleness_mean": round(s.staleness_mean, 3),
        "staleness_max": s.staleness_max,
        "waste_frac": round(s.waste_frac, 4),
        "waiting_steps_frac": round(
            float(np.mean([x > WAITING_S for w in waits for x in w[1:]])), 3
        ),
        "gaps_between_waiting_steps": dict(sorted(period.items())),
        "max_wait_minus_lateness_s": round(
            max(
                abs(a - b)
                for w, lt in zip(waits, late, strict=True)
                for a, b in zip(w[settled(k) :], lt[settled(k) :], strict=True)
            ),
            6,
        ),
        "wave_G_s": round(float(np.mean([r["G_s"] for r in rows])), 3) if rows else None,
        "wave_budget_s": round(float(np.mean([r["budget_s"] for r in rows])), 3) if rows else None,
        "waves_late_frac": round(float(np.mean([r["G_s"] > r["budget_s"] for r in rows])), 3)
        if rows
        else None,
        "engine_decoding_seqs": round(
            sum(e.decoding_seq_s for sim in sims for e in sim.engines) / t, 1
        ),
        "engine_paused_frac": round(
            sum(e.paused_s for sim in sims for e in sim.engines) / (t * setup.servers), 3
        ),
        "waits_seed0": [round(x, 2) for x in waits[0]],
    }, sims


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/sim_waits.py", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--run", type=Path, default=RUN, help="e2e JSON: lengths, learner, hand-over")
    p.add_argument("--staleness", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument(
        "--prepare-s", type=float, help="the learner's prepare per step (default: the run's)"
    )
    p.add_argument(
        "--update-s", type=float, help="the learner's update per step (default: the run's)"
    )
    p.add_argument(
        "--tau0-ms", type=float, help="decode step at low concurrency (default: calibrated)"
    )
    p.add_argument(
        "--apply-s", type=float, help="engine paused per weight reload (default: the run's)"
    )
    p.add_argument(
        "--applied-s", type=float, help="gather to generating on it (default: the run's)"
    )
    p.add_argument("--servers", type=int, default=1, help="rollout servers, each on its own GPU")
    p.add_argument(
        "--learner-gpu-share",
        type=float,
        help="add a server on the learner's GPU, at this share of its speed while the learner "
        "computes (full speed while it waits; the learner is not slowed: optimistic)",
    )
    p.add_argument(
        "--early-update",
        action="store_true",
        help="the learner trains a step's first mini-batch in its wait "
        "(actor.first_mini_batch_in_waits)",
    )
    p.add_argument("--waves", action="store_true", help="print the waves of seed 0")
    return p.parse_args(argv)


def base_setup(
    run: Path = RUN,
    *,
    tau0_s: float | None = None,
    prepare_s: float | None = None,
    update_s: float | None = None,
    apply_s: float | None = None,
    applied_s: float | None = None,
    servers: int = 1,
    learner_gpu_share: float | None = None,
) -> tuple[Setup, float]:
    """The setup of ``run``'s async run (its lengths, learner timers and weight hand-over; B, n and
    the concurrency cap from its config), with any of those costs replaced, and the tokens of its
    steps (what the learner's per-token costs are per). ``max_staleness`` and ``steps`` are set by
    the caller. ``tau0_s`` None: calibrated on the run's sync run. ``learner_gpu_share``: one more
    server, on the learner's GPU, running at that share of its speed while the learner computes
    (the learner is not slowed by it: an optimistic bound)."""
    d = read_json(run)
    runs, _settings, _shared = load_runs(run)
    base = next(r for r in runs if r.max_staleness > 0)  # the async run's timers
    bound = rollout_bound(DEFAULT_ROLLOUT, d.get("parameters"))
    tau0 = calibrate(run, bound, 8).tau0_s if tau0_s is None else tau0_s
    # the tokens of a step, as bench/clustersim/costs.py counts them: update tok/s x update time
    tokens = (
        base.learner.update_tokens_per_s * d["runs"][runs.index(base)]["means"]["timing/update_s"]
    )
    learner = base.learner
    if update_s is not None:
        learner = replace(learner, update_tokens_per_s=tokens / update_s)
    if prepare_s is not None:
        learner = replace(learner, prepare_s_per_token=prepare_s / tokens)
    weights = WeightCosts(
        applied_s=base.weights.applied_s if applied_s is None else applied_s,
        apply_s=base.weights.apply_s if apply_s is None else apply_s,
    )
    share = 1.0 if learner_gpu_share is None else learner_gpu_share
    setup = setup_for(
        replace(base, learner=learner, weights=weights),
        servers + (learner_gpu_share is not None),
        GenCosts(tau0, bound, share),
    )
    return replace(setup, on_learner_gpu=int(learner_gpu_share is not None)), tokens


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base, tokens = base_setup(
        args.run,
        tau0_s=None if args.tau0_ms is None else args.tau0_ms / 1e3,
        prepare_s=args.prepare_s,
        update_s=args.update_s,
        apply_s=args.apply_s,
        applied_s=args.applied_s,
        servers=args.servers,
        learner_gpu_share=args.learner_gpu_share,
    )
    _runs, settings, _shared = load_runs(args.run)
    lc, w, gen = base.learner, base.weights, base.gen
    learner = {
        "prepare_s": round(lc.prepare_s_per_token * tokens, 3),
        "update_s": round(tokens / lc.update_tokens_per_s, 3),
        "publish_s": lc.publish_s,
    }
    print(
        f"[sim_waits] {args.run.name}: tau0 {gen.tau0_s * 1e3:.2f} ms, bound {gen.max_tok_s:,.0f} "
        f"tok/s; learner prepare {learner['prepare_s']:.2f} s + update {learner['update_s']:.2f} s "
        f"+ publish {lc.publish_s:.2f} s a step; hand-over {w.applied_s:.2f} s (engine paused "
        f"{w.apply_s:.2f} s); {args.servers} server(s) on GPUs of their own"
        + (
            f" + 1 on the learner's GPU at {args.learner_gpu_share} while it computes"
            if args.learner_gpu_share is not None
            else ""
        ),
        file=sys.stderr,
    )
    base = replace(base, early_update=args.early_update)
    results = []
    for k in args.staleness:
        r, sims = run_k(replace(base, max_staleness=k, steps=args.steps), args.seeds)
        results.append(r)
        print(
            f"k={k}: step {r['step_s']:.2f} s, wait {r['wait_s']:.2f} s, {r['waiting_steps_frac']:.0%} "
            f"of steps wait, gaps {r['gaps_between_waiting_steps']}; waves: G {r['wave_G_s']} s vs "
            f"budget {r['wave_budget_s']} s, {r['waves_late_frac']} late; wait - lateness "
            f"{r['max_wait_minus_lateness_s']}; engine {r['engine_decoding_seqs']} seqs decoding, "
            f"paused {r['engine_paused_frac']:.0%}; staleness {r['staleness_mean']}/"
            f"{r['staleness_max']}, waste {r['waste_frac']}\n  waits (seed 0): "
            + " ".join(f"{x:.2f}" for x in r["waits_seed0"]),
            file=sys.stderr,
        )
        if args.waves:
            for row in waves(sims[0]):
                print(
                    f"  v{row['version']:<3d} started {row['started_s']:7.2f} last in "
                    f"{row['last_in_s']:7.2f}: G {row['G_s']:.2f} s, budget {row['budget_s']:.2f} s, "
                    f"longest {row['longest_tokens']} tokens -> step {row['step']} waited "
                    f"{row['wait_s']:.2f} s",
                    file=sys.stderr,
                )
    print(
        json.dumps(
            {
                "bench": "sim_waits",
                "run": args.run.name,
                "settings": {
                    **settings,
                    "servers": args.servers,
                    "learner_gpu_share": args.learner_gpu_share,
                },
                "tau0_s": gen.tau0_s,
                "max_tok_s": gen.max_tok_s,
                "learner": learner,
                "weights": {"applied_s": w.applied_s, "apply_s": w.apply_s},
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
