"""The rule of dynamic sampling (DAPO's group filter), shared by the learner's filter
(``learner.group_filter``) and the rollout servers' prompt memory (``rollout_service.prompt_memory``).

Design: a group's episodes are read through one metric (a registry, ``METRICS``; any other name is
a key of the reward's extras) and judged by verl's rule (``verdict``): a group whose values have
standard deviation 0 is uniform (all passed, or all failed) and teaches GRPO nothing. StateLM
snapshots are segments of one episode and share its reward, so they are not episodes here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from protocol.trajectory import Trajectory

Penalties = Callable[[Sequence[Trajectory]], np.ndarray | None]
"""Over-long penalty of each trajectory (None: shaping off), ``learner.reward_shaping``."""
Reader = Callable[[Sequence[Trajectory], Penalties], list[float | None]]


def _scored(trajs: Sequence[Trajectory], _penalties: Penalties) -> list[float | None]:
    return [float(t.reward) for t in trajs]


def _shaped(trajs: Sequence[Trajectory], penalties: Penalties) -> list[float | None]:
    pen = penalties(trajs)
    if pen is None:
        return _scored(trajs, penalties)
    return [float(t.reward) + float(p) for t, p in zip(trajs, pen, strict=True)]


METRICS: Mapping[str, Reader] = {
    "reward": _scored,
    "seq_reward": _scored,
    "score": _scored,
    "seq_final_reward": _shaped,
}
"""Built-in metric names -> how to read them; any other name is a reward extras key."""


def _extra(name: str) -> Reader:
    def read(trajs: Sequence[Trajectory], _penalties: Penalties) -> list[float | None]:
        out: list[float | None] = []
        for t in trajs:
            v = t.reward_extras.get(name)
            out.append(float(v) if isinstance(v, int | float) else None)
        return out

    return read


def reader(metric: str) -> Reader:
    return METRICS.get(metric) or _extra(metric)


def verdict(values: Sequence[float | None]) -> bool | None:
    """Whether a group of episodes with these metric values is kept (None: some value is missing,
    the group is kept unjudged). verl's rule: kept unless its values have standard deviation 0,
    and a group of one is kept."""
    if any(v is None for v in values):
        return None
    return len(values) <= 1 or float(np.std(np.asarray(values, np.float64))) > 0


def no_penalties(_trajs: Sequence[Trajectory]) -> None:
    """Over-long shaping off (or unknown, on a rollout server): seq_final_reward is the score."""
    return None


def episodes(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """The group's episodes: its trajectories less StateLM snapshots (one per episode)."""
    return [t for t in trajectories if not t.is_snapshot] or list(trajectories)


def judge(
    trajectories: Sequence[Trajectory], metric: str, penalties: Penalties = no_penalties
) -> bool | None:
    """``verdict`` of a group's trajectories under ``metric``."""
    return verdict(reader(metric)(episodes(trajectories), penalties))
