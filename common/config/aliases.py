"""Keys users bring from other frameworks, read as ours: AgentFly's ``agent.*`` overrides and the
few verl keys this config names differently.

Design: one table (``ALIASES``) of ``Alias`` entries, applied by the loader to the YAML tree and to
each override before validation (``apply_to_tree``, ``translate``), so everything downstream sees
only our keys. An alias either *renames* (``target``; with ``names``, AgentFly's reward, agent and
tool names become our registry names, others pass through and are checked by ``--check`` against
the registries), or is *accepted without effect* (``target`` None) when what it sets is how this
system works anyway, with the reason. ``agent.init_args.X`` is ``agent.X`` (AgentFly's two
spellings). Any other ``agent.*`` key is refused with an error that says it has no equivalent;
``--check`` prints what every alias became (``Applied.describe``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

AGENT_SECTION = "agent"
"""AgentFly's section; not a section of ours."""

REWARD_NAMES = {
    "math_reward": "math",
    "math_reward_string_equal": "math",
    "math_reward_tool": "math",
    "qa_f1_reward": "qa_f1",
    "qa_em_reward": "qa_em",
    "exact_match_reward": "qa_em",
    "code_reward": "code",
}
"""AgentFly reward name -> ours (rollout_service.rewards)."""

AGENT_NAMES = {
    "hf": "tool_agent",  # chat-template tool calls (hermes), as AgentFly's HF agent
    "react": "tool_agent",  # ReAct's thought/action loop with hermes tool calls
    "code": "code",
}
"""AgentFly agent type -> ours (rollout_service.agents)."""

TOOL_NAMES = {
    "python_executor": "python",
    "code_interpreter": "python",
    "code_executor": "python",
    "google_search": "search",
    "google_search_serper": "search",
    "dense_retrieve": "search",
    "calculator": "calculator",
    "answer": "answer",
}
"""AgentFly tool name -> ours (rollout_service.tools)."""


@dataclass(frozen=True)
class Alias:
    """One foreign key: what it becomes here."""

    key: str
    """The key as users write it (``agent.num_chains``)."""
    target: str | None
    """Our key; None: accepted without effect (``reason`` says why)."""
    names: Mapping[str, str] = field(default_factory=dict)
    """Foreign name -> ours, for values that name a registry entry (each item of a list)."""
    reason: str = ""
    """Why an alias without target needs nothing here."""
    allowed: tuple[Any, ...] | None = None
    """Values accepted for an alias without target; None: any."""

    def convert(self, value: Any) -> Any:
        if not self.names:
            return value
        if self.target is not None and self.target.endswith(".tools"):
            items = value if isinstance(value, list) else [value]
            return [self.names.get(v, v) if isinstance(v, str) else v for v in items]
        return self.names.get(value, value) if isinstance(value, str) else value


_MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"
_LEARNER_MICRO = (
    "the learner's forward passes use actor.ppo_micro_batch_size_per_gpu, or "
    "actor.ppo_max_token_len_per_gpu with actor.use_dynamic_bsz (the numbers do not change)"
)

ALIASES: dict[str, Alias] = {
    a.key: a
    for a in (
        Alias("agent.num_chains", "actor_rollout_ref.rollout.n"),
        Alias("agent.max_turns", f"{_MULTI_TURN}.max_assistant_turns"),
        Alias("agent.max_steps", f"{_MULTI_TURN}.max_assistant_turns"),
        Alias("agent.max_tokens_per_turn", f"{_MULTI_TURN}.max_tokens_per_turn"),
        Alias("agent.tools", f"{_MULTI_TURN}.tools", TOOL_NAMES),
        Alias("agent.use_agent", f"{_MULTI_TURN}.enable"),
        Alias("agent.reward_name", "rollout_server.reward_fn", REWARD_NAMES),
        Alias("agent.agent_type", "data.agent_type", AGENT_NAMES),
        Alias("agent.model_name_or_path", "actor_rollout_ref.model.path"),
        Alias(
            "agent.template",
            None,
            reason="prompts are rendered with the model's own chat template (its tokenizer's)",
        ),
        Alias(
            "agent.backend",
            None,
            reason="rollout servers always run async agent loops on vLLM",
            allowed=("async_verl", "async_vllm", "verl"),
        ),
        Alias(
            "reward.reward_manager.name",
            None,
            reason="episodes are scored by the rollout servers (rollout_server.reward_fn); DAPO's "
            "over-long shaping is reward.reward_kwargs.overlong_buffer_cfg",
            allowed=("naive", "dapo"),
        ),
        Alias("critic.model.path", "critic.model_path"),
        Alias(
            "critic.ppo_mini_batch_size",
            None,
            reason="the critic is updated on the actor's mini-batches (actor.ppo_mini_batch_size)",
        ),
        Alias(
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
            None,
            reason=_LEARNER_MICRO,
        ),
        Alias(
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", None, reason=_LEARNER_MICRO
        ),
    )
}
"""Foreign key -> what it becomes (docs/rollout-server.md has the table)."""


