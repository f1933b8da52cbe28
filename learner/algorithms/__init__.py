"""The learner's RL algorithms as pure torch functions on [B, T] tensors (CPU-testable).

Design: `advantages` (estimators by registry name), `losses` (policy/value/KL losses, their
aggregation with global counts, truncated importance weights), `policy_losses` (verl's policy
losses by ``loss_mode``) and `kl` (KL in the reward and its
coefficient controllers). verl's `core_algos` supplies the numbers wherever it has them; what is
our own is tested against verl. Importing this package imports verl (~7 s): do it in worker and
trainer processes, not in CLIs.
"""

from learner.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageFn,
    MissingAdvantageInput,
    compute_advantages,
)
from learner.algorithms.kl import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_in_reward,
    make_kl_controller,
)
from learner.algorithms.losses import (
    KL_PENALTY_KINDS,
    LOSS_AGG_MODES,
    LossAggMode,
    LossNorm,
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    ppo_policy_loss,
    truncated_is_weights,
    value_loss,
)
from learner.algorithms.policy_losses import (
    POLICY_LOSS_MODES,
    PolicyLossSettings,
    policy_loss,
    verl_actor_config,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_CONTROLLERS",
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_MODES",
    "AdaptiveKLController",
    "AdvantageFn",
    "FixedKLController",
    "KLController",
    "LossAggMode",
    "LossNorm",
    "MissingAdvantageInput",
    "PolicyLossSettings",
    "agg_loss",
    "apply_kl_in_reward",
    "compute_advantages",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "policy_loss",
    "ppo_policy_loss",
    "truncated_is_weights",
    "value_loss",
    "verl_actor_config",
]
