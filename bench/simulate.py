#!/usr/bin/env python3
"""A cluster-scale simulator: N rollout servers and a learner of W GPUs, in simulated time.

The discrete-event model is in ``bench/clustersim/model.py``. It runs the project's own policy code
(``learner.admission.Admission``, ``learner.buffer.GroupBuffer``, the rollout server's
``rollout_service.granting.GrantBook``, ``protocol.staleness.group_too_old``) on real
``Trajectory`` objects. It predicts the step time, the throughput, the staleness and the waste,
for sync (``max_staleness`` 0) and async, from 8 to 1,024 GPUs and for a chosen response-length
distribution. The costs come from the benches' JSON (``bench/clustersim/costs.py`` says which
figure comes from which file). It never reads a step time it is compared with.

1. Calibration, per machine. ``tau0`` is one decode step's latency at low concurrency, and no
   bench measures it for this model. It is set so that the simulated sync wait of a calibration
   run (``--calibrate``: the 5-step H100 run, the 1-server CPU run) matches that run's measured
   wait. On a GPU shared with the learner, the engine's share of it while the learner computes is
   set the same way from the calibration file's async run. The slope comes from
   ``bench/rollout.py``'s tok/s at its concurrency. A machine without a calibration file (the
   2-H200 run) calibrates on its own sync run. That row is marked ``calibration`` and is not
   counted, and its rows with the first machine's costs follow, marked ``cross-machine``.
2. Validation. Each run of the ``--validate`` and ``--cpu`` files is simulated with its own
   lengths, learner timers and weight hand-over, over ``--seeds`` seeds. The files are the three
   H100 long-tail files (``max_staleness`` 0, 1, 2, 4), the 2-H200 file and the 2-server CPU run
   in ``docs/sim/``. The table gives the measured and predicted step time and the % error.
3. Prediction. ``--gpus`` totals (default 8, 64, 512, 1024), with ``--learner-share`` of them
   training (FSDP, ``bench/learner.py``'s tok/s per GPU) and one rollout server per other GPU.
   Each server gets ``--groups-per-server`` prompt groups per step, and ``--gpus-per-host`` GPUs
   share a host. A version reaches the other hosts over ``--link-gbps`` links. With ``--fanout
   direct`` (today's code) the learner sends every remote server its own copy. With ``relay``
   (issue 19, item 1) one copy goes down a pipelined chain of hosts. Both are predicted by
   default. Lengths come from ``--lengths`` (an e2e JSON: its ``lengths_all``; default the
   long-tail workload of the 20-step H100 run), and ``--group-corr`` sets how alike the episodes
   of one prompt are.

Last line of stdout: one JSON object. Its ``ratio`` is the simulator's events/s over a bare heapq
event loop's, both measured in this run. ``validation_max_error_pct`` is the largest |error| on
step time (target <= 15).

    .venv/bin/python bench/simulate.py                # calibrate, validate, predict (~10 min)
    .venv/bin/python bench/simulate.py --skip-predict  # the error table only (~1.5 min)
    .venv/bin/python bench/simulate.py --skip-validate --calibrate --gpus 64,512 --fanout relay
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._e2e_setup import CPU_OVERRIDES, WORKLOADS  # noqa: E402
from bench.clustersim.costs import (  # noqa: E402
    GPU_DIR,
    GenCosts,
    LearnerCosts,
    Lengths,
    Quantiles,
    Run,
    e2e_runs,
    learner_tok_s,
    read_json,
    rollout_bound,
)
from bench.clustersim.model import Setup, Summary, simulate  # noqa: E402

SIM_DIR = ROOT / "docs" / "sim"
"""The CPU runs of bench/e2e.py and bench/rollout.py the simulator is checked against."""
DEFAULT_CALIBRATE = GPU_DIR / "h100_bench_e2e_longtail_default_learner.json"
DEFAULT_VALIDATE = [
    GPU_DIR / "h100_bench_e2e_longtail_20steps_s0_s2.json",
    GPU_DIR / "h100_bench_e2e_longtail_s0_s2.json",
    GPU_DIR / "h100_bench_e2e_longtail_s1_s4.json",
    GPU_DIR / "h200x2_bench_e2e_longtail_s0_s2.json",
]
CPU_CALIBRATE = SIM_DIR / "cpu_bench_e2e_longtail_1server_s0.json"
CPU_VALIDATE = SIM_DIR / "cpu_bench_e2e_longtail_2servers_s0_s2.json"
CPU_ROLLOUT = SIM_DIR / "cpu_bench_rollout.json"
DEFAULT_ROLLOUT = GPU_DIR / "h200_bench_rollout.json"
DEFAULT_LEARNER = GPU_DIR / "h200x2_bench_learner_longtail_w2_packed.json"
DEFAULT_LEARNER_RUN = GPU_DIR / "h200x2_bench_e2e_longtail_s0_s2.json"
SHARED_GPU_SHARE = 0.5
"""The engine's share of a GPU while the learner computes on it: two processes time-slicing one
GPU. This is an assumption, not a measurement. It matters only where they share one GPU."""


def progress(msg: str) -> None:
    print(f"[simulate] {msg}", file=sys.stderr, flush=True)


# -- what each e2e JSON ran -------------------------------------------------------------------------
def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    for k in path:
        cfg = cfg.setdefault(k, {})
    cfg[last] = value


def run_settings(d: dict[str, Any]) -> dict[str, int]:
    """Groups per step, episodes per group, the concurrency cap and the servers of an e2e JSON's
    runs: the config it names, then bench/e2e.py's own CPU overrides on the CPU, the servers of its
    placement, then the JSON's overrides (later ones win)."""

    cfg = yaml.safe_load((ROOT / "configs" / Path(d["config"]).name).read_text())
    overrides: list[str] = []
    if d.get("device") == "cpu":
        overrides += CPU_OVERRIDES + WORKLOADS[d.get("workload", "longtail")].cpu_overrides
    if placement := d.get("placement"):  # --placement (older JSONs: launch.* in the overrides)
        overrides.append(f"launch.rollout_servers={placement['rollout_servers']}")
    overrides += d.get("overrides", [])
    for o in overrides:
        key, _, value = o.partition("=")
        _set(cfg, key, yaml.safe_load(value))
    return {
        "batch_groups": int(cfg["data"]["train_batch_size"]),
        "n": int(cfg["actor_rollout_ref"]["rollout"]["n"]),
        "max_concurrent_episodes": int(cfg["rollout_server"]["max_concurrent_episodes"]),
        "servers": int(cfg.get("launch", {}).get("rollout_servers", 1)),
    }


