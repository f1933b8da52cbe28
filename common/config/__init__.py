"""Typed configuration shared by the learner and the rollout servers.

Design: one root `Config` (verl's section and key names) made of strict pydantic sections that
reject unknown keys; `load_config` reads a YAML file, applies dotted `key=value` overrides and
validates once, raising a `ConfigError` that names the file or override, the dotted key and the
fault for every problem found. Modules: `base` (section base class), `actor_rollout_ref`,
`training` (algorithm, critic, data, trainer, ray), `services` (rollout_server, learner, transport,
logging), `agents` (agents, tools, tool_server), `launch` (bin/train), `root` (Config and
cross-section rules), `errors`, `loader`.
"""

from common.config.actor_rollout_ref import (
    ActorConfig,
    ActorRolloutRefConfig,
    ModelConfig,
    MultiTurnConfig,
    RolloutConfig,
)
from common.config.agents import (
    AgentsConfig,
    CodeAgentConfig,
    RateLimit,
    RateLimitsConfig,
    RemoteToolsConfig,
    SearchToolConfig,
    StateLMConfig,
    ToolsConfig,
    ToolServerConfig,
)
from common.config.errors import ConfigError, Issue
from common.config.launch import LaunchConfig
from common.config.loader import dump_config, load_config, parse_override
from common.config.root import Config, consistency_issues
from common.config.services import (
    CurveConfig,
    LearnerConfig,
    LoggingConfig,
    RolloutServerConfig,
    TransportConfig,
)
from common.config.training import (
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    DatasetConfig,
    RayConfig,
    TrainerConfig,
)

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AgentsConfig",
    "AlgorithmConfig",
    "CodeAgentConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "CurveConfig",
    "DataConfig",
    "DatasetConfig",
    "Issue",
    "LaunchConfig",
    "LearnerConfig",
    "LoggingConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "RateLimit",
    "RateLimitsConfig",
    "RayConfig",
    "RemoteToolsConfig",
    "RolloutConfig",
    "RolloutServerConfig",
    "SearchToolConfig",
    "StateLMConfig",
    "ToolServerConfig",
    "ToolsConfig",
    "TrainerConfig",
    "TransportConfig",
    "consistency_issues",
    "dump_config",
    "load_config",
    "parse_override",
]
