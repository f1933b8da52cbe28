"""Reading a finished run of bench/e2e.py and reporting on it: one run's figures (means over the
steps after the first, curves, waste, the episodes' lengths from its recordings), each async run
against the sync run, and the table, comparison text, reward plot and results JSON.

Design: nothing here starts a process; it reads what a run left (its per-step records, its
recordings) and writes only the plot and the results JSON. Step 1 pays the start-up, so the means
skip it (unless it is the only step) and wall-clock counts from its end; the last steps, which an
async run trains from groups admitted before and so waits for no generation, are skipped too
(``summarize``'s ``drain``). A figure that cannot be
computed is None or left out, never an exception, and a plot or results file that cannot be
written is reported on stderr, not a failed bench. ``progress`` is the bench's one clock: every
other bench/e2e.py module imports this one, so it lives here.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench._common import Progress, ratio
from bench._e2e_variants import is_base_sync
from rollout_service.recording import read_recording

progress = Progress("e2e")
"""Progress lines on stderr, for bench/e2e.py and its modules alike (its t0 is e2e.T0)."""
TIMINGS = (
    "timing/wait_s",
    "timing/prepare_s",
    "timing/update_s",
    "timing/broadcast_s",
    "timing/step_s",
    "perf/tokens_per_s",
)
EXTRA_MEANS = (
    "staleness/mean",
    "staleness/max",
    "intake/dropped_stale",
    "response/length_mean",
    "perf/update_tokens_per_s",
    "actor/entropy",
    "episode/turns_max",
    "rollout/waste_frac",
)
WASTE = "rollout/waste_frac"
"""The learner's share of generated tokens never trained (cumulative), where it logs it."""
REWARD_WINDOW = 5
"""Steps of the trailing mean in the reward criterion (sync's final reward: its last 5 steps)."""


def tokens_per_s(steps: list[dict[str, Any]]) -> float | None:
    """The steps' tokens over their time. Not the mean of each step's ``perf/tokens_per_s``: an
    async run alternates short steps and steps that wait for data, with about the same tokens, and
    that mean would count the short ones as the run's pace."""
    pairs = [
        (float(r["perf/tokens_per_s"]) * float(r["timing/step_s"]), float(r["timing/step_s"]))
        for r in steps
        if isinstance(r.get("perf/tokens_per_s"), (int, float))
        and isinstance(r.get("timing/step_s"), (int, float))
    ]
    seconds = sum(t for _, t in pairs)
    return round(sum(n for n, _ in pairs) / seconds, 4) if seconds > 0 else None


def summarize(records: list[dict[str, Any]], drain: int = 0) -> dict[str, Any]:
    """Means over the steps after the first but the last ``drain`` (all of them when too few are
    left), curves, weights/*.

    The last ``k`` steps of a run at ``max_staleness`` k train on groups admitted before: admission
    stops where the run's steps are covered, so those steps wait for no generation at all, which a
    long run's steady state does. The bench passes the largest ``max_staleness`` of its runs, so
    that every configuration is measured over the same steps."""
    out: dict[str, Any] = {"steps_done": len(records)}
    if not records:
        return out
    body = records[1 : len(records) - drain] or records[1:] or records
    out["mean_over_steps"] = [int(r["step"]) for r in body]

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in body if isinstance(r.get(key), (int, float))]
        return round(sum(vals) / len(vals), 4) if vals else None

    out["means"] = {k: mean(k) for k in (*TIMINGS, *EXTRA_MEANS)}
    out["means"]["perf/tokens_per_s"] = tokens_per_s(body)
    weight_keys = sorted({k for r in records for k in r if k.startswith("weights/")})
    out["weights"] = {k: mean(k) for k in weight_keys}
    out["step1"] = {
        k: (round(float(records[0][k]), 4) if k in records[0] else None) for k in TIMINGS
    }
    out["reward_curve"] = [round(float(r.get("reward/mean", float("nan"))), 4) for r in records]
    out["turns_curve"] = [
        round(float(r.get("episode/turns_mean", float("nan"))), 3) for r in records
    ]
    turns = [float(r["episode/turns_mean"]) for r in records if "episode/turns_mean" in r]
    out["turns_mean"] = round(sum(turns) / len(turns), 3) if turns else None
    maxima = [
        float(r["staleness/max"])
        for r in records
        if isinstance(r.get("staleness/max"), (int, float))
    ]
    out["staleness_max"] = max(maxima) if maxima else None
    out["waste"] = waste(records)
    if all(isinstance(r.get("time"), (int, float)) for r in records):
        # Wall-clock from the end of step 1: start-up and the first batch (on the first weights,
        # nothing ahead of it) cost every mode the same; what differs is what follows.
        out["clock_curve"] = [
            round(float(r["time"]) - float(records[0]["time"]), 2) for r in records
        ]
        out["train_s"] = out["clock_curve"][-1]
    return out


