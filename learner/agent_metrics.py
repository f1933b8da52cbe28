"""Per-step metrics of what the agents did, from the trajectories' ``actions``.

Design: an episode's action counts travel on its final trajectory only (``is_snapshot`` false;
StateLM's snapshot trajectories carry none), so the step's episodes are its non-snapshot
trajectories and every value is a mean per episode over them (an episode that reports no count of
a name counts 0 for it):

- ``agent/episodes``: episodes in the step;
- ``agent/<name>_per_episode`` for the counts of ``protocol.trajectory.ACTION_COUNTS`` that some
  episode reports (``agent/snapshots_per_episode``, ``agent/sandbox_runs_per_episode``, ...);
- ``agent/tool_calls/<tool>``: calls to that tool per episode;
- ``agent/tool_calls_by_source/<source>``: tool calls per episode of that data source, when the
  step's trajectories name their sources (as ``reward/mean/<source>`` does).

Names come from peers, so the keys are bounded by the learner's config: a tool name no agent of
the config offers is counted as ``other``, and so is a data source the config does not name. A
step whose trajectories report no actions (single-turn agents, older peers) adds no keys.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.config.root import Config
from protocol.trajectory import ACTION_COUNTS, TOOL_CALLS_PREFIX, Trajectory

OTHER = "other"


@dataclass(frozen=True)
class KnownNames:
    """The tool and data-source names a run's metrics may carry; anything else is ``other``."""

    tools: frozenset[str]
    sources: frozenset[str]

    @classmethod
    def of(cls, tools: Iterable[str] = (), sources: Iterable[str] = ()) -> KnownNames:
        return cls(frozenset(tools), frozenset(sources))

    @classmethod
    def from_config(cls, config: Config) -> KnownNames:
        # Every tool an agent may offer (rollout_service.server.AGENT_SETUPS): multi_turn.tools for
        # tool agents, StateLM's own list, and the code agent's python.
        tools = {
            *config.actor_rollout_ref.rollout.multi_turn.tools,
            *config.agents.statelm.tools,
            "python",
        }
        sources = {d.name for d in config.data.datasets}
        sources |= set(config.rollout_server.reward_by_data_source)
        return cls.of(tools, sources)

    def tool(self, name: str) -> str:
        return name if name in self.tools else OTHER

    def source(self, name: str) -> str:
        if not name:
            return "unknown"  # as batch_metrics names a trajectory without a source
        return name if name in self.sources else OTHER


def agent_metrics(trajs: Sequence[Trajectory], known: KnownNames) -> dict[str, float]:
    episodes = [t for t in trajs if not t.is_snapshot]
    if not any(t.actions for t in episodes):
        return {}
    totals: defaultdict[str, float] = defaultdict(float)
    reported: set[str] = set()
    calls_by_source: defaultdict[str, float] = defaultdict(float)
    episodes_by_source: Counter[str] = Counter()
    for t in episodes:
        for name, value in t.actions.items():
            if name.startswith(TOOL_CALLS_PREFIX):
                name = TOOL_CALLS_PREFIX + known.tool(name.removeprefix(TOOL_CALLS_PREFIX))
            elif name not in ACTION_COUNTS:
                continue  # a count this learner does not know
            totals[name] += value
            reported.add(name)
        src = t.data_source
        episodes_by_source[src] += 1
        calls_by_source[src] += t.actions.get("tool_calls", 0)
    n = len(episodes)
    out = {"agent/episodes": float(n)}
    for name in ACTION_COUNTS:
        if name in reported:
            out[f"agent/{name}_per_episode"] = totals[name] / n
    for name in sorted(k for k in reported if k.startswith(TOOL_CALLS_PREFIX)):
        out[f"agent/{name}"] = totals[name] / n
    # Per source under the same condition as batch_metrics' per-source keys.
    if len(episodes_by_source) > 1 or "" not in episodes_by_source:
        folded_calls: defaultdict[str, float] = defaultdict(float)
        folded_episodes: Counter[str] = Counter()
        for src, count in episodes_by_source.items():
            folded_calls[known.source(src)] += calls_by_source[src]
            folded_episodes[known.source(src)] += count
        for src in sorted(folded_episodes):
            out[f"agent/tool_calls_by_source/{src}"] = folded_calls[src] / folded_episodes[src]
    return out
