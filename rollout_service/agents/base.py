"""What every agent loop shares: its limits, its dependencies, and the model-turn step.

Design: an agent is a class registered by name in ``AGENTS`` with one method, ``run(episode)``,
that drives the episode's state machine to TERMINATED. Everything an agent touches comes in
``AgentDeps`` (engine, renderer, tools, parser, limits), so unit tests drive agents with a scripted
engine and the server with vLLM, through the same code. ``generate_turn`` is the one place that
turns limits into a token budget and handles the engine's finish reasons, so every agent
terminates for the same reasons the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from common.registry import Registry
from rollout_service.agents.episode import Episode, State
from rollout_service.agents.parsers import ToolCallParser
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.engine.base import Generation, SamplingEngine, SamplingSettings


@dataclass(frozen=True)
class AgentLimits:
    response_length: int  # model + tool tokens of one episode (segment)
    max_model_len: int  # prompt + response must fit the engine's context
    max_tokens_per_turn: int | None = None
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256  # characters
    tool_response_truncate_side: str = "middle"
    max_consecutive_tool_errors: int = 3
    tool_timeout_s: float = 30.0


@dataclass
class AgentDeps:
    engine: SamplingEngine
    renderer: ChatRenderer
    sampling: SamplingSettings  # max_tokens is replaced per turn
    limits: AgentLimits
    tools: dict[str, Any] = field(default_factory=dict)  # name -> Tool
    parser: ToolCallParser | None = None
    system_prompt: str | None = None
    options: Any = (
        None  # the agent's own config section (agents.statelm, agents.code); None: defaults
    )


def source_deps_key(agent_type: str, data_source: str) -> str:
    """Where ``build_agent_deps`` keeps the deps of a source that names its own tools
    (``data.datasets[].tools``); the agents' own are under their type."""
    return f"{agent_type}@{data_source}"


def deps_for(deps: Mapping[str, AgentDeps], agent_type: str, data_source: str) -> AgentDeps:
    """The deps a row runs with: its source's own tools where it names them, else its agent's."""
    return deps.get(source_deps_key(agent_type, data_source)) or deps[agent_type]


class Agent(Protocol):
    def __init__(self, deps: AgentDeps) -> None: ...

    async def run(self, ep: Episode) -> None:
        """Drive ``ep`` from PENDING to TERMINATED."""
        ...


AGENTS: Registry[type] = Registry("agent type")


def initial_messages(row: dict[str, Any], system_prompt: str | None) -> list[dict[str, Any]]:
    """The conversation an episode starts from: the row's own ``messages``, else its question."""
    if isinstance(row.get("messages"), list) and row["messages"]:
        return [dict(m) for m in row["messages"]]
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": str(row["question"])})
    return messages


def start(ep: Episode, deps: AgentDeps, tools: list[dict[str, Any]] | None = None) -> bool:
    """PENDING -> GENERATING with the rendered prompt; False (terminated: length) if it cannot fit."""
    ep.messages = initial_messages(ep.row, deps.system_prompt)
    ep.prompt_ids = deps.renderer.prompt_ids(ep.messages, tools)
    if len(ep.prompt_ids) >= deps.limits.max_model_len:
        ep.terminate("length")
        return False
    ep.goto(State.GENERATING)
    return True


def turn_budget(ep: Episode, limits: AgentLimits) -> int:
    budget = min(
        limits.response_length - len(ep.response_ids), limits.max_model_len - ep.context_len
    )
    if limits.max_tokens_per_turn is not None:
        budget = min(budget, limits.max_tokens_per_turn)
    return budget


async def generate_turn(ep: Episode, deps: AgentDeps) -> Generation | None:
    """One model turn appended to the episode (mask 1). None when the episode terminated instead
    (no budget left, the engine aborted, the turn hit a length limit)."""
    budget = turn_budget(ep, deps.limits)
    if budget <= 0:
        ep.terminate("length")
        return None
    sampling = replace(deps.sampling, max_tokens=budget, kv_scope=ep.kv_scope)
    gen = await deps.engine.generate(
        f"{ep.episode_id}-t{ep.turns}", ep.prompt_ids + ep.response_ids, sampling
    )
    ep.turns += 1
    ep.add_model(gen.token_ids, gen.logprobs, gen.versions)
    for k, v in gen.timings.items():
        ep.timings[k] = ep.timings.get(k, 0.0) + v
    if gen.finish_reason == "abort":
        ep.terminate("aborted")
        return None
    if gen.finish_reason == "length":
        ep.terminate("length")
        return None
    ended_by_string = gen.stop_string is not None  # mid-turn stop (code agent): the turn goes on
    unclosed = not gen.token_ids or gen.token_ids[-1] != deps.renderer.eos_id
    if not ended_by_string and unclosed and turn_budget(ep, deps.limits) > 0:
        # The turn ended without the template's end-of-turn token (the engine did not return it,
        # or the model stopped on another end token such as <|endoftext|>): the template still
        # needs the turn closed before anything follows. Appended as context (mask 0): the model
        # did not sample it. Not when the turn used the last of the budget: nothing can follow
        # then, and one token more would break the response limit the learner enforces (it
        # refuses the whole batch as TOO_LARGE).
        ep.add_tool([deps.renderer.eos_id])
    return gen
