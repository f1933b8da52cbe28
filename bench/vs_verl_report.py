"""bench/vs_verl.py's report: every run of both sides in a work directory, grouped by configuration,
with medians over the repeats and the speed-ups that README and docs quote.

Design: a run is one dict per configuration and repeat (``label``, ``side``, ``repeat``,
``split_s``, ``tokens_per_s``, ...), written by the verl stage (``vs_verl-verl-LABEL-rN.json``) or
read from bench/e2e.py's results (ours). A configuration's figure is the median over its repeats
that finished, with min and max (`bench._repeats.spread`). A speed-up of configuration C over a
base B is the ratio of their medians (B's step time / C's, C's tokens/s / B's), and its range
runs from the least to the most favourable pairing of their repeats. The base of the headline is
the best synchronous trainer of either side (the lowest median step time among SYNC_LABELS).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench._common import ratio
from bench._repeats import spread

SYNC_LABELS = ("ours-sync", "verl-sync", "verl-v0-sync")
REWARD_WINDOW = 5
SPLIT_KEYS = (
    "wait",
    "generate",
    "old_log_prob",
    "ref",
    "prepare",
    "update",
    "broadcast",
    "weights",
)


OUR_TIMINGS = {
    "timing/wait_s": "wait",
    "timing/prepare_s": "prepare",
    "timing/update_s": "update",
    "timing/broadcast_s": "broadcast",
    "timing/step_s": "step",
}


class BadInput(ValueError):
    """A file of the work directory that the report cannot use; the message names it."""


def load(path: Path) -> dict[str, Any] | None:
    """The JSON object at ``path``, or None where there is no file; BadInput names a file that
    is not one (a run cut while writing it, a file put there by hand)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: not a JSON file the report can read ({e})") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path}: holds a JSON {type(data).__name__}, not an object")
    return data


def e2e_results(work: Path) -> list[Path]:
    """bench/e2e.py's result files of ``work``: ``ours-e2e.json`` and any ``ours-e2e-NAME.json``
    beside it (a call for other staleness settings, or another lease's), not their timelines'
    trace files, which share the prefix."""
    return sorted(p for p in work.glob("ours-e2e*.json") if not p.name.endswith(".trace.json"))


def load_runs(work: Path) -> list[dict[str, Any]]:
    """Every run of ``work``: verl's, one file each, then ours from every file of `e2e_results`.
    Two files holding the same configuration and repeat are refused: e2e numbers the repeats of
    one results file, so the report could not tell which run is which."""
    verl = [
        c
        for f in sorted(work.glob("vs_verl-verl-*.json"))
        for c in (load(f) or {}).get("configs", [])
    ]
    ours: list[dict[str, Any]] = []
    seen: dict[tuple[str, int], Path] = {}
    for f in e2e_results(work):
        for run in ours_configs(load(f) or {}):
            key = (run["label"], run["repeat"])
            if key in seen:
                raise BadInput(
                    f"{seen[key]} and {f} both hold {key[0]} r{key[1]}: keep one, or "
                    "put one call's runs into the other's results with bench/e2e.py --resume"
                )
            seen[key] = f
            ours.append(run)
    return verl + ours


def ours_configs(e2e: dict[str, Any]) -> list[dict[str, Any]]:
    """bench/e2e.py's results, one report configuration per run."""
    where = (e2e.get("placement") or {}).get("description")  # a run names only its spec
    model = (e2e.get("warmup") or {}).get("weights_sha256")
    return [our_run(r, where) | {"model_sha256": model} for r in e2e.get("runs", [])]


def our_run(r: dict[str, Any], placement: str | None) -> dict[str, Any]:
    """One run of bench/e2e.py's results in the report's terms; ``placement`` is the results'
    description of it (each run carries only the spec string)."""
    m = r.get("means", {})
    memory = r.get("gpu_memory") or {}
    return {
        "label": "ours-" + r["label"],
        "side": "ours",
        "repeat": r.get("repeat", 1),
        "ok": r.get("ok"),
        "placement": placement or r.get("placement"),
        "max_staleness": r["max_staleness"],
        "exit_status": r.get("exit_status"),
        "timed_out": r.get("timed_out"),
        "wall_s": r.get("wall_s"),
        "steps_done": r.get("steps_done"),
        "split_s": {n: m[k] for k, n in OUR_TIMINGS.items() if m.get(k) is not None},
        "tokens_per_s": m.get("perf/tokens_per_s"),
        "response_length_mean": m.get("response/length_mean"),
        "reward_curve": r.get("reward_curve"),
        "clock_curve": r.get("clock_curve"),
        "waste": r.get("waste"),
        "staleness_max": r.get("staleness_max"),
        "peak_gpu_mib": memory.get("peak_gpu_mib"),
        "timeline": r.get("timeline"),
    }


