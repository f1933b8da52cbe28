"""One agent episode: its explicit state machine and its token buffers.

Design: an episode is PENDING -> GENERATING -> PROCESSING_TOOLS -> (GENERATING | TERMINATED), and
every move goes through ``goto``, which refuses a transition the diagram does not have, so a bug
in an agent loop fails loudly instead of producing a subtly wrong trajectory. The four response
buffers (ids, mask, logprobs, versions) are only ever appended to together, by ``add_model`` and
``add_tool``, so they cannot drift out of alignment whatever the engine or the tools return.
Agents that cut an episode into segments (StateLM snapshots) call ``cut_segment``; each segment
becomes one trajectory of the episode's group. What the agent did (tool calls per tool, sandbox
runs, snapshots, deletions) is counted here too (``record_call``, ``count``) and travels as the
final trajectory's ``actions``.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from protocol.trajectory import TERMINATIONS, TOOL_CALLS_PREFIX, Trajectory

if TYPE_CHECKING:
    from rollout_service.tools.base import ToolResult

# A tool result that ran code in the sandbox says so with this metric (tools.python_exec sets it,
# and the tool server passes it on), whichever agent called it and wherever it ran.
SANDBOX_METRIC = "sandbox_wall_s"


_ATTEMPTS = itertools.count()


class State(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.PENDING: frozenset({State.GENERATING, State.TERMINATED}),
    State.GENERATING: frozenset({State.PROCESSING_TOOLS, State.TERMINATED}),
    State.PROCESSING_TOOLS: frozenset({State.GENERATING, State.TERMINATED}),
    State.TERMINATED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Segment:
    """A finished part of an episode: what one trajectory is made of."""

    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    is_snapshot: bool


@dataclass
class Episode:
    episode_id: str
    group_uid: str
    row: dict[str, Any]
    data_source: str = ""
    agent_type: str = ""
    state: State = State.PENDING
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0
    # Action counts beyond tool_calls/tool_errors (``protocol.trajectory.ACTION_COUNTS``). An agent
    # puts the names it reports in at 0 when it starts (``expect_actions``), so an episode that did
    # nothing reports 0 rather than nothing.
    actions: dict[str, float] = field(default_factory=dict)
    termination: str | None = None
    final_answer: str | None = None
    segments: list[Segment] = field(default_factory=list)
    tool_state: dict[str, Any] = field(default_factory=dict)  # per-episode state of stateful tools
    timings: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    # Names this attempt of the episode to the engine (whose later turns reuse its KV): unique in
    # the process, since a group run again after a drop keeps its episode ids.
    kv_scope: str = field(default_factory=lambda: f"kv{next(_ATTEMPTS)}")

    # -- state machine ------------------------------------------------------------------------------
    def goto(self, new: State) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"episode {self.episode_id}: {self.state.name} -> {new.name} is not allowed"
            )
        self.state = new

    def terminate(self, reason: str) -> None:
        if reason not in TERMINATIONS:
            raise ValueError(f"unknown termination reason {reason!r}; known: {TERMINATIONS}")
        self.goto(State.TERMINATED)
        self.termination = reason

    # -- buffers ------------------------------------------------------------------------------------------
    def add_model(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]
    ) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"engine output misaligned: {len(ids)} ids, {len(logprobs)} logprobs, "
                f"{len(versions)} versions"
            )
        self.response_ids.extend(ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def add_tool(self, ids: Sequence[int]) -> None:
        # Tool tokens are context, not actions: mask 0, logprob 0. They carry the version of the
        # model turn before them so "oldest token" stays a statement about sampled tokens.
        version = self.versions[-1] if self.versions else 0
        self.response_ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([version] * len(ids))

    def mask_out(self, index: int) -> None:
        """Keep response token ``index`` as context only (mask 0, logprob 0): state masking."""
        self.mask[index] = 0
        self.logprobs[index] = 0.0

    # -- actions ------------------------------------------------------------------------------------
    def expect_actions(self, *names: str) -> None:
        for name in names:
            self.actions.setdefault(name, 0)

    def count(self, name: str, n: float = 1) -> None:
        self.actions[name] = self.actions.get(name, 0) + n

    def record_call(self, tool: str, result: ToolResult) -> None:
        """One tool call and its result. ``tool`` must be a name the agent offers (or ``other``):
        it becomes a count name, and the learner folds names outside its config anyway."""
        self.tool_calls += 1
        self.tool_errors += not result.ok
        self.count(TOOL_CALLS_PREFIX + tool)
        if SANDBOX_METRIC in result.metrics:
            self.count("sandbox_runs")
            self.count("sandbox_errors", not result.ok)

    def action_counts(self) -> dict[str, float]:
        """The episode's ``Trajectory.actions``: {} for an agent that reports none."""
        if not (self.actions or self.tool_calls):
            return {}
        return {**self.actions, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors}

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def cut_segment(self, new_prompt_ids: list[int]) -> None:
        """Close the current segment as a snapshot and continue from ``new_prompt_ids``."""
        self.segments.append(self._segment(is_snapshot=True))
        self.prompt_ids = list(new_prompt_ids)
        self.response_ids, self.mask, self.logprobs, self.versions = [], [], [], []

    def _segment(self, *, is_snapshot: bool) -> Segment:
        return Segment(
            list(self.prompt_ids),
            list(self.response_ids),
            list(self.mask),
            list(self.logprobs),
            list(self.versions),
            is_snapshot,
        )

    def all_segments(self) -> list[Segment]:
        """The closed snapshots and the current (final) segment."""
        return [*self.segments, self._segment(is_snapshot=False)]

    def to_trajectories(
        self,
        *,
        reward: float,
        reward_extras: dict[str, Any],
        source_server: str,
        segment_rewards: Sequence[float] | None = None,
        keep: Sequence[int] | None = None,
    ) -> list[Trajectory]:
        """Segments (snapshots, then the final one) as trajectories: all of them sharing ``reward``,
        or the segments numbered in ``keep`` with ``segment_rewards[i]`` each. Ids and
        snapshot_index keep each segment's place in the episode."""
        if self.termination is None:
            raise IllegalTransition(f"episode {self.episode_id} is not terminated")
        segments = self.all_segments()
        rewards = list(segment_rewards) if segment_rewards is not None else [reward] * len(segments)
        if len(rewards) != len(segments):
            raise ValueError(f"{len(rewards)} segment rewards for {len(segments)} segments")
        chosen = sorted(set(keep)) if keep is not None else range(len(segments))
        timings = {**self.timings, "episode_s": time.monotonic() - self.started}
        # Episode-level counts go on the final segment only (always kept, see StateLM's
        # select_segments): on every segment they would count an episode once per kept snapshot,
        # and divided among them they would depend on which segments were kept.
        actions, final = self.action_counts(), len(segments) - 1
        return [
            Trajectory(
                trajectory_id=f"{self.episode_id}-{i}" if len(segments) > 1 else self.episode_id,
                group_uid=self.group_uid,
                prompt_ids=np.asarray(segments[i].prompt_ids, np.int32),
                response_ids=np.asarray(segments[i].response_ids, np.int32),
                response_mask=np.asarray(segments[i].mask, np.uint8),
                rollout_logprobs=np.asarray(segments[i].logprobs, np.float32),
                versions=np.asarray(segments[i].versions, np.int32),
                reward=float(rewards[i]),
                snapshot_index=i,
                is_snapshot=segments[i].is_snapshot,
                source_server=source_server,
                data_source=self.data_source,
                agent_type=self.agent_type,
                termination=self.termination,
                num_turns=self.turns,
                reward_extras=dict(reward_extras),
                timings=dict(timings),
                actions=dict(actions) if i == final else {},
            )
            for i in chosen
        ]
