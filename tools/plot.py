"""Training curves of a run: one PNG of panels against the step, from ``RUN_DIR/metrics.jsonl``.

Design: the panels are data (`PANELS`: a title and the metric keys or key patterns it draws), so
choosing what to plot is separate from drawing it, and a metric a run does not log (no KL term, no
validation, one data source) leaves its panel saying "no data" instead of failing. Records come
from `common.metrics_file.read_metrics`, which drops what a resumed run superseded. matplotlib is imported
only when drawing, with the Agg backend: no display is ever needed. ``--timeline`` draws the run's
timeline instead (``tools.timeline``: where the time of each step went, from RUN_DIR/timeline/).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.figures import pyplot, save

PLOT_FILE = "training_curves.png"


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    """Metric names drawn as they are, in this order, when present."""
    pattern: str | None = None
    """A regular expression: every other metric matching it is drawn too (per-source, validation)."""
    max_series: int = 8
    only_with_data: bool = False
    """Left out of the figure when the run logs none of its metrics (instead of saying "no data")."""


PANELS = (
    Panel("reward", ("reward/mean",), pattern=r"^reward/mean/.+"),
    # The demo's story: the warmed model calls the calculator in about a third of its episodes,
    # and RL raises that; each tool call adds a turn, so turns per episode is the tool-call rate.
    Panel("tool use (turns per episode)", ("episode/turns_mean", "val/episode/turns_mean")),
    Panel("KL", ("actor/kl_loss", "kl_in_reward/kl")),
    Panel("entropy", ("actor/entropy",)),
    Panel("staleness (policy versions)", ("staleness/mean", "staleness/max")),
    Panel("throughput (tokens/s)", ("perf/tokens_per_s", "perf/update_tokens_per_s")),
    Panel("validation reward", (), pattern=r"^val[-/].*reward.*mean"),
    # Dynamic sampling (algorithm.filter_groups): the groups left out, apart from waste.
    Panel(
        "groups filtered (share)",
        ("rollout/filtered_frac", "rollout/filtered_frac_step", "rollout/filter_pass_rate"),
        pattern=r"^rollout/filtered_frac/.+",
        only_with_data=True,
    ),
    # What the agents did, per episode (learner.agent_metrics): StateLM's snapshots and deletions,
    # the code agent's sandbox runs, tool calls per tool and per data source.
    Panel(
        "agent actions (per episode)",
        (
            "agent/snapshots_per_episode",
            "agent/deletions_per_episode",
            "agent/sandbox_runs_per_episode",
            "agent/sandbox_errors_per_episode",
            "agent/tool_calls_per_episode",
        ),
        pattern=r"^agent/tool_calls(_by_source)?/.+",
        max_series=10,
        only_with_data=True,
    ),
)


Series = dict[str, tuple[list[float], list[float]]]


def panel_series(records: Sequence[dict[str, Any]], panel: Panel) -> Series:
    """Name -> (steps, values) of the metrics `panel` draws; non-finite values are left out."""
    present = {k for r in records for k in r}
    names = [k for k in panel.keys if k in present]
    if panel.pattern is not None:
        rx = re.compile(panel.pattern)
        names += sorted(k for k in present if rx.search(k) and k not in names)
    out: Series = {}
    for name in names[: panel.max_series]:
        steps: list[float] = []
        values: list[float] = []
        for r in records:
            v = r.get(name)
            if isinstance(v, int | float) and math.isfinite(v):
                steps.append(float(r["step"]))
                values.append(float(v))
        if values:
            out[name] = (steps, values)
    return out


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metric records; ValueError naming the file when there are none."""
    # lazy: this module is bin/plot's command line, whose --help stays instant
    from common.metrics_file import METRICS_FILE, read_metrics

    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"no metrics file: {path} does not exist (is jsonl in trainer.logger?)")
    records = read_metrics(Path(run_dir))
    if not records:
        raise ValueError(f"no metrics in {path}: the run has not finished a step yet")
    return records


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw the training curves of `run_dir` into `out` (default RUN_DIR/training_curves.png)."""
    run_dir = Path(run_dir)
    records = load_records(run_dir)
    out = Path(out) if out is not None else run_dir / PLOT_FILE

    plt = pyplot("drawing the training curves")

    drawn = [(p, panel_series(records, p)) for p in PANELS]
    drawn = [(p, series) for p, series in drawn if series or not p.only_with_data]
    cols = 3
    rows = -(-len(drawn) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    try:
        for ax, (panel, series) in zip(axes.flat, drawn, strict=False):
            ax.set_title(panel.title)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
            if not series:
                ax.text(
                    0.5,
                    0.5,
                    "no data",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    color="grey",
                )
                continue
            for name, (steps, values) in series.items():
                ax.plot(
                    steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name
                )
            ax.legend(fontsize="x-small")
        for ax in list(axes.flat)[len(drawn) :]:
            ax.axis("off")
        last = records[-1]["step"]
        fig.suptitle(f"{run_dir.resolve().name}: {len(records)} records, last step {last}")
        save(fig, out)
    finally:
        plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="plot",
        description="Draw a run's training curves (reward, tool use, KL, entropy, staleness, "
        "throughput, validation reward, agent actions) from RUN_DIR/metrics.jsonl into one PNG; "
        "with --timeline, its timeline from RUN_DIR/timeline/ (the learner's phases per step, "
        "weight updates, grants, each rollout server's generation) as a PNG and a "
        "Chrome/Perfetto trace.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory")
    parser.add_argument(
        "--out",
        type=Path,
        metavar="PNG",
        help=f"output file (default: RUN_DIR/{PLOT_FILE}, with --timeline RUN_DIR/timeline.png)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="draw the run's timeline: a PNG and a trace for chrome://tracing or ui.perfetto.dev",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="JSON",
        help="with --timeline: the trace file (default: RUN_DIR/timeline.trace.json)",
    )
    args = parser.parse_args(argv)
    if args.trace is not None and not args.timeline:
        parser.error("--trace goes with --timeline")
    try:
        if args.timeline:
            # lazy: this module is bin/plot's command line, whose --help stays instant
            from tools.timeline import draw_timeline

            png, trace = draw_timeline(args.run_dir, args.out, args.trace)
            print(png)
            print(trace)
            return 0
        path = plot_run(args.run_dir, args.out)
    except (ValueError, ImportError) as e:
        print(f"plot: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
