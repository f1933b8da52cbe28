"""How one training step reads on a console: its figures in short form, the step line and the
progress bar over the steps.

Design: shared by the learner's console sink (`learner.sinks.ConsoleSink`) and bin/train's console
(`launcher.console`), which shows the same line from the records of ``metrics.jsonl``; only rich is
needed, so the launcher imports it without the learner's packages.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


def short(value: float) -> str:
    """A number in 3 significant digits with k/M/G/T for large magnitudes: 0.0123, 4.56k, 12.3M."""
    if isinstance(value, numbers.Integral) and abs(int(value)) < 1000:
        return str(int(value))
    v = float(value)
    if not math.isfinite(v):
        return str(v)  # "nan", "inf", "-inf"
    for suffix in ("", "k", "M", "G"):
        # 999.5 would print as "1e+03" at 3 digits, so it already belongs to the next unit.
        if abs(v) < 999.5:
            return f"{v:.3g}{suffix}"
        v /= 1000
    return f"{v:.3g}T"


# (metric, label) pairs of the step line, in order; metrics absent from a step are left out.
_HEADLINE = (
    ("reward/mean", "reward"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/kl_loss", "kl"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad_norm"),
    ("val/reward/mean", "val"),
)
_TIMING_SPLIT = (
    ("timing/wait_s", "wait"),
    ("timing/prepare_s", "prep"),
    ("timing/update_s", "update"),
    ("timing/broadcast_s", "bcast"),
)


def agent_parts(metrics: Mapping[str, float]) -> list[tuple[str, str]]:
    """What the agents did (``learner.agent_metrics``), compactly: StateLM's snapshots and
    deletions and the code agent's sandbox runs whenever their agent ran (so a model that does not
    act yet shows 0), tool calls per episode only when there were some, with the busiest tools."""
    out = []
    if "agent/snapshots_per_episode" in metrics:
        snap = f"{short(metrics['agent/snapshots_per_episode'])}/ep"
        if "agent/deletions_per_episode" in metrics:
            snap += f" (del {short(metrics['agent/deletions_per_episode'])})"
        out.append(("snap", snap))
    if "agent/sandbox_runs_per_episode" in metrics:
        episodes = metrics.get("agent/episodes", 1.0)
        runs = metrics["agent/sandbox_runs_per_episode"] * episodes
        errors = metrics.get("agent/sandbox_errors_per_episode", 0.0) * episodes
        out.append(("sbx", f"{short(round(runs))} ({short(round(errors))} err)"))
    calls = metrics.get("agent/tool_calls_per_episode", 0.0)
    if calls > 0:
        per_tool = sorted(
            (
                (v, k.removeprefix("agent/tool_calls/"))
                for k, v in metrics.items()
                if k.startswith("agent/tool_calls/") and v > 0
            ),
            reverse=True,
        )
        busiest = " ".join(f"{name} {short(v)}" for v, name in per_tool[:3])
        out.append(("tools", f"{short(calls)}/ep" + (f" ({busiest})" if busiest else "")))
    return out


def step_line(step: int, total_steps: int | None, metrics: Mapping[str, float]) -> Text:
    """The console's line for one step: ``step 3/10  reward 0.5  pg_loss -0.01 ... time 12.3s``."""
    line = Text()
    line.append(f"step {step}" + (f"/{total_steps}" if total_steps is not None else ""), "bold")

    def add(label: str, figure: str) -> None:
        line.append("  ")
        line.append(label + " ", "dim")
        line.append(figure)

    for key, label in _HEADLINE:
        if key in metrics:
            add(label, short(metrics[key]))
    if "staleness/mean" in metrics:
        stale = short(metrics["staleness/mean"])
        if "staleness/max" in metrics:
            stale += f" (max {short(metrics['staleness/max'])})"
        add("stale", stale)
    if "rollout/waste_frac" in metrics:
        add("waste", short(metrics["rollout/waste_frac"]))
    if "reward/overlong_frac" in metrics:  # over-long shaping: share penalised (mean penalty)
        overlong = short(metrics["reward/overlong_frac"])
        if "reward/overlong_penalty_mean" in metrics:
            overlong += f" ({short(metrics['reward/overlong_penalty_mean'])})"
        add("overlong", overlong)
    if "rollout_corr/kl" in metrics:  # rollout correction: KL(rollout || learner), share rejected
        mismatch = short(metrics["rollout_corr/kl"])
        if "rollout_corr/rollout_rs_masked_fraction" in metrics:
            mismatch += f" (rej {short(metrics['rollout_corr/rollout_rs_masked_fraction'])})"
        add("mismatch", mismatch)
    for label, figure in agent_parts(metrics):
        add(label, figure)
    if "perf/tokens_per_s" in metrics:
        add("tok/s", short(metrics["perf/tokens_per_s"]))
    split = " ".join(f"{lab} {short(metrics[k])}" for k, lab in _TIMING_SPLIT if k in metrics)
    if "timing/step_s" in metrics or split:
        total = f"{short(metrics['timing/step_s'])}s" if "timing/step_s" in metrics else ""
        add("time", " ".join(p for p in (total, f"({split})" if split else "") if p))
    return line


def step_progress(console: Console) -> Progress:
    """The progress bar over training steps (shared by the console sink and bin/train)."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        refresh_per_second=2,
        # rich drops speed samples older than this period; RL steps can take minutes, and with
        # rich's 30 s default the ETA would stay unknown. Its sample deque (1000) keeps it recent.
        speed_estimate_period=6 * 3600,
    )
