"""Dynamic sampling (DAPO's group filter, verl's ``algorithm.filter_groups``): which accepted groups
are trained, and what the filter tells admission and the step.

Design: sans-IO, one ``GroupFilter`` owned by the intake, which judges every group as it is
accepted (and again, identically, when the journal replays it after a restart).

- The rule is verl's (``common.group_rule``, shared with the rollout servers' prompt memory): a
  group whose episodes all have the same value of ``metric`` (standard deviation 0) has zero
  advantage under GRPO and teaches nothing; it is *filtered*: not queued, its room freed at once. A group of one episode is kept (verl keeps it: with ``rollout.n = 1``
  every group would be filtered). StateLM snapshots are segments of one episode and share its
  reward, so episodes are counted without them. A group whose metric is missing on some episode
  (an extras name its reward does not set) is kept and counted as ``unjudged``: guessing would
  drop a group that teaches something.
- Metrics come from a registry (``common.group_rule.METRICS``): ``reward``, ``seq_reward`` and
  ``score`` read the scored reward the rollout server sent (verl's pre-KL score); ``seq_final_reward`` that reward
  after over-long shaping (``learner.reward_shaping``; KL-in-reward is computed later, from the
  reference, and is not in it); any other name reads the reward's extras (``acc``, ``passed``...).
- The decision is a pure function of the stored trajectories and the config, so the journal needs
  no record of it: a restart replays a filtered record and filters it again, and a checkpoint's
  pending groups never include a filtered one (it was never queued).
- Filtered is not waste: the group was generated on time and judged; it counts on its own
  (``rollout/filtered_frac``, per data source ``rollout/filtered_frac/<source>``), never in
  ``rollout/waste_frac``.
- Admission plans on the pass rate: the share of the last ``PASS_WINDOW_BATCHES`` batches' worth
  of judged groups that were kept, with a prior of one batch kept (1 before any verdict, floored
  at ``MIN_PASS_RATE``). It grants enough groups that an upper bound of the kept ones fills its
  window, and counts groups still generating at that bound when it checks a step's feasibility
  (``learner.admission``).
- ``max_num_gen_batches`` bounds the refill as verl does: a step may judge at most that many
  batches' worth of groups (``B`` each: the ``B`` it trains plus the groups filtered since the last
  step). Reaching it still short of ``B`` kept groups stops the run (``FilterGroupsExhausted``,
  verl's ``ValueError`` with its advice): a bound is set to catch data the model cannot learn
  from, and training on short batches would hide it. 0 or less: no bound (verl's default).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from common.config.root import Config
from common.group_rule import Penalties, judge, no_penalties
from learner.reward_shaping import overlong_penalties
from protocol.trajectory import Trajectory

PASS_WINDOW_BATCHES = 4
"""The pass rate is the kept share of the last this-many batches' worth of judged groups."""
MIN_PASS_RATE = 0.1
"""Admission never plans on a lower pass rate (at most 10x its window generating)."""


class FilterGroupsExhausted(RuntimeError):
    """``algorithm.filter_groups.max_num_gen_batches`` batches were judged for one step and it is
    still short of groups."""