def load_runs(path: Path) -> tuple[list[Run], dict[str, int], bool]:
    d = read_json(path)
    s = run_settings(d)
    runs = e2e_runs(
        path,
        batch_groups=s["batch_groups"],
        n=s["n"],
        max_concurrent_episodes=s["max_concurrent_episodes"],
    )
    shared = d.get("device") == "cpu" or d.get("gpus_used") == "one shared GPU"
    return [replace(r, shared_gpu=shared) for r in runs], s, shared


def setup_for(run: Run, servers: int, gen: GenCosts) -> Setup:
    return Setup(
        servers=servers,
        learner_gpus=1,
        batch_groups=run.batch_groups,
        n=run.n,
        max_staleness=run.max_staleness,
        steps=run.steps,
        max_concurrent_episodes=run.max_concurrent_episodes,
        lengths=run.lengths,
        gen=gen,
        learner=run.learner,
        weights=run.weights,
        shared_gpu=run.shared_gpu,
    )


# -- calibration and validation ---------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    machine: str
    tau0_s: float
    max_tok_s: float
    share: float
    source: str

    def gen(self) -> GenCosts:
        return GenCosts(self.tau0_s, self.max_tok_s, self.share)


def machine_of(d: dict[str, Any]) -> str:
    """The machine an e2e JSON ran on: the device (GPU model or cpu) and the placement."""
    if d.get("device") == "cpu":
        return "cpu"
    gpu = d["gpus"][0].split(",")[1].strip() if d.get("gpus") else "gpu"
    return f"{gpu} ({d.get('gpus_used', '?')})"