def waste(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The share of generation never trained, up to the last step: the learner's own
    ``rollout/waste_frac`` (tokens, counting groups dropped on the servers too) when it logs it,
    else the share of groups the intake dropped as stale (groups, not tokens; server-side drops
    unseen)."""
    if not records:
        return {}
    last = records[-1]
    logged = {
        k: round(float(v), 4)
        for k, v in last.items()
        if k.startswith("rollout/waste") and isinstance(v, (int, float))
    }
    if WASTE in logged:
        return {"frac": logged[WASTE], "source": WASTE, "last_step": logged}
    trained = sum(
        float(r.get("batch/trajectories", 0.0)) / max(float(r.get("rollout/n", 1.0)), 1.0)
        for r in records
    )
    if isinstance(last.get("intake/dropped_stale_total"), (int, float)):
        dropped = float(last["intake/dropped_stale_total"])
    else:
        dropped = sum(float(r.get("intake/dropped_stale", 0.0)) for r in records)
    total = dropped + trained
    return {
        "frac": round(dropped / total, 4) if total else None,
        "source": "intake/dropped_stale_total (groups)",
        "dropped_groups": dropped,
        "trained_groups": round(trained, 1),
    }


def quantiles(values: list[float]) -> dict[str, float | None]:
    """Median, p90, p99 (nearest rank), max and p99 / median of ``values``."""
    v = sorted(values)
    if not v:
        return {}

    def q(p: float) -> float:
        return v[max(0, min(len(v) - 1, math.ceil(p * len(v)) - 1))]

    med = statistics.median(v)
    return {
        "median": med,
        "p90": q(0.9),
        "p99": q(0.99),
        "max": v[-1],
        "p99_over_median": round(q(0.99) / med, 2) if med else None,
    }


def length_summary(episodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Distribution of response tokens (model + tool), model tokens and turns over ``episodes``."""
    if not episodes:
        return {"episodes": 0}
    terms: dict[str, int] = {}
    for e in episodes:
        terms[e["termination"]] = terms.get(e["termination"], 0) + 1
    return {
        "episodes": len(episodes),
        "response_tokens": quantiles([e["response_tokens"] for e in episodes]),
        "model_tokens": quantiles([e["model_tokens"] for e in episodes]),
        "turns": quantiles([e["turns"] for e in episodes]),
        "reward_mean": round(statistics.fmean(e["reward"] for e in episodes), 4),
        "terminations": dict(sorted(terms.items())),
    }


def read_episodes(recordings: Path) -> list[dict[str, Any]]:
    """Every episode the rollout servers shipped (rollout_server.record=true), trained or not."""
    if not recordings.is_dir():
        return []

    out = []
    for server in sorted(p for p in recordings.iterdir() if p.is_dir()):
        for _, trajectories in read_recording(server):
            for t in trajectories:
                out.append(
                    {
                        "response_tokens": len(t.response_ids),
                        "model_tokens": int(t.response_mask.sum()),
                        "turns": int(t.num_turns),
                        "version": int(t.versions.max()) if len(t.versions) else 0,
                        "termination": t.termination,
                        "reward": float(t.reward),
                    }
                )
    return out


def episode_lengths(episodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Lengths of all shipped episodes and of those the warmed model sampled alone (version 0)."""
    return {
        "all": length_summary(episodes),
        "warmed_model": length_summary([e for e in episodes if e["version"] == 0]),
    }


# ---------------------------------------------------------------- report


def fmt(v: Any, width: int = 9) -> str:
    if v is None:
        return "-".rjust(width)
    if isinstance(v, float):
        return (f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3f}").rjust(width)
    return str(v).rjust(width)


def table(runs: list[dict[str, Any]]) -> str:
    cols = [
        ("wait", "timing/wait_s"),
        ("prepare", "timing/prepare_s"),
        ("update", "timing/update_s"),
        ("bcast", "timing/broadcast_s"),
        ("step", "timing/step_s"),
        ("tok/s", "perf/tokens_per_s"),
        ("stale", "staleness/mean"),
        ("dropped", "intake/dropped_stale"),
    ]
    head = (
        "run            steps "
        + "".join(n.rjust(9) for n, _ in cols)
        + "".join(n.rjust(9) for n in ("st max", "waste", "turns", "GPU MiB"))
    )
    steps = next((r["mean_over_steps"] for r in runs if r.get("mean_over_steps")), None)
    window = f"{steps[0]}-{steps[-1]}" if steps else "2.."
    lines = [f"mean over steps {window} (seconds unless named):", head]
    for r in runs:
        means = r.get("means", {})
        name = f"{r.get('label', r['max_staleness'])} r{r.get('repeat', 1)}"
        row = f"{name:<13}  {r.get('steps_done', 0):>5} "
        row += "".join(fmt(means.get(k)) for _, k in cols)
        row += (
            fmt(r.get("staleness_max"))
            + fmt((r.get("waste") or {}).get("frac"))
            + fmt(r.get("turns_mean"))
            + fmt((r.get("gpu_memory") or {}).get("peak_gpu_mib"))
        )
        if not r.get("ok"):
            row += f"   FAILED: {r.get('error')}"
        lines.append(row)
    for r in runs:
        name = f"{r.get('label', r['max_staleness'])} r{r.get('repeat', 1)}"
        lines.append(
            f"{name}: reward {r.get('reward_curve')}  turns {r.get('turns_curve')}  "
            f"step 1 {fmt((r.get('step1') or {}).get('timing/step_s')).strip()} s, first step after "
            f"{r.get('first_step_after_s')} s, wall {r.get('wall_s')} s"
        )
        if r.get("clock_curve"):
            lines.append(f"{name}: seconds since the end of step 1 {r['clock_curve']}")
        for which, d in (r.get("lengths") or {}).items():
            if isinstance(d, dict) and d.get("episodes"):
                rt, tu = d["response_tokens"], d["turns"]
                lines.append(
                    f"{name}: {which} episodes {d['episodes']}: response tokens median {rt['median']:g} "
                    f"p90 {rt['p90']:g} p99 {rt['p99']:g} (p99/median {rt['p99_over_median']}), turns "
                    f"median {tu['median']:g} p90 {tu['p90']:g} p99 {tu['p99']:g}, reward {d['reward_mean']}"
                )
        if (wu := r.get("weight_updates") or {}).get("versions"):
            lines.append(
                f"{name}: weight update end to end vs bound (reload_weights + D2H, same "
                f"run): median {wu['median_applied_s']:.3f} s vs {wu['median_bound_s']:.3f} s, ratio "
                f"{wu['median_ratio']:.2f}; per version "
                + ", ".join(
                    f"v{x['version']} {x['applied_s']:.3f}/{x['bound_s']:.3f}"
                    for x in wu["versions"]
                )
            )
        if r.get("weights"):
            lines.append(
                f"{name}: "
                + "  ".join(
                    f"{k.removeprefix('weights/')} {fmt(v).strip()}"
                    for k, v in r["weights"].items()
                )
            )
    return "\n".join(lines)


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each other run against the base sync run (max_staleness 0, no variant): throughput (sync's mean step time / the run's,
    the run's tokens/s / sync's) and the reward criterion: when the run's trailing mean reward
    (REWARD_WINDOW steps) first reaches sync's final mean reward (its last REWARD_WINDOW steps), in
    seconds since the end of step 1, against sync's total time on the same clock."""
    sync = next((r for r in runs if is_base_sync(r) and r.get("steps_done")), None)
    if sync is None:
        return {}
    sm = sync.get("means", {})
    out: dict[str, Any] = {"throughput_vs_sync": {}}
    for r in runs:
        if r is sync or not r.get("steps_done"):
            continue
        m = r.get("means", {})
        out["throughput_vs_sync"][r["label"]] = {
            "step_time_ratio": ratio(sm.get("timing/step_s"), m.get("timing/step_s")),
            "tokens_per_s_ratio": ratio(m.get("perf/tokens_per_s"), sm.get("perf/tokens_per_s")),
        }
    rewards, clock = sync.get("reward_curve") or [], sync.get("clock_curve") or []
    finite = [x for x in rewards if not math.isnan(x)]
    if not finite or not clock:
        return out
    w = min(REWARD_WINDOW, len(finite))
    target = round(statistics.fmean(finite[-w:]), 4)
    crit: dict[str, Any] = {
        "window": w,
        "sync_final_reward": target,
        "sync_total_s": clock[-1],
        "runs": {},
    }
    for r in runs:
        if r is sync or not r.get("clock_curve"):
            continue
        reach = first_reach(r["reward_curve"], r["clock_curve"], w, target)
        crit["runs"][r["label"]] = reach | {"vs_sync_total": ratio(reach.get("reach_s"), clock[-1])}
    out["reward_vs_sync"] = crit
    return out


def first_reach(
    rewards: list[float], clock: list[float], window: int, target: float
) -> dict[str, Any]:
    """The first step whose trailing mean reward over ``window`` steps is >= ``target``."""
    for i in range(window - 1, len(rewards)):
        vals = [x for x in rewards[i - window + 1 : i + 1] if not math.isnan(x)]
        if vals and statistics.fmean(vals) >= target:
            return {"reach_step": i + 1, "reach_s": clock[i]}
    return {"reach_step": None, "reach_s": None}


def trailing(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        vals = [x for x in values[max(0, i - window + 1) : i + 1] if not math.isnan(x)]
        out.append(statistics.fmean(vals) if vals else float("nan"))
    return out


def plot(path: Path, result: dict[str, Any]) -> None:
    """The reward of every run against wall-clock (since the end of step 1) in one PNG: each step's
    mean reward (dots) and its trailing mean (line), one colour per configuration (its repeats
    alike); sync's final mean reward dashed (the median over its repeats)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5.5))
        colours: dict[str, str] = {}
        for r in result["runs"]:
            xs, ys = r.get("clock_curve"), r.get("reward_curve")
            if not xs or not ys:
                continue
            first = r["label"] not in colours
            colour = colours.setdefault(r["label"], f"C{len(colours) % 10}")
            ax.plot(
                xs,
                trailing(ys, REWARD_WINDOW),
                lw=2 if first else 1.2,
                color=colour,
                label=f"{r['label']} (mean of {REWARD_WINDOW})" if first else None,
            )
            ax.plot(xs, ys, "o", ms=3.5, alpha=0.6, color=colour)
        sync = ((result.get("summary") or {}).get("configurations") or {}).get("sync")
        target = sync["figures"]["final_reward"]["median"] if sync else None
        if target is not None:
            ax.axhline(target, ls="--", lw=1, color="grey", label=f"sync final reward {target:.3f}")
        ax.set_xlabel("wall-clock since the end of step 1 (s)")
        ax.set_ylabel("mean reward per step")
        ax.set_title(
            f"bench/e2e.py --workload {result.get('workload')}: {result.get('device')}, "
            f"{result.get('shape')}, {(result.get('placement') or {}).get('spec', '')}".rstrip(", ")
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        progress(f"plot: {path}")
    except Exception as e:  # the figures are in the JSON; a missing plot is not a failed bench
        progress(f"could not draw {path}: {type(e).__name__}: {e}")


def write_results(path: Path, result: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(result, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as e:
        progress(f"could not write {path}: {e}")


def comparison_text(c: dict[str, Any]) -> str:
    lines = []
    for name, t in c.get("throughput_vs_sync", {}).items():
        lines.append(
            f"{name} vs sync: step time x{t['step_time_ratio']} shorter, tokens/s x{t['tokens_per_s_ratio']}"
        )
    if crit := c.get("reward_vs_sync"):
        lines.append(
            f"sync: final mean reward {crit['sync_final_reward']} (last {crit['window']} steps), "
            f"{crit['sync_total_s']} s after step 1"
        )
        for name, x in crit["runs"].items():
            when = (
                f"at step {x['reach_step']}, {x['reach_s']} s ({x['vs_sync_total']} of sync's time)"
                if x.get("reach_s") is not None
                else "never"
            )
            lines.append(f"{name}: reaches it {when}")
    return "\n".join(lines)