def finished(run: dict[str, Any], asked: int | None = None) -> bool:
    """Whether ``run`` is a figure: it timed steps, bench/e2e.py did not fail it (ours: ``ok``),
    and a verl run reached the versions it was asked for (``steps_asked``, or ``asked`` for a
    record from before it was kept). A verl run cut by its limit after 2 of 10 versions is not."""
    if not run.get("steps_done") or not (run.get("split_s") or {}).get("step"):
        return False
    if run.get("ok") is False:
        return False
    want = run.get("steps_asked", asked)
    return want is None or run["steps_done"] >= want


def configurations(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per label (in order of first appearance): side, placement, the repeats that finished and
    those that did not, and each figure's `spread` over the finished ones."""
    out: dict[str, dict[str, Any]] = {}
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]
        done = [r for r in mine if finished(r)]
        figures = {
            "step_s": spread([r["split_s"]["step"] for r in done]),
            "tokens_per_s": spread([r.get("tokens_per_s") for r in done]),
            "peak_gpu_mib": spread([r.get("peak_gpu_mib") for r in done]),
        }
        for key in SPLIT_KEYS:
            values = [r["split_s"].get(key) for r in done]
            if any(v is not None for v in values):
                figures[f"split_{key}_s"] = spread(values)
        out[label] = {
            "side": mine[0].get("side"),
            "placement": mine[0].get("placement"),
            "staleness": mine[0].get("staleness", mine[0].get("max_staleness")),
            "repeats": len(done),
            "failed": [r.get("repeat", 1) for r in mine if not finished(r)],
            "figures": figures,
        }
    return out


def speedup(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``other`` against ``base``: step time and tokens/s as ratios of medians, with their range."""
    bs, os_ = base["figures"]["step_s"], other["figures"]["step_s"]
    bt, ot = base["figures"]["tokens_per_s"], other["figures"]["tokens_per_s"]
    return {
        "step_speedup": ratio(bs["median"], os_["median"]),
        "step_speedup_range": [ratio(bs["min"], os_["max"]), ratio(bs["max"], os_["min"])],
        "tokens_per_s_ratio": ratio(ot["median"], bt["median"]),
        "tokens_per_s_ratio_range": [ratio(ot["min"], bt["max"]), ratio(ot["max"], bt["min"])],
    }


def models(runs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The warmed models the runs trained (their weights' digest, ``unknown`` where a run predates
    it), each with the configurations that ran on it."""
    out: dict[str, list[str]] = {}
    for r in runs:
        labels = out.setdefault(str(r.get("model_sha256") or "unknown"), [])
        if r["label"] not in labels:
            labels.append(r["label"])
    return out


def report(work: Path, caveats: list[str]) -> dict[str, Any]:
    """The whole report of ``work`` (see the module docstring)."""
    runs = load_runs(work)
    on = models(runs)
    if len(on) > 1:  # a GPU warm-up that is not repeatable gives each lease its own model
        caveats = [
            f"the runs trained {len(on)} different warmed models, so their ratios mix models: "
            + "; ".join(f"{d[:12]}: {', '.join(labels)}" for d, labels in on.items()),
            *caveats,
        ]
    confs = configurations(runs)
    done = {k: c for k, c in confs.items() if c["repeats"]}
    syncs = {k: c for k, c in done.items() if k in SYNC_LABELS}
    best = min(syncs, key=lambda k: syncs[k]["figures"]["step_s"]["median"], default=None)
    bases = [k for k, c in done.items() if c["side"] == "verl"] + ([best] if best else [])
    versus = {
        ("best_sync" if base == best else base): {
            k: speedup(done[base], c) for k, c in done.items() if k != base
        }
        for base in dict.fromkeys(bases)
    }
    return {
        "bench": "vs_verl",
        "workload": "longtail",
        "prepare": load(work / "vs_verl-prepare.json"),
        "configurations": confs,
        "models": on,
        "best_sync": best,
        "speedup_vs": versus,
        "runs": runs,
        "caveats": caveats,
    }


def plot(path: Path, runs: list[dict[str, Any]], title: str) -> str | None:
    """Reward against wall-clock of every run (trailing mean of REWARD_WINDOW steps and the steps
    themselves); None, or why it could not be drawn (the figures are in the JSON)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5.5))
        # a colour per run: the default cycle's 10 repeat from the 11th run (3 repeats of 4 configs)
        tab20 = plt.get_cmap("tab20")
        ax.set_prop_cycle(color=[tab20(i) for i in range(20)])
        for r in runs:
            xs, ys = r.get("clock_curve"), r.get("reward_curve")
            if not xs or not ys:
                continue
            trail = [
                statistics.fmean(ys[max(0, i - REWARD_WINDOW + 1) : i + 1]) for i in range(len(ys))
            ]
            name = f"{r['label']} r{r.get('repeat', 1)}"
            (line,) = ax.plot(xs, trail, lw=2, label=f"{name} (mean of {REWARD_WINDOW})")
            ax.plot(xs, ys, "o", ms=3.5, alpha=0.6, color=line.get_color())
        ax.set_xlabel("wall-clock since the end of step 1 (s)")
        ax.set_ylabel("mean reward per step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None