def _bisect(f: Any, lo: float, hi: float, *, log: bool, iters: int = 22) -> float:
    """The x in [lo, hi] where the increasing function f crosses 0."""
    for _ in range(iters):
        mid = math.sqrt(lo * hi) if log else (lo + hi) / 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi) if log else (lo + hi) / 2


def calibrate(path: Path, max_tok_s: float, seeds: int) -> Calibration:
    """A machine's two generation costs without a bench of their own, from one run file: ``tau0``
    so that the simulated wait of its sync run is the measured one (the wait grows with tau0),
    then, on a GPU shared with the learner, the engine's share of it while the learner computes,
    so that the wait of its first async run is the measured one (the wait shrinks as it grows; no
    async run: ``SHARED_GPU_SHARE``)."""
    runs, s, shared = load_runs(path)
    sync = next(r for r in runs if r.max_staleness == 0)
    asyncs = [r for r in runs if r.max_staleness > 0]
    share = SHARED_GPU_SHARE if shared else 1.0

    def wait(run: Run, tau0: float, share: float) -> float:
        return simulate(
            setup_for(run, s["servers"], GenCosts(tau0, max_tok_s, share)), seeds
        ).wait_s

    tau0 = _bisect(lambda t: wait(sync, t, share) - sync.measured["wait_s"], 1e-5, 0.2, log=True)
    if shared and asyncs:
        a = asyncs[0]
        share = _bisect(
            lambda x: a.measured["wait_s"] - wait(a, tau0, x), 0.05, 1.0, log=False, iters=10
        )
    return Calibration(machine_of(read_json(path)), tau0, max_tok_s, share, path.name)


def _row(
    run: Run, servers: int, p: Summary, role: str, calib: Calibration, dt: float
) -> dict[str, Any]:
    m = run.measured
    return {
        "run": run.name,
        "role": role,
        "calibration": calib.source,
        "servers": servers,
        "max_staleness": run.max_staleness,
        "shared_gpu": run.shared_gpu,
        "measured_step_s": round(m["step_s"], 3),
        "predicted_step_s": round(p.step_s, 3),
        "error_pct": round(100 * (p.step_s - m["step_s"]) / m["step_s"], 1),
        "measured_wait_s": round(m["wait_s"], 3),
        "predicted_wait_s": round(p.wait_s, 3),
        "measured_tokens_per_s": round(m["tokens_per_s"]),
        "predicted_tokens_per_s": round(p.tokens_per_s),
        "measured_staleness": round(m["staleness_mean"], 2),
        "predicted_staleness": round(p.staleness_mean, 2),
        "measured_waste": m["waste_frac"],
        "predicted_waste": round(p.waste_frac, 4),
        "sim_s": round(dt, 2),
    }


