"""AgentFly's ``agent.*`` keys and verl's differently named keys read as ours (common/config/aliases.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from common.config.aliases import ALIASES

BASE = ["actor_rollout_ref.model.path=m", "data.train_files=t.json"]


def test_agentfly_overrides_become_ours() -> None:
    config = load_config(
        None,
        [
            *BASE,
            "agent.agent_type=hf",
            "agent.tools=[calculator,python_executor,google_search]",
            "agent.template=qwen2.5",
            "agent.model_name_or_path=m",
            "agent.max_turns=3",
            "agent.backend=async_verl",
            "agent.reward_name=math_reward_string_equal",
            "agent.num_chains=8",
            "agent.use_agent=True",
            "agent.init_args.max_tokens_per_turn=48",
            "critic.model.path=m",
            "critic.ppo_mini_batch_size=32",
            "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        ],
        check_paths=False,
    )
    rollout = config.actor_rollout_ref.rollout
    assert config.data.agent_type == "tool_agent" and rollout.n == 8
    assert rollout.multi_turn.tools == ["calculator", "python", "search"]
    assert rollout.multi_turn.max_assistant_turns == 3 and rollout.multi_turn.enable
    assert rollout.multi_turn.max_tokens_per_turn == 48
    assert config.rollout_server.reward_fn == "math" and config.critic.model_path == "m"
    said = [a.describe() for a in config.applied_aliases]
    assert "agent.num_chains=8 -> actor_rollout_ref.rollout.n=8" in said
    assert "agent.reward_name=math_reward_string_equal -> rollout_server.reward_fn=math" in said
    assert "agent.max_tokens_per_turn=48 -> " in said[9]  # init_args.X is agent.X
    assert any(s.startswith("agent.template=qwen2.5: accepted, no effect here") for s in said)
    # Our own names pass through (the registries check them at --check).
    config = load_config(
        None, [*BASE, "agent.reward_name=qa_em", "agent.agent_type=statelm"], check_paths=False
    )
    assert config.rollout_server.reward_fn == "qa_em" and config.data.agent_type == "statelm"
    config = load_config(
        None, ["agent.model_name_or_path=0042", "data.train_files=t.json"], check_paths=False
    )
    assert config.actor_rollout_ref.model.path == "0042"  # the text, not the number 42


def test_agentfly_yaml_section_becomes_ours(tmp_path: Path) -> None:
    path = tmp_path / "agentfly.yaml"
    path.write_text(
        textwrap.dedent("""\
            actor_rollout_ref: {model: {path: m}}
            data: {train_files: t.json}
            agent:
              agent_type: code
              tools: [code_interpreter]
              num_chains: 2
              reward_name: code_reward
              init_args: {template: qwen2.5-no-tool}
            """)
    )
    config = load_config(path, ["agent.num_chains=6"], check_paths=False)
    assert config.data.agent_type == "code" and config.rollout_server.reward_fn == "code"
    assert config.actor_rollout_ref.rollout.n == 6  # the override wins over the file
    assert config.actor_rollout_ref.rollout.multi_turn.tools == ["python"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("agent.system_prompt=hi", "agent.system_prompt: AgentFly key with no equivalent here"),
        ("agent.init_args.gui_mode=1", "agent.gui_mode: AgentFly key with no equivalent here"),
        ("agent.backend=openai", "agent.backend: 'openai' has no equivalent here"),
        ("agent.num_chains=0", "actor_rollout_ref.rollout.n"),
    ],
)
def test_a_key_with_no_equivalent_is_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, override], check_paths=False)
    assert message in str(e.value) and f"command line override {override!r}" in str(e.value)


def test_an_alias_and_our_key_disagreeing_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.n: is set both here and by"):
        load_config(
            None, [*BASE, "agent.num_chains=8", "actor_rollout_ref.rollout.n=4"], check_paths=False
        )
    again = load_config(
        None, [*BASE, "agent.num_chains=8", "agent.num_chains=2"], check_paths=False
    )
    assert again.actor_rollout_ref.rollout.n == 2  # one spelling twice: the last wins
    agreed = load_config(
        None,
        [*BASE, "agent.model_name_or_path=m", "actor_rollout_ref.model.path=m"],
        check_paths=False,
    )
    assert agreed.actor_rollout_ref.model.path == "m"


def test_every_alias_target_is_a_key_of_ours() -> None:
    from common.config.loader import _annotation_at

    for alias in ALIASES.values():
        if alias.target is not None:
            assert _annotation_at(alias.target.split(".")) is not None, alias.key
