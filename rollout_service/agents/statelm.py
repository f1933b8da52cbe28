"""The StateLM agent: a tool agent that manages its own context and yields one trajectory per segment.

Design (seed 004): the loop is the tool agent's (generate, parse, call, respond); what differs is
the context. It is rendered from a ``StateLMContext`` (ids on every message, notes, documents)
instead of the data row, and a turn that deletes messages ends a *segment*: the tokens since the
last snapshot (model turns mask 1, tool turns mask 0) become a snapshot trajectory whose prompt is
the context they were generated from, and the next segment's prompt is the re-rendered, shorter
context, which already holds this turn's tool responses. Only the response tokens are ever
trained, and they are the engine's own ids; re-rendering only ever produces prompts.

Rewards: the final segment's episode is scored once; the score is shaped (an episode cut off by
length gets ``length_penalty``; one with fewer than ``min_turns`` model turns gets
``min_turns_penalty`` added) and put on every kept segment (``broadcast``) or only on the final
one (``last_only``). At most ``max_segments`` segments are kept: the last ones, or random
snapshots plus the final segment, chosen by a generator seeded from the episode id so a rerun
keeps the same ones. All segments share the group uid, so GRPO groups have variable size.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

from common.config.agents import StateLMConfig
from protocol.trajectory import Trajectory
from rollout_service.agents.base import AGENTS, AgentDeps
from rollout_service.agents.episode import Episode, State
from rollout_service.agents.parsers import ParsedTurn
from rollout_service.agents.statelm_context import StateLMContext, documents_of
from rollout_service.agents.tool_agent import ToolAgent, append_tool_turn
from rollout_service.rewards.base import RewardResult
from rollout_service.tools.base import ToolResult

SYSTEM_PROMPT = (
    "You solve the task with tools and manage your own context. Every message has a msg_id. "
    "Read long documents chunk by chunk (loadDocument, readChunk), keep what matters in notes "
    "(note, readNote, updateNote), and delete messages you no longer need with deleteContext(msg_id) "
    "to free space; deleted messages become short stubs. checkBudget tells you what is left. "
    "End with finish(answer)."
)


def select_segments(n: int, limit: int | None, how: str, rng: random.Random) -> list[int]:
    """Indices of the segments to keep out of ``n`` (the final one, n-1, is always kept)."""
    if limit is None or n <= limit:
        return list(range(n))
    if how == "last":
        return list(range(n - limit, n))
    return [*sorted(rng.sample(range(n - 1), limit - 1)), n - 1]


@AGENTS.register("statelm")
class StateLMAgent(ToolAgent):
    def __init__(self, deps: AgentDeps) -> None:
        super().__init__(deps)
        self.options: StateLMConfig = deps.options if deps.options is not None else StateLMConfig()

    @staticmethod
    def context(ep: Episode) -> StateLMContext:
        return ep.tool_state["statelm"]

    def begin(self, ep: Episode) -> bool:
        ep.expect_actions("snapshots", "deletions")
        sl = StateLMContext(
            self.deps.system_prompt or SYSTEM_PROMPT, str(ep.row["question"]), documents_of(ep.row)
        )
        ep.tool_state["statelm"] = sl
        ep.messages = sl.render()
        ep.prompt_ids = self.deps.renderer.prompt_ids(ep.messages, self.schemas)
        if len(ep.prompt_ids) >= self.deps.limits.max_model_len:
            ep.terminate("length")
            return False
        ep.goto(State.GENERATING)
        return True

    def on_assistant(self, ep: Episode, text: str, parsed: ParsedTurn) -> None:
        sl, limits = self.context(ep), self.deps.limits
        sl.current_assistant = sl.add("assistant", text, calls=list(parsed.calls)).msg_id
        ep.messages.append({"role": "assistant", "content": text})
        tokens_left = min(
            limits.max_model_len - ep.context_len, limits.response_length - len(ep.response_ids)
        )
        turns = [
            t - ep.turns
            for t in (limits.max_assistant_turns, limits.max_user_turns)
            if t is not None
        ]
        sl.budget = {
            "tokens_left": max(0, tokens_left),
            "context_tokens": ep.context_len,
            **({"turns_left": max(0, min(turns))} if turns else {}),
            "segments_so_far": len(ep.segments) + 1,
        }

    def continue_after_tools(self, ep: Episode, answered: list[tuple[str, ToolResult]]) -> bool:
        sl = self.context(ep)
        added = [
            sl.add(
                "tool",
                self.response_text(r),
                tool=name or "(unparsed call)",
                call_msg_id=sl.current_assistant,
            )
            for name, r in answered
        ]
        if not sl.deleted_this_turn:
            return append_tool_turn(
                ep, self.deps, [{"role": "tool", "content": sl.tool_content(m)} for m in added]
            )
        # A deletion: close this segment and continue from the re-rendered context, which holds
        # this turn's tool responses (so they are prompt, not response, of the next segment).
        sl.deleted_this_turn.clear()
        ep.messages.extend({"role": "tool", "content": sl.tool_content(m)} for m in added)
        prompt = self.deps.renderer.prompt_ids(sl.render(), self.schemas)
        if len(prompt) >= self.deps.limits.max_model_len:
            ep.terminate("length")
            return False
        ep.cut_segment(prompt)
        return True

    # -- trajectories ------------------------------------------------------------------------------
    def shaped_reward(self, ep: Episode, score: float) -> float:
        o = self.options
        reward = o.length_penalty if ep.termination == "length" else score
        if ep.turns < o.min_turns:
            reward += o.min_turns_penalty
        return reward

    def trajectories(self, ep: Episode, result: RewardResult, server_id: str) -> list[Trajectory]:
        o = self.options
        n = len(ep.segments) + 1
        reward = self.shaped_reward(ep, result.score)
        rewards = [reward] * n if o.reward_split == "broadcast" else [0.0] * (n - 1) + [reward]
        # Episode facts, counted once: every closed segment is a snapshot (kept or not), and a
        # deleted message stays in the history as a stub, whichever turn deleted it.
        ep.actions["snapshots"] = n - 1
        sl = ep.tool_state.get("statelm")
        ep.actions["deletions"] = sum(m.deleted for m in sl.history) if sl is not None else 0
        rng = random.Random(zlib.crc32(ep.episode_id.encode()))
        keep = select_segments(n, o.max_segments, o.segment_selection, rng)
        extras: dict[str, Any] = {
            **result.extras,
            "score": result.score,
            "segments": n,
            "segments_kept": len(keep),
        }
        return ep.to_trajectories(
            reward=reward,
            reward_extras=extras,
            source_server=server_id,
            segment_rewards=rewards,
            keep=keep,
        )