def validate(
    files: list[Path], calibs: dict[str, Calibration], bound: Any, seeds: int
) -> list[dict[str, Any]]:
    """One row per run of ``files``. A file of a machine with a calibration run is validated
    whole. A file of another machine calibrates on itself: its sync row is then the calibration
    (role ``calibration``) and only its async rows are validated; the rows with the costs of the
    first calibrated machine follow (role ``cross-machine``)."""
    rows = []
    for path in files:
        d = read_json(path)
        runs, s, shared = load_runs(path)
        machine = machine_of(d)
        todo: list[tuple[Calibration, str]] = []
        if machine in calibs:
            todo.append((calibs[machine], "validation"))
        else:
            own = calibrate(path, bound(d), max(4, seeds // 2))
            calibs[machine] = own
            todo.append((own, "self"))
            other = next(
                (c for c in calibs.values() if c.machine != machine and c.machine != "cpu"), None
            )
            if other is not None and machine != "cpu":
                todo.append((replace(other, share=other.share if shared else 1.0), "cross-machine"))
        for calib, role in todo:
            for run in runs:
                r = role
                if role == "self":
                    r = "calibration" if run.max_staleness == 0 else "validation"
                t0 = time.perf_counter()
                p = simulate(setup_for(run, s["servers"], calib.gen()), seeds)
                rows.append(_row(run, s["servers"], p, r, calib, time.perf_counter() - t0))
    return rows


# -- prediction -------------------------------------------------------------------------------------
def transfer_fn(
    *, servers: int, learner_gpus: int, per_host: int, model_bytes: float, gbps: float, fanout: str
) -> Any:
    """Extra time for a version to reach server ``i`` beyond the same-host hand-over. Servers on a
    learner host get the file. With ``direct`` (what the code does today for remote servers) the
    learner sends every remote server its own copy, one after the other through its link. With
    ``relay`` one copy goes down a chain of hosts, pipelined in 64 MB chunks, and each host hands
    it to its servers through the file."""
    one = model_bytes * 8 / (gbps * 1e9)
    chunk = min(model_bytes, 64e6) * 8 / (gbps * 1e9)
    learner_hosts = math.ceil(learner_gpus / per_host)
    local = max(0, learner_hosts * per_host - learner_gpus)  # servers on a learner host

    def extra(i: int) -> float:
        if i < local:
            return 0.0
        if fanout == "direct":
            return (i - local + 1) * one
        hop = (learner_gpus + i) // per_host - learner_hosts + 1  # 1: the first remote host
        return one + (hop - 1) * chunk

    return extra


def predict(args: argparse.Namespace, gen: GenCosts) -> list[dict[str, Any]]:
    lengths_json = read_json(args.lengths)
    la = lengths_json["lengths_all"]
    base_run = e2e_runs(args.lengths)[0]
    lengths = Lengths(
        turns=Quantiles.from_json(la["turns"], int(la["episodes"])),
        model_tokens=Quantiles.from_json(la["model_tokens"], int(la["episodes"])),
        response_tokens=Quantiles.from_json(la["response_tokens"], int(la["episodes"])),
        prompt_tokens=base_run.lengths.prompt_tokens,
        group_corr=args.group_corr,
    )
    lrun = e2e_runs(args.learner_run)[0]  # the learner's prepare cost and weight hand-over
    per_gpu = learner_tok_s(args.learner_bench)
    learner = LearnerCosts(lrun.learner.prepare_s_per_token, per_gpu, lrun.learner.publish_s)
    model_bytes = float(read_json(args.rollout)["update_0_5b"]["bytes"])
    rows = []
    for total in args.gpus:
        w = max(1, round(total * args.learner_share))
        servers = total - w
        for fanout, k in itertools.product(args.fanout, args.staleness):
            setup = Setup(
                servers=servers,
                learner_gpus=w,
                batch_groups=args.groups_per_server * servers,
                n=args.n,
                max_staleness=k,
                steps=args.predict_steps,
                max_concurrent_episodes=args.max_concurrent,
                lengths=lengths,
                gen=gen,
                learner=learner,
                weights=lrun.weights,
                transfer_s=transfer_fn(
                    servers=servers,
                    learner_gpus=w,
                    per_host=args.gpus_per_host,
                    model_bytes=model_bytes,
                    gbps=args.link_gbps,
                    fanout=fanout,
                ),
            )
            t0 = time.perf_counter()
            p = simulate(setup, seeds=args.predict_seeds)
            dt = time.perf_counter() - t0
            rows.append({**_prediction_row(total, w, servers, k, setup, p, dt), "fanout": fanout})
            progress(
                f"{total:5d} GPUs (learner {w}, servers {servers}) {fanout} max_staleness {k}: "
                f"step {p.step_s:.2f} s, {p.tokens_per_s:,.0f} tok/s, staleness "
                f"{p.staleness_mean:.2f}, waste {p.waste_frac:.3f} ({dt:.1f} s)"
            )
    by = {(r["gpus"], r["fanout"], r["max_staleness"]): r for r in rows}
    for r in rows:
        sync = by.get((r["gpus"], r["fanout"], 0))
        if sync is not None:
            r["vs_sync_step"] = round(sync["step_s"] / r["step_s"], 2)
    return rows


def _prediction_row(
    total: int, w: int, servers: int, k: int, setup: Setup, p: Summary, dt: float
) -> dict[str, Any]:
    return {
        "gpus": total,
        "learner_gpus": w,
        "servers": servers,
        "batch_groups": setup.batch_groups,
        "max_staleness": k,
        "step_s": round(p.step_s, 3),
        "wait_s": round(p.wait_s, 3),
        "learner_s": round(p.learn_s, 3),
        "tokens_per_s": round(p.tokens_per_s),
        "staleness_mean": round(p.staleness_mean, 3),
        "staleness_max": p.staleness_max,
        "waste_frac": round(p.waste_frac, 4),
        "sim_events": p.events,
        "sim_s": round(dt, 2),
    }


# -- the bound: a bare event loop -------------------------------------------------------------------
def bare_events_per_s(n: int = 300_000) -> float:
    """heapq push + pop + a no-op call per event: what any Python event loop pays at least."""
    heap: list[tuple[float, int, Any]] = []
    noop = lambda: None  # noqa: E731
    t0 = time.perf_counter()
    for i in range(n):
        heapq.heappush(heap, (i * 0.37 % 1.0, i, noop))
    while heap:
        heapq.heappop(heap)[2]()
    return n / (time.perf_counter() - t0)


# -- the command ------------------------------------------------------------------------------------
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/simulate.py", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument(
        "--calibrate",
        type=Path,
        nargs="*",
        default=[p for p in (DEFAULT_CALIBRATE, CPU_CALIBRATE) if p.exists()],
        help="e2e JSONs: one per machine (default: the 5-step H100 run and the 1-server CPU run)",
    )
    p.add_argument(
        "--validate",
        type=Path,
        nargs="*",
        default=DEFAULT_VALIDATE,
        help="e2e JSONs to compare with",
    )
    p.add_argument(
        "--cpu",
        type=Path,
        nargs="*",
        default=[CPU_VALIDATE] if CPU_VALIDATE.exists() else [],
        help="CPU e2e JSONs to compare with (default: the 2-server CPU run)",
    )
    p.add_argument(
        "--rollout", type=Path, default=DEFAULT_ROLLOUT, help="bench/rollout.py JSON (GPU)"
    )
    p.add_argument(
        "--cpu-rollout",
        type=Path,
        default=CPU_ROLLOUT if CPU_ROLLOUT.exists() else None,
        help="bench/rollout.py JSON (CPU)",
    )
    p.add_argument(
        "--learner-bench", type=Path, default=DEFAULT_LEARNER, help="bench/learner.py JSON"
    )
    p.add_argument(
        "--learner-run", type=Path, default=DEFAULT_LEARNER_RUN, help="e2e JSON: prepare, hand-over"
    )
    p.add_argument(
        "--lengths", type=Path, default=DEFAULT_VALIDATE[0], help="e2e JSON: lengths_all"
    )
    p.add_argument("--group-corr", type=float, default=0.0, help="correlation of a group's lengths")
    p.add_argument("--seeds", type=int, default=16, help="simulations per validated run")
    p.add_argument("--gpus", type=_ints, default=[8, 64, 512, 1024], help="GPU totals to predict")
    p.add_argument(
        "--staleness", type=_ints, default=[0, 2], help="max_staleness values to predict"
    )
    p.add_argument("--learner-share", type=float, default=0.5, help="share of the GPUs that train")
    p.add_argument(
        "--groups-per-server", type=int, default=16, help="prompt groups per server and step"
    )
    p.add_argument("--n", type=int, default=8, help="episodes per prompt group")
    p.add_argument("--max-concurrent", type=int, default=256, help="episodes per server at once")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--link-gbps", type=float, default=100.0, help="network link per host (Gbit/s)")
    p.add_argument(
        "--fanout",
        type=lambda v: v.split(","),
        default=["direct", "relay"],
        help="weights to remote servers: direct (a copy each, today), relay (a chain of hosts)",
    )
    p.add_argument(
        "--predict-steps", type=int, default=5, help="steps per prediction (1 is start-up)"
    )
    p.add_argument("--predict-seeds", type=int, default=1)
    p.add_argument(
        "--tool-latency-s", type=float, default=0.0, help="predictions: seconds per tool call"
    )
    p.add_argument("--skip-predict", action="store_true")
    p.add_argument("--skip-validate", action="store_true", help="predictions only")
    return p.parse_args(argv)


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'run':52s} {'role':13s} {'srv':>3s} {'k':>2s} {'measured':>9s} {'predicted':>9s} {'error':>7s}   wait meas/pred   stale meas/pred"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['run']:52s} {r['role']:13s} {r['servers']:3d} {r['max_staleness']:2d} {r['measured_step_s']:9.2f} "
            f"{r['predicted_step_s']:9.2f} {r['error_pct']:+6.1f}%   {r['measured_wait_s']:5.2f} / "
            f"{r['predicted_wait_s']:5.2f}     {r['measured_staleness']:4.2f} / {r['predicted_staleness']:4.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()

    def bound(d: dict[str, Any]) -> float:
        path = args.cpu_rollout if d.get("device") == "cpu" else args.rollout
        if path is None:
            raise SystemExit("a CPU run needs --cpu-rollout (a bench/rollout.py JSON of the CPU)")
        return rollout_bound(path, d.get("parameters"))

    calibs: dict[str, Calibration] = {}
    for path in args.calibrate:
        d = read_json(path)
        c = calibrate(path, bound(d), max(4, args.seeds // 2))
        calibs[c.machine] = c
        progress(
            f"{c.machine}: tau0 {c.tau0_s * 1e3:.2f} ms per decode step, engine share while the "
            f"learner computes {c.share:.2f} (from {path.name}), bound {c.max_tok_s:,.0f} tok/s"
        )
    rows: list[dict[str, Any]] = []
    if args.skip_validate:  # predictions only: the prediction machine's calibration, nothing else
        d = read_json(args.learner_run)
        if machine_of(d) not in calibs:
            c = calibrate(args.learner_run, bound(d), max(4, args.seeds // 2))
            calibs[c.machine] = c
    else:
        rows = validate([*args.validate, *args.cpu], calibs, bound, args.seeds)
        print(table(rows), file=sys.stderr)
    validated = [r for r in rows if r["role"] == "validation"]
    worst = max((abs(r["error_pct"]) for r in validated), default=float("nan"))
    if validated:
        progress(
            f"largest |error| on step time over {len(validated)} validated runs: {worst:.1f}% "
            "(target 15%)"
        )
    preds: list[dict[str, Any]] = []
    if not args.skip_predict:
        machine = machine_of(read_json(args.learner_run))
        gen = replace(calibs[machine].gen(), tool_latency_s=args.tool_latency_s)
        preds = predict(args, gen)
    sim_events = sum(p["sim_events"] for p in preds)
    sim_time = sum(p["sim_s"] for p in preds)
    bare = bare_events_per_s()
    sim_rate = sim_events / sim_time if sim_time else 0.0
    out = {
        "bench": "simulate",
        "inputs": {
            "max_tok_s": f"{args.rollout.name} (GPU), {getattr(args.cpu_rollout, 'name', None)} (CPU): "
            "throughput.engine_tok_s x the bench model's parameters / the run model's",
            "tau0_s, share": "the calibration files' sync wait (and shared-GPU async wait); "
            "never a validated run",
            "lengths": "each run's lengths.all (turns, model tokens, response tokens)",
            "learner": "each run's timing/prepare_s, perf/update_tokens_per_s, weights/publish_s",
            "weights": "each run's weights/applied_s and weights/apply_s",
            "settings": "the run's config file + bench/e2e.py's CPU overrides + its overrides",
            "prediction": f"{args.learner_bench.name}: update_tok_s / world; {args.learner_run.name} "
            f"(sync): prepare per token, publish_s, applied_s, apply_s, tau0; {args.rollout.name}: "
            f"model bytes; {args.lengths.name}: lengths_all",
        },
        "calibrations": [dataclasses.asdict(c) for c in calibs.values()],
        "validation": rows,
        "validation_max_error_pct": worst,
        "validation_target_pct": 15.0,
        "predictions": preds,
        "prediction_settings": {
            "learner_share": args.learner_share,
            "groups_per_server": args.groups_per_server,
            "n": args.n,
            "gpus_per_host": args.gpus_per_host,
            "link_gbps": args.link_gbps,
            "fanout": args.fanout,
            "group_corr": args.group_corr,
            "steps": args.predict_steps,
        },
        "sim_events_per_s": round(sim_rate),
        "bare_events_per_s": round(bare),
        "ratio": round(sim_rate / bare, 4) if sim_time else None,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
