"""The root `Config` shared by the learner and the rollout servers, and its cross-section checks.

Design: one config for both sides (like verl's single config), so a run is described by one file
and both ends agree on every shared limit. Field-level rules live on the sections; rules that
compare sections live here, in `consistency_issues`, which reports every violation with the key to
change. They run as the root's after-validator, so a `Config` built in code is checked as well as
one loaded from YAML. Filesystem checks (the model directory exists) run only when the validation
context asks for them (`{"check_paths": True}`), because tests and tools build configs for paths
that exist only on another machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, PrivateAttr, ValidationInfo, model_validator

from common.config.actor_rollout_ref import ActorRolloutRefConfig
from common.config.agents import AgentsConfig, ToolsConfig, ToolServerConfig
from common.config.base import Section
from common.config.errors import ConfigError, Issue
from common.config.launch import LaunchConfig
from common.config.reward import RewardConfig
from common.config.services import (
    CURVE_REQUIRED_FIELDS,
    LearnerConfig,
    LoggingConfig,
    RolloutServerConfig,
    TransportConfig,
)
from common.config.training import (
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    RayConfig,
    TrainerConfig,
)
from protocol.adapters import ADAPTER_CONFIG, ADAPTER_FILE


class Config(Section):
    """Everything a learner or a rollout server needs to run."""

    actor_rollout_ref: ActorRolloutRefConfig
    """Policy model, actor update, rollout sampling, reference model."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """Value model (GAE only)."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimation and KL."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Shaping of the scored rewards (over-long penalty)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation data."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Run length, checkpoints, metrics, hardware."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Ray cluster of the learner."""
    rollout_server: RolloutServerConfig = Field(default_factory=RolloutServerConfig)
    """Rollout server process."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """Learner process (network side)."""
    transport: TransportConfig = Field(default_factory=TransportConfig)
    """Learner <-> rollout server protocol limits."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Log format and level."""
    agents: AgentsConfig = Field(default_factory=AgentsConfig)
    """Options of the agent loops (StateLM, code agent)."""
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    """Tool options, remote tools and rate limits."""
    tool_server: ToolServerConfig = Field(default_factory=ToolServerConfig)
    """bin/tool-server."""
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    """bin/train: the processes of a whole job on this machine."""
    _applied_aliases: list[Any] = PrivateAttr(default_factory=list)

    @property
    def applied_aliases(self) -> list[Any]:
        """The foreign keys the loader read as ours (``common.config.aliases.Applied``), for
        ``--check`` to print; not part of the config itself (never dumped)."""
        return self._applied_aliases

    @applied_aliases.setter
    def applied_aliases(self, value: list[Any]) -> None:
        self._applied_aliases = list(value)

    @model_validator(mode="after")
    def _resolve_and_check(self, info: ValidationInfo) -> Config:
        rollout, data = self.actor_rollout_ref.rollout, self.data
        # verl interpolates these from data.*; resolving here makes the saved config explicit.
        if rollout.prompt_length is None:
            rollout.prompt_length = data.max_prompt_length
        if rollout.response_length is None:
            rollout.response_length = data.max_response_length
        correction = self.algorithm.rollout_correction
        if correction.bypass_mode:
            # verl's apply_bypass_mode: the rollout's logprobs are pi_old, and the loss is bypass's
            actor = self.actor_rollout_ref.actor
            actor.off_policy.old_logprobs = "rollout"
            actor.policy_loss.loss_mode = "bypass_mode"
        check_paths = bool((info.context or {}).get("check_paths", False))
        issues = consistency_issues(self, check_paths=check_paths)
        if issues:
            raise ConfigError(issues)
        return self


