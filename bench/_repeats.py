"""Figures over repeated runs: per configuration each figure's per-repeat values with their median,
min and max, and the headline ratios of every async configuration against sync.

Design: one run record per (repeat, configuration), as bench/e2e.py writes them (``label``,
``repeat``, ``ok``, ``means`` over steps 2.., ``waste``, ``staleness_max``, ``gpu_memory``,
``reward_curve``, ``reward_vs_sync``...). Only runs that finished all their steps count; the others
are listed, not averaged in. A headline ratio pairs sync and an async configuration within one
repeat (the runs were interleaved, so drift hits both alike), and reports:
- ``median``, ``min``, ``max``: over the per-repeat ratios (what the README shows);
- ``ratio_of_medians``: the ratio of the two configurations' median figures;
- ``pooled``: the ratio of the step-weighted means over every repeat (all the steps of all the
  repeats in one pool: a long run counts for its steps).
These agree when the repeats agree; when they do not, the spread says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

SYNC = "sync"
REWARD_WINDOW = 5
"""Steps of the final reward's mean (bench/e2e.py's criterion uses the same window)."""
Figure = Callable[[dict[str, Any]], float | None]


def _mean(key: str) -> Figure:
    return lambda run: (run.get("means") or {}).get(key)


def _final_reward(run: dict[str, Any]) -> float | None:
    curve = [x for x in run.get("reward_curve") or [] if x == x]  # NaN: a step without reward
    return round(statistics.fmean(curve[-REWARD_WINDOW:]), 4) if curve else None


FIGURES: dict[str, Figure] = {
    "wait_s": _mean("timing/wait_s"),
    "prepare_s": _mean("timing/prepare_s"),
    "update_s": _mean("timing/update_s"),
    "broadcast_s": _mean("timing/broadcast_s"),
    "step_s": _mean("timing/step_s"),
    "tokens_per_s": _mean("perf/tokens_per_s"),
    "staleness_mean": _mean("staleness/mean"),
    "staleness_max": lambda run: run.get("staleness_max"),
    "waste_frac": lambda run: (run.get("waste") or {}).get("frac"),
    "peak_gpu_mib": lambda run: (run.get("gpu_memory") or {}).get("peak_gpu_mib"),
    "final_reward": _final_reward,
    "train_s": lambda run: run.get("train_s"),
    "wall_s": lambda run: run.get("wall_s"),
    "reach_vs_sync_total": lambda run: (run.get("reward_vs_sync") or {}).get("vs_sync_total"),
}
"""Per run: the step's split and time, tokens/s, staleness, waste, peak GPU memory (MiB, summed
over the GPUs), the final reward (mean of the last REWARD_WINDOW steps), the training time after
step 1, the run's wall time, and when its trailing reward reached sync's final reward as a share
of sync's time (the reward criterion, against the sync run of the same repeat)."""


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """``values`` (None: no figure from that repeat) with median, min and max of the numbers, and
    the spread (max - min) relative to the median."""
    nums = [float(v) for v in values if isinstance(v, (int, float))]
    out: dict[str, Any] = {"values": list(values), "n": len(nums)}
    if not nums:
        return out | {"median": None, "min": None, "max": None, "rel_spread": None}
    med = statistics.median(nums)
    return out | {
        "median": round(med, 4),
        "min": round(min(nums), 4),
        "max": round(max(nums), 4),
        "rel_spread": round((max(nums) - min(nums)) / med, 3) if med else None,
    }


def ok_runs(runs: Sequence[dict[str, Any]], label: str) -> dict[int, dict[str, Any]]:
    """The finished runs of a configuration, by repeat."""
    return {int(r.get("repeat", 1)): r for r in runs if r.get("label") == label and r.get("ok")}


def labels(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The configurations in their first-run order."""
    return list(dict.fromkeys(str(r["label"]) for r in runs))


def configuration(runs: Sequence[dict[str, Any]], label: str) -> dict[str, Any]:
    """Every figure of one configuration over its finished repeats (in repeat order)."""
    done = ok_runs(runs, label)
    order = sorted(done)
    failed = sorted(
        int(r.get("repeat", 1)) for r in runs if r.get("label") == label and not r.get("ok")
    )
    return {
        "repeats": order,
        "failed_repeats": failed,
        "figures": {name: spread([f(done[k]) for k in order]) for name, f in FIGURES.items()},
    }


def _weighted(runs: Sequence[dict[str, Any]], figure: Figure) -> float | None:
    """The step-weighted mean of a per-run mean figure (weights: the steps it averages)."""
    num = den = 0.0
    for run in runs:
        value = figure(run)
        if isinstance(value, (int, float)):
            steps = len(run.get("mean_over_steps") or [1])
            num, den = num + float(value) * steps, den + steps
    return num / den if den else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def headline_ratio(
    sync: dict[int, dict[str, Any]],
    other: dict[int, dict[str, Any]],
    figure: Figure,
    *,
    inverse: bool,
) -> dict[str, Any]:
    """``figure`` of ``other`` against sync's, per repeat both finished: other / sync, or sync /
    other with ``inverse`` (step time: shorter is faster)."""
    both = sorted(set(sync) & set(other))

    def r(s: float | None, o: float | None) -> float | None:
        return _ratio(s, o) if inverse else _ratio(o, s)

    per = [r(figure(sync[k]), figure(other[k])) for k in both]
    out = spread(per) | {"repeats": both}
    med = [spread([figure(x[k]) for k in sorted(x)])["median"] for x in (sync, other)]
    pooled = [_weighted(list(x.values()), figure) for x in (sync, other)]
    return out | {"ratio_of_medians": r(*med), "pooled": r(*pooled)}


def summarize_repeats(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration its figures over the repeats, and per async configuration the headline
    ratios against sync: step time (sync's / its) and tokens/s (its / sync's)."""
    out: dict[str, Any] = {
        "configurations": {label: configuration(runs, label) for label in labels(runs)}
    }
    sync = ok_runs(runs, SYNC)
    if not sync:
        return out
    out["vs_sync"] = {
        label: {
            "step_time_ratio": headline_ratio(sync, other, FIGURES["step_s"], inverse=True),
            "tokens_per_s_ratio": headline_ratio(
                sync, other, FIGURES["tokens_per_s"], inverse=False
            ),
        }
        for label in labels(runs)
        if label != SYNC and (other := ok_runs(runs, label))
    }
    return out


def summary_text(summary: dict[str, Any]) -> str:
    """The headline ratios and the main figures in lines for stderr."""
    lines = []
    for label, c in summary.get("configurations", {}).items():
        f = c["figures"]
        parts = [
            f"{name} {f[name]['median']} [{f[name]['min']}, {f[name]['max']}]"
            for name in ("step_s", "tokens_per_s", "waste_frac", "peak_gpu_mib")
            if f[name]["median"] is not None
        ]
        fails = f", failed repeats {c['failed_repeats']}" if c["failed_repeats"] else ""
        lines.append(
            f"{label} ({len(c['repeats'])} repeats{fails}): median [min, max] " + ", ".join(parts)
        )
    for label, v in summary.get("vs_sync", {}).items():
        for name, x in v.items():
            lines.append(
                f"{label} vs sync {name}: median {x['median']} [{x['min']}, {x['max']}] over "
                f"{x['n']} repeats; ratio of medians {x['ratio_of_medians']}, pooled {x['pooled']}"
            )
    return "\n".join(lines)
