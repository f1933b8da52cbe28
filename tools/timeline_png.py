"""The timeline PNG: one figure of lanes against wall-clock seconds since the run's first record.

Design: the lanes answer "where does the time go" from top to bottom. (1) The learner: each step's
phases as coloured bars (wait, prepare, update, broadcast; validations and checkpoints too), the
step numbers above. (2) Weights and grants: each version published (learner row), each rollout
server's weight loads as bars labelled with the version, and its grants as ticks (the groups it
was allowed to start). (3) Groups: the learner's buffer (received, not yet trained), the groups
admitted and still generating, and each server's unused grants. (4) Each server's model requests
in flight (episodes in flight dashed). (5) Each server's sampled tokens per second. The learner's
waits are shaded across every lane, so what the servers did while it waited is read straight down.
The x axis starts when the first rollout server served: start-up comes before (the trace keeps it).
Sans-IO apart from ``savefig``: everything comes from a ``tools.timeline_read.Timeline``; matplotlib
is imported here, with the Agg backend, only when drawing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.timeline import (
    APPLY_SPAN,
    CHECKPOINT_SPAN,
    EARLY_REF_SPAN,
    EARLY_UPDATE_SPAN,
    GRANT_EVENT,
    PUBLISH_EVENT,
    VALIDATE_SPAN,
    Track,
)
from tools.figures import pyplot, save
from tools.timeline_read import Timeline, level, rate, steps

PHASE_COLORS = {
    "wait": "#d62728",
    EARLY_REF_SPAN: "#e377c2",  # drawn over the wait it ran in
    EARLY_UPDATE_SPAN: "#17becf",  # likewise
    "prepare": "#ff7f0e",
    "update": "#1f77b4",
    "broadcast": "#2ca02c",
    VALIDATE_SPAN: "#9467bd",
    CHECKPOINT_SPAN: "#8c564b",
}
RATE_WINDOW_S = 2.0
"""Tokens/s are averaged over this long: tokens count when a request ends (a turn), so a shorter
window shows the turns' ends more than the generation."""
_OUTCOME_COLORS = {"failed": "red", "cancelled": "lightgrey"}  # else the server's colour
MAX_LABELS = 60  # more steps, versions or grants than this: fewer labels, never overlapping ones


def draw_png(tl: Timeline, out: Path, *, title: str = "") -> Path:
    plt = pyplot("drawing the timeline")

    servers = tl.servers
    rows = 1 + len(servers)
    fig, axes = plt.subplots(
        5,
        1,
        figsize=(16, 3.2 + 0.35 * rows + 6.6),
        sharex=True,
        gridspec_kw={"height_ratios": [1.1, 0.45 + 0.3 * rows, 1.6, 1.6, 1.6]},
        squeeze=False,
    )
    ax_steps, ax_events, ax_groups, ax_flight, ax_tokens = axes[:, 0]
    origin = tl.start
    colors = {p.key: f"C{i % 10}" for i, p in enumerate(servers)}
    try:
        all_steps = _draw_learner(ax_steps, tl, origin)
        _draw_events(ax_events, tl, origin, colors)
        _draw_groups(ax_groups, tl, origin, colors)
        for p in servers:
            x, y = level(p.samples, "requests_in_flight")
            ax_flight.step(_rel(x, origin), y, where="post", color=colors[p.key], label=p.label)
            x, y = level(p.samples, "episodes_in_flight")
            ax_flight.step(_rel(x, origin), y, where="post", color=colors[p.key], ls=":", lw=1)
            x, y = rate(p.samples, "sampled_tokens", RATE_WINDOW_S)
            ax_tokens.plot(_rel(x, origin), y, color=colors[p.key], label=p.label)
        ax_flight.set_ylabel("in flight")
        ax_flight.set_title(
            "model requests in flight per rollout server (episodes in flight dotted)",
            loc="left",
            fontsize=9,
        )
        ax_tokens.set_ylabel("tokens/s")
        ax_tokens.set_title(
            f"sampled tokens/s per rollout server (over {RATE_WINDOW_S:g} s)",
            loc="left",
            fontsize=9,
        )
        ax_tokens.set_xlabel("seconds since the run's first record")
        for ax in (ax_groups, ax_flight, ax_tokens):
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="x-small", loc="upper left")
        for ax in axes[:, 0]:  # the learner's waits and step boundaries, down every lane
            for s in all_steps:
                wait = s.phases.get("wait", 0.0)
                ax.axvspan(s.start - origin, s.start + wait - origin, color="#d62728", alpha=0.07)
                ax.axvline(s.start - origin, color="grey", lw=0.5, alpha=0.5)
        # From the first rollout server's start: the start-up before it would squeeze the steps.
        serving = tl.serving_start
        left = max(0.0, serving - origin - 1.0) if serving is not None else 0.0
        ax_tokens.set_xlim(left, max(tl.end - origin, left + 1e-3))
        summary = _summary(all_steps)
        if left > 0:
            summary += f"; the first {left:.0f} s (start-up) left out"
        fig.suptitle(f"{title}: {summary}" if title else summary, fontsize=11)
        save(fig, out)
    finally:
        plt.close(fig)
    return out