class GroupFilter:
    def __init__(
        self,
        metric: str,
        batch_groups: int,
        *,
        max_num_gen_batches: int = 0,
        penalties: Penalties = no_penalties,
    ) -> None:
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1 (got {batch_groups})")
        self.metric, self.batch_groups = metric, batch_groups
        self.max_num_gen_batches = max_num_gen_batches
        self._penalties = penalties
        self.judged: Counter[str] = Counter()  # data source -> groups judged (unjudged included)
        self.filtered: Counter[str] = Counter()  # data source -> groups filtered
        self.unjudged = 0  # groups kept because some episode lacks the metric
        self.filtered_tokens = 0  # sampled response tokens of the filtered groups
        self.since_step = 0  # groups filtered since the last step was taken
        self._recent: deque[bool] = deque(maxlen=PASS_WINDOW_BATCHES * batch_groups)
        self._reported = (0, 0)  # (judged, filtered) at the last ``metrics`` call

    def keeps(self, trajectories: Sequence[Trajectory], *, count: bool = True) -> bool:
        """Whether the group of ``trajectories`` is trained. ``count``: book it (False for a group
        a restored checkpoint's counts already hold)."""
        kept = judge(trajectories, self.metric, self._penalties)
        if count:
            source = trajectories[0].data_source if trajectories else ""
            self.judged[source] += 1
            self.unjudged += kept is None
            self._recent.append(kept is not False)
            if kept is False:
                self.filtered[source] += 1
                self.filtered_tokens += sum(
                    int(np.count_nonzero(t.response_mask)) for t in trajectories
                )
                self.since_step += 1
        return kept is not False

    @property
    def pass_rate(self) -> float:
        """The kept share of the recently judged groups, what admission plans on, with a prior of
        one batch of kept groups: the first few verdicts do not swing it."""
        b = self.batch_groups
        return max(MIN_PASS_RATE, (sum(self._recent) + b) / (len(self._recent) + b))

    def step_taken(self) -> None:
        self.since_step = 0

    def exhausted(self, buffered: int) -> bool:
        """A step waiting with ``buffered`` kept groups has judged its ``max_num_gen_batches``
        batches' worth of groups and is still short."""
        b, bound = self.batch_groups, self.max_num_gen_batches
        return bound > 0 and buffered < b and self.since_step + buffered >= bound * b

    def exhausted_error(self, buffered: int) -> FilterGroupsExhausted:
        return FilterGroupsExhausted(
            f"dynamic sampling judged {self.since_step + buffered} groups for this step "
            f"(algorithm.filter_groups.max_num_gen_batches={self.max_num_gen_batches} batches of "
            f"{self.batch_groups}) and kept only {buffered}: every other group scored the same on all "
            f"its episodes (metric {self.metric!r}). Check whether the data is too hard or too easy, "
            "or set algorithm.filter_groups.max_num_gen_batches=0 for no bound"
        )

    def metrics(self) -> dict[str, float]:
        """``rollout/filtered_frac`` (share of all groups judged so far that were filtered),
        ``_step`` (since the last call), counts, the pass rate admission plans on, and per data
        source ``rollout/filtered_frac/<source>`` when the groups name sources."""
        judged, filtered = sum(self.judged.values()), sum(self.filtered.values())
        j0, f0 = self._reported
        self._reported = (judged, filtered)
        out = {
            "rollout/filtered_frac": filtered / judged if judged else 0.0,
            "rollout/filtered_frac_step": (filtered - f0) / (judged - j0) if judged > j0 else 0.0,
            "rollout/filtered_groups": float(filtered),
            "rollout/filtered_tokens": float(self.filtered_tokens),
            "rollout/filter_pass_rate": self.pass_rate,
        }
        if self.unjudged:
            out["rollout/filter_unjudged_groups"] = float(self.unjudged)
        if set(self.judged) - {""}:
            for src, n in sorted(self.judged.items()):
                out[f"rollout/filtered_frac/{src or 'unknown'}"] = self.filtered[src] / n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "judged": dict(self.judged),
            "filtered": dict(self.filtered),
            "unjudged": self.unjudged,
            "filtered_tokens": self.filtered_tokens,
            "recent": list(self._recent),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.judged = Counter({str(k): int(v) for k, v in state.get("judged", {}).items()})
        self.filtered = Counter({str(k): int(v) for k, v in state.get("filtered", {}).items()})
        self.unjudged = int(state.get("unjudged", 0))
        self.filtered_tokens = int(state.get("filtered_tokens", 0))
        self._recent.extend(bool(x) for x in state.get("recent", []))
        self._reported = (sum(self.judged.values()), sum(self.filtered.values()))


def from_config(config: Config) -> GroupFilter | None:
    """The run's filter (None: ``algorithm.filter_groups.enable`` is false)."""
    cfg = config.algorithm.filter_groups
    if not cfg.enable:
        return None
    reward, max_len = config.reward, config.data.max_response_length

    def penalties(trajs: Sequence[Trajectory]) -> np.ndarray | None:
        return overlong_penalties([len(t.response_ids) for t in trajs], reward, max_len)

    return GroupFilter(
        cfg.metric,
        config.data.train_batch_size,
        max_num_gen_batches=cfg.max_num_gen_batches,
        penalties=penalties,
    )
