"""Staleness: how many policy versions old the weights behind some data are. The one rule, for
both sides of the link.

Versions count the learner's published policies (SPEC §16: they only go up). ``max_staleness = k``
(``actor_rollout_ref.rollout.max_staleness``) bounds two different things, named apart here:

- **Weights lag** (rollout side): how many versions a rollout server's engine weights are behind
  the newest version the learner announced, ``newest - engine``. A server starts new groups only
  while the lag is at most ``k`` (``weights_too_old`` is false): with a larger lag every token it
  would generate is already too old.
- **Token age** (both sides): how many versions the *oldest* token of a trajectory or group is
  behind the policy it would train or be judged against, ``policy - oldest``. Data whose age
  exceeds ``k`` is stale: dropped, never trained (``too_old``). Versions only grow, so data found
  stale once stays stale.

The rule, one inequality for both: data of version ``u`` is usable at version ``v`` iff
``v <= deadline(u, k) = u + k``. Everything else is derived from the deadline: a group must be in
the step of version ``v`` when its deadline is ``v`` (``due``: it is stale after that step), and a
step of version ``v`` leaves ``deadline - v`` later steps to train it (``steps_left``, what
admission's feasibility counts, ``learner.admission.feasible``).

Which token is "oldest" differs by side, on purpose. The learner's buffer ages a trajectory by its
oldest *trained* token (``response_mask == 1``), else by its oldest response token of any kind
(``oldest_version``); a rollout server ages it by its oldest trained token only, and a trajectory
without one never makes its group stale there (``oldest_sampled_version``). Data without a response
token has no age (``None``): it is never stale.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from protocol.trajectory import Trajectory


def deadline(oldest_version: int, max_staleness: int) -> int:
    """The newest policy version whose step may still train data whose oldest token is
    ``oldest_version`` (a grant of ``min_version`` counts as its oldest token)."""
    return oldest_version + max_staleness


def too_old(oldest_version: int | None, policy_version: int, max_staleness: int) -> bool:
    """Token age: data whose oldest token is ``oldest_version`` (None: no token, never stale) is
    more than ``max_staleness`` versions behind ``policy_version``."""
    return oldest_version is not None and policy_version > deadline(oldest_version, max_staleness)


def token_age(oldest_version: int | None, policy_version: int) -> int:
    """Versions the oldest token is behind ``policy_version`` (0: no token, or not behind)."""
    return 0 if oldest_version is None else max(0, policy_version - oldest_version)


def due(deadline_version: int, policy_version: int) -> bool:
    """Data of ``deadline_version`` must be trained in the step of ``policy_version``: it is stale
    after it."""
    return deadline_version <= policy_version


def steps_left(deadline_version: int, policy_version: int) -> int:
    """The steps after that of ``policy_version`` that may still train data of ``deadline_version``."""
    return max(0, deadline_version - policy_version)


def weights_lag(newest_version: int, engine_version: int) -> int:
    """Weights lag: how many versions the engine's weights are behind the newest announced."""
    return newest_version - engine_version


def weights_too_old(newest_version: int, engine_version: int, max_staleness: int) -> bool:
    """Weights lag above ``max_staleness``: whatever the engine generates now is already stale."""
    return too_old(engine_version, newest_version, max_staleness)


def oldest_version(t: Trajectory) -> int | None:
    """The learner's age of ``t``: the oldest policy version among its trained tokens (any response
    token if none is trained); None if it has no response."""
    versions = t.versions
    if not len(versions):
        return None
    trained = versions[np.asarray(t.response_mask).view(np.uint8) == 1]
    return int(trained.min() if len(trained) else versions.min())


def oldest_sampled_version(t: Trajectory) -> int | None:
    """The rollout server's age of ``t``: the oldest version among its trained tokens (None: none)."""
    sampled = t.versions[t.response_mask == 1]
    return int(sampled.min()) if len(sampled) else None


def group_too_old(
    trajectories: Iterable[Trajectory], newest_version: int, max_staleness: int
) -> bool:
    """Rollout side: any trajectory's oldest trained token is too old at ``newest_version`` (the
    group is then dropped whole: GRPO needs it complete)."""
    return any(
        too_old(oldest_sampled_version(t), newest_version, max_staleness) for t in trajectories
    )