def consistency_issues(config: Config, *, check_paths: bool = False) -> list[Issue]:
    """Every cross-section rule `config` breaks (empty when it is consistent)."""
    arr, data, trainer = config.actor_rollout_ref, config.data, config.trainer
    actor, rollout = arr.actor, arr.rollout
    issues: list[Issue] = []

    def add(key: str, message: str, *related: str) -> None:
        issues.append(Issue(key, message, related=related))

    samples = data.train_batch_size * rollout.n
    mini = actor.ppo_mini_batch_size
    if mini > samples or samples % mini:
        add(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"must divide data.train_batch_size * actor_rollout_ref.rollout.n = {samples} (got {mini})",
            "data.train_batch_size",
            "actor_rollout_ref.rollout.n",
        )
    assert rollout.prompt_length is not None and rollout.response_length is not None
    if rollout.prompt_length < data.max_prompt_length:
        add(
            "actor_rollout_ref.rollout.prompt_length",
            f"must be at least data.max_prompt_length = {data.max_prompt_length} "
            f"(got {rollout.prompt_length})",
            "data.max_prompt_length",
        )
    if rollout.max_model_len is not None:
        needed = rollout.prompt_length + rollout.response_length
        if needed > rollout.max_model_len:
            add(
                "actor_rollout_ref.rollout.max_model_len",
                f"must hold prompt_length + response_length = {needed} (got {rollout.max_model_len})",
                "actor_rollout_ref.rollout.prompt_length",
                "actor_rollout_ref.rollout.response_length",
                "data.max_prompt_length",
                "data.max_response_length",
            )
    if config.algorithm.adv_estimator == "gae" and not config.critic.enable:
        add(
            "critic.enable",
            "must be true when algorithm.adv_estimator is gae",
            "algorithm.adv_estimator",
        )
    correction = config.algorithm.rollout_correction
    off = actor.off_policy
    if correction.active and (off.is_level != "token" or off.is_cap != 2.0):
        # compared with the defaults, not with the keys set, so that a dumped config loads back
        add(
            "actor_rollout_ref.actor.off_policy.is_level",
            "leave is_level and is_cap at their defaults with algorithm.rollout_correction (its "
            "rollout_is and rollout_is_threshold replace them)",
            "actor_rollout_ref.actor.off_policy.is_cap",
            "algorithm.rollout_correction.rollout_is",
        )
    overlong = config.reward.reward_kwargs.overlong_buffer_cfg
    if overlong.enable:
        key = "reward.reward_kwargs.overlong_buffer_cfg.len"
        max_resp_len = config.reward.reward_kwargs.max_resp_len or data.max_response_length
        if overlong.len <= 0:
            add(key, "must be > 0 when overlong_buffer_cfg.enable is true (got 0)")
        elif overlong.len > max_resp_len:
            add(
                key,
                f"must be at most the max response length {max_resp_len} (got {overlong.len})",
                "reward.reward_kwargs.max_resp_len",
                "data.max_response_length",
            )
    if config.rollout_server.prompt_memory.last_k and data.datasets:
        add(
            "rollout_server.prompt_memory.last_k",
            "must be 0 with data.datasets: mixed batches hold exact counts per source, and a "
            "skipped prompt would leave its place empty",
            "data.datasets",
        )
    if data.datasets and data.train_files:
        add(
            "data.train_files",
            "must be empty when data.datasets is set (datasets name their own paths)",
            "data.datasets",
        )
    if not data.datasets and not data.train_files:
        add(
            "data.train_files",
            "no training data: set data.train_files or data.datasets",
            "data.datasets",
        )
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        add(
            "trainer.resume_from_path",
            "required when trainer.resume_mode is resume_path",
            "trainer.resume_mode",
        )

    server = config.rollout_server
    if server.shard_index >= server.shard_count:
        add(
            "rollout_server.shard_index",
            f"must be below rollout_server.shard_count = {server.shard_count} (got {server.shard_index})",
            "rollout_server.shard_count",
        )

    transport = config.transport
    if transport.heartbeat_timeout_s <= transport.heartbeat_interval_s:
        add(
            "transport.heartbeat_timeout_s",
            f"must exceed transport.heartbeat_interval_s = {transport.heartbeat_interval_s:g} "
            f"(got {transport.heartbeat_timeout_s:g})",
            "transport.heartbeat_interval_s",
        )
    if transport.weight_chunk_bytes > transport.max_message_bytes:
        add(
            "transport.weight_chunk_bytes",
            f"must be at most transport.max_message_bytes = {transport.max_message_bytes} "
            f"(got {transport.weight_chunk_bytes})",
            "transport.max_message_bytes",
        )
    curve = transport.curve
    if curve.enabled:
        for name in CURVE_REQUIRED_FIELDS:
            value = getattr(curve, name)
            if not value:
                add(
                    f"transport.curve.{name}",
                    "required when transport.curve.enabled is true",
                    "transport.curve.enabled",
                )
            elif check_paths and not Path(value).exists():
                add(f"transport.curve.{name}", f"does not exist: {value}")
    if transport.auth == "curve" and not curve.enabled:
        add(
            "transport.auth", "curve needs transport.curve.enabled: true", "transport.curve.enabled"
        )
    elif transport.auth in ("token", "none") and curve.enabled:
        # One security mechanism per ZeroMQ socket: CURVE already authenticates every peer.
        add(
            "transport.auth",
            f"{transport.auth} cannot be combined with transport.curve.enabled (CURVE "
            "authenticates peers itself): use auto or curve",
            "transport.curve.enabled",
        )

    if (adapter := arr.model.lora_adapter_path) is not None:
        key = "actor_rollout_ref.model.lora_adapter_path"
        if arr.model.lora_rank == 0:
            add(
                key,
                "needs actor_rollout_ref.model.lora_rank > 0",
                "actor_rollout_ref.model.lora_rank",
            )
        elif arr.model.lora.merge:
            add(
                key,
                "cannot be combined with lora.merge true: merge the adapter into the model (peft's "
                "merge_and_unload) and set actor_rollout_ref.model.path to it",
                "actor_rollout_ref.model.lora.merge",
            )
        elif check_paths:
            for name in (ADAPTER_FILE, ADAPTER_CONFIG):  # what learner.lora.load_adapter reads
                if not (Path(adapter) / name).is_file():
                    add(key, f"no {name} in {adapter}")
    if check_paths:
        model_path = Path(arr.model.path)
        if not model_path.exists():
            add("actor_rollout_ref.model.path", f"directory does not exist: {model_path}")
        elif not model_path.is_dir():
            add("actor_rollout_ref.model.path", f"not a directory: {model_path}")
    return issues