def _summary(all_steps: list[Any]) -> str:
    """Steps and their waits for data; after the first, which also waits for the start-up."""
    if not all_steps:
        return "no step recorded"
    later = all_steps[1:]
    if not later:
        return f"1 step, waited {all_steps[0].phases.get('wait', 0.0):.1f} s for data"
    waits = [s.phases.get("wait", 0.0) for s in later]
    worst = later[waits.index(max(waits))].step
    return (
        f"{len(all_steps)} steps; wait for data after step 1: mean {sum(waits) / len(waits):.2f} s, "
        f"max {max(waits):.2f} s at step {worst}"
    )


def _rel(xs: list[float], origin: float) -> list[float]:
    return [x - origin for x in xs]


def _draw_learner(ax: Any, tl: Timeline, origin: float) -> list[Any]:
    learner = tl.learner
    all_steps = steps(learner)
    ax.set_title(
        "learner: phases of each step (means: steps after the first)", loc="left", fontsize=9
    )
    ax.set_yticks([])
    ax.set_ylim(0, 1.45)
    if learner is None:
        ax.text(0.5, 0.5, "no learner timeline", transform=ax.transAxes, ha="center")
        return all_steps
    for name, color in PHASE_COLORS.items():
        spans = [r for r in learner.spans if r.name == name]
        if not spans:
            continue
        # Means over the steps after the first, as bench/e2e.py's: step 1 also waits for start-up.
        later = [r.dur for r in spans if r.args.get("step", 0) > 1] or [r.dur for r in spans]
        ax.broken_barh(
            [(r.time - origin, r.dur) for r in spans],
            (0.1, 0.8),
            color=color,
            label=f"{name} (mean {sum(later) / len(later):.2f} s)",
        )
    every = max(1, -(-len(all_steps) // MAX_LABELS))
    for s in all_steps[::every]:  # labels are clipped to the lanes, as their data (start-up)
        ax.text(s.start - origin, 1.0, str(s.step), fontsize=7, va="bottom", clip_on=True)
    # Above the lane, right of its title: the bars and step numbers stay uncovered.
    ax.legend(
        fontsize="x-small", loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=6, frameon=False
    )
    return all_steps


def _draw_events(ax: Any, tl: Timeline, origin: float, colors: dict[str, str]) -> None:
    """Row 0: the learner's publishes; row i: server i's weight loads (bars) and grants (ticks)."""
    ax.set_title(
        "weights: versions published (learner) and loaded (bars: rollout servers; red failed, "
        "grey cancelled); grants: groups admitted (ticks, + count)",
        loc="left",
        fontsize=9,
    )
    labels = ["publish"]
    learner = tl.learner
    publishes = [r for r in (learner.instants if learner else []) if r.name == PUBLISH_EVENT]
    every = max(1, -(-len(publishes) // MAX_LABELS))
    for i, r in enumerate(publishes):
        ax.plot(r.time - origin, 0, "v", color="black", ms=6)
        if i % every == 0:
            ax.text(
                r.time - origin,
                0.2,
                f"v{r.args.get('version')}",
                fontsize=6,
                ha="center",
                clip_on=True,
            )
    grants = [r for r in (learner.instants if learner else []) if r.name == GRANT_EVENT]
    for row, p in enumerate(tl.servers, start=1):
        labels.append(p.name)
        applies = [r for r in p.spans if r.track == Track.WEIGHTS and r.name == APPLY_SPAN]
        # A load of a few ms is still seen: bars are at least 0.2% of the run wide.
        least = 0.002 * max(tl.end - tl.start, 1e-3)
        ax.broken_barh(
            [(r.time - origin, max(r.dur, least)) for r in applies],
            (row - 0.35, 0.3),
            color=[_OUTCOME_COLORS.get(str(r.args.get("outcome")), colors[p.key]) for r in applies],
        )
        every = max(1, -(-len(applies) // MAX_LABELS))
        for r in applies[::every]:
            ax.text(
                r.time - origin, row - 0.02, f"v{r.args.get('version')}", fontsize=6, clip_on=True
            )
        mine = [r for r in grants if r.args.get("server") == p.name]
        xs = [r.time - origin for r in mine]
        ax.plot(xs, [row + 0.2] * len(xs), "|", color=colors[p.key], ms=9, mew=1.2)
        if len(mine) <= MAX_LABELS:
            for r in mine:
                ax.text(
                    r.time - origin, row + 0.3, f"+{r.args.get('groups')}", fontsize=6, clip_on=True
                )
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.4, -0.5)
    ax.grid(True, axis="x", alpha=0.3)


def _draw_groups(ax: Any, tl: Timeline, origin: float, colors: dict[str, str]) -> None:
    ax.set_title(
        "groups: received and waiting at the learner, admitted and still generating, "
        "granted and not started (per server, dotted)",
        loc="left",
        fontsize=9,
    )
    ax.set_ylabel("groups")
    if (learner := tl.learner) is not None:
        x, y = level(learner.samples, "buffered_groups")
        ax.step(_rel(x, origin), y, where="post", color="black", label="learner: buffered")
        x, y = level(learner.samples, "generating_groups")
        if any(v >= 0 for v in y):  # -1: the learner grants nothing
            ax.step(_rel(x, origin), y, where="post", color="grey", label="admitted, generating")
    for p in tl.servers:
        x, y = level(p.samples, "granted_groups")
        if any(v >= 0 for v in y):
            ax.step(
                _rel(x, origin),
                [max(v, 0) for v in y],
                where="post",
                color=colors[p.key],
                ls=":",
                label=f"{p.name}: grants not started",
            )
