"""A prompt group: rollout.n episodes of one prompt, run concurrently and scored; the unit a
rollout server ships (GRPO needs the whole group in one batch). The server checks its staleness
(``protocol.staleness``).

Design: this module knows agents and rewards, and nothing about sockets or data files, so the
server composes it with the data source and the shipper, and tests drive it with a scripted engine. Reward functions are chosen per row (its ``reward_fn``), else per data
source (the config's table, else verl's: ``rewards.data_sources``), else the default; a reward
function that raises scores the episode 0 with the error in its extras instead of losing the group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from common.logging import get_logger
from protocol.trajectory import Trajectory
from rollout_service.agents.base import AGENTS, AgentDeps
from rollout_service.agents.episode import Episode
from rollout_service.rewards.base import REWARDS, EpisodeView, RewardResult
from rollout_service.rewards.data_sources import reward_for_data_source

log = get_logger("rollout_service.groups")


@dataclass
class RewardChoice:
    default: str = "math"
    by_data_source: Mapping[str, str] = field(default_factory=dict)

    def name_for(self, row: Mapping[str, Any], data_source: str) -> str:
        own = row.get("reward_fn")
        if isinstance(own, str) and own:
            return own
        mapped = self.by_data_source.get(data_source) or reward_for_data_source(data_source)
        return mapped or self.default


def episode_view(ep: Episode, renderer: Any) -> EpisodeView:
    text = renderer.decode([t for t, m in zip(ep.response_ids, ep.mask, strict=True) if m == 1])
    return EpisodeView(
        response_text=text,
        final_answer=ep.final_answer,
        messages=list(ep.messages),
        termination=ep.termination or "aborted",
        num_turns=ep.turns,
        tool_calls=ep.tool_calls,
        tool_errors=ep.tool_errors,
    )


async def score(ep: Episode, renderer: Any, rewards: RewardChoice) -> RewardResult:
    name = rewards.name_for(ep.row, ep.data_source)
    try:
        fn = REWARDS.get(name)
        return await fn(episode_view(ep, renderer), ep.row)
    except Exception as e:  # a broken reward function or row must not lose the group
        log.warning(
            "reward failed", reward_fn=name, episode=ep.episode_id, error=f"{type(e).__name__}: {e}"
        )
        return RewardResult(0.0, {"reward_error": f"{type(e).__name__}: {e}"[:200]})


@dataclass
class GroupResult:
    trajectories: list[Trajectory]
    episodes: list[Episode]


REMAX_BASELINE = "remax_baseline"
"""reward_extras key of the greedy episode's reward (ReMax's baseline), on every trajectory of a group."""


async def greedy_baseline(
    *,
    group_uid: str,
    row: dict[str, Any],
    agent_type: str,
    data_source: str,
    deps: AgentDeps,
    rewards: RewardChoice,
) -> float:
    """Reward of one greedy episode of ``row``: ReMax's baseline. The episode itself is not shipped
    (it is not trained on)."""
    greedy = replace(deps, sampling=replace(deps.sampling, temperature=0.0))
    ep = Episode(
        f"{group_uid}-greedy", group_uid, row, data_source=data_source, agent_type=agent_type
    )
    await AGENTS.get(agent_type)(greedy).run(ep)
    return (await score(ep, deps.renderer, rewards)).score


async def run_group(
    *,
    group_uid: str,
    row: dict[str, Any],
    n: int,
    agent_type: str,
    data_source: str,
    deps: AgentDeps,
    rewards: RewardChoice,
    server_id: str,
    remax: bool = False,
) -> GroupResult:
    """Run ``n`` episodes of ``row`` concurrently and score them; with ``remax``, also one greedy
    episode whose reward every trajectory carries as its baseline."""
    agent = AGENTS.get(agent_type)(deps)
    segmenting = getattr(agent, "trajectories", None)
    episodes = [
        Episode(f"{group_uid}-{i}", group_uid, row, data_source=data_source, agent_type=agent_type)
        for i in range(n)
    ]
    trajectories: list[list[Trajectory]] = [[] for _ in episodes]

    async def one(i: int) -> None:
        ep = episodes[i]
        await agent.run(ep)
        result = await score(ep, deps.renderer, rewards)
        if segmenting is not None:  # the agent shapes rewards and picks segments (StateLM)
            trajectories[i] = segmenting(ep, result, server_id)
        else:
            trajectories[i] = ep.to_trajectories(
                reward=result.score, reward_extras=result.extras, source_server=server_id
            )

    baseline: list[float] = []

    async def base() -> None:
        baseline.append(
            await greedy_baseline(
                group_uid=group_uid,
                row=row,
                agent_type=agent_type,
                data_source=data_source,
                deps=deps,
                rewards=rewards,
            )
        )

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
        if remax:
            tg.start_soon(base)
    flat = [t for ts in trajectories for t in ts]
    for t in flat if remax else []:
        t.reward_extras[REMAX_BASELINE] = baseline[0]
    return GroupResult(flat, episodes)