class AliasError(ValueError):
    """A foreign key with no equivalent, or a value an alias refuses; the message says which."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Applied:
    """One alias applied: the key and value as given, and what they became."""

    key: str
    value: Any
    target: str | None
    converted: Any
    reason: str = ""

    def describe(self) -> str:
        given = f"{self.key}={_show(self.value)}"
        if self.target is None:
            return f"{given}: accepted, no effect here: {self.reason}"
        return f"{given} -> {self.target}={_show(self.converted)}"


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def canonical(parts: Sequence[str]) -> str:
    """The dotted key, with AgentFly's ``agent.init_args.X`` spelled ``agent.X``."""
    parts = list(parts)
    if parts[:2] == [AGENT_SECTION, "init_args"]:
        parts = [AGENT_SECTION, *parts[2:]]
    return ".".join(parts)


def is_foreign(parts: Sequence[str]) -> bool:
    """Whether the loader must translate this key (an alias, or anything under ``agent``)."""
    return bool(parts) and (parts[0] == AGENT_SECTION or canonical(parts) in ALIASES)


def translate(parts: Sequence[str], value: Any) -> Applied:
    """What the foreign key ``parts`` set to ``value`` becomes; ``AliasError`` when it has no
    equivalent or the value is refused."""
    key = canonical(parts)
    alias = ALIASES.get(key)
    if alias is None:
        known = ", ".join(k for k in ALIASES if k.startswith(AGENT_SECTION + "."))
        raise AliasError(
            key,
            f"AgentFly key with no equivalent here (not applied; the AgentFly keys read are "
            f"{known})",
        )
    if alias.target is None and alias.allowed is not None and value not in alias.allowed:
        raise AliasError(
            key,
            f"{value!r} has no equivalent here ({alias.reason}; accepted: "
            f"{', '.join(map(str, alias.allowed))})",
        )
    return Applied(key, value, alias.target, alias.convert(value), alias.reason)


def foreign_keys_in_tree(tree: Mapping[str, Any]) -> list[tuple[list[str], Any]]:
    """The foreign keys a YAML tree sets (the whole ``agent`` section, and the aliases of verl keys),
    as (parts, value), in the tree's order."""
    found: list[tuple[list[str], Any]] = []

    def walk(node: Any, parts: list[str]) -> None:
        if not isinstance(node, dict):
            return
        for k, v in node.items():
            here = [*parts, str(k)]
            if canonical(here) in ALIASES:
                found.append((here, v))
            elif here[0] == AGENT_SECTION and not isinstance(v, dict):
                found.append((here, v))
            else:
                walk(v, here)

    walk(tree, [])
    return found


def remove_key(tree: dict[str, Any], parts: Sequence[str]) -> None:
    """Delete a key from a raw tree, and the sections it leaves empty."""
    node: Any = tree
    chain: list[tuple[dict[str, Any], str]] = []
    for part in parts[:-1]:
        chain.append((node, part))
        node = node[part]
    del node[parts[-1]]
    for parent, part in reversed(chain):
        if parent[part] in ({}, None):
            del parent[part]
        else:
            break
