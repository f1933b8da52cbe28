"""KL penalty in the reward, and the controllers of its coefficient (``algorithm.kl_ctrl``).

Design: the controllers subclass verl's (same update formula), add checkpoint state as plain
floats, and share one keyword constructor so a registry can build any of them from the config.
``apply_kl_in_reward`` is verl's ``apply_kl_penalty`` without DataProto and without the side
effect: it returns the KL the controller should see, and the trainer calls ``update`` itself
(so the update can be skipped on validation batches or done once per global batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo import core_algos

from common.registry import Registry
from learner.algorithms.losses import kl_penalty

__all__ = [
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "apply_kl_in_reward",
    "make_kl_controller",
]


class KLController(Protocol):
    """The coefficient beta of the KL penalty, updated once per training batch."""

    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: Mapping[str, float]) -> None: ...


class KLControllerFactory(Protocol):
    def __call__(self, *, kl_coef: float, target_kl: float, horizon: int) -> KLController: ...


KL_CONTROLLERS: Registry[KLControllerFactory] = Registry("KL controller")


@KL_CONTROLLERS.register("fixed")
class FixedKLController(core_algos.FixedKLController):
    """beta = kl_coef forever."""

    value: float

    def __init__(self, *, kl_coef: float, target_kl: float = 0.0, horizon: int = 0) -> None:
        super().__init__(kl_coef=float(kl_coef))

    def state_dict(self) -> dict[str, float]:
        return {"value": float(self.value)}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        # Deliberately ignored: a fixed beta is configuration, so a run resumed with an edited
        # kl_coef must use the new value rather than the checkpoint's.
        del state


@KL_CONTROLLERS.register("adaptive")
class AdaptiveKLController(core_algos.AdaptiveKLController):
    """beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon (Ziegler et al. 2019)."""

    value: float

    def __init__(self, *, kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL control needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}"
            )
        super().__init__(init_kl_coef=float(kl_coef), target_kl=float(target_kl), horizon=horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        super().update(current_kl=float(current_kl), n_steps=n_steps)
        self.value = float(self.value)  # verl's np.clip turns it into np.float64

    def state_dict(self) -> dict[str, float]:
        return {"value": float(self.value)}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


def make_kl_controller(type: str, kl_coef: float, target_kl: float, horizon: int) -> KLController:
    """Build the controller named by ``algorithm.kl_ctrl.type`` (fixed or adaptive)."""
    return KL_CONTROLLERS.get(type)(kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)


def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    controller: KLController,
    kl_penalty_kind: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards = scores - beta * KL(old || ref) per unmasked token; the caller updates ``controller``.

    Metrics: ``kl``, the batch mean of per-sequence mean KL (pass it to ``controller.update`` with
    ``n_steps`` = batch size, as verl does), and ``kl_coef``, the beta used here.
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_scores.dtype)
        kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_kind) * mask
        beta = float(controller.value)
        rewards = token_level_scores - beta * kld
        # verl's masked_mean: a fully masked sequence counts as KL 0 in the batch mean.
        current_kl = verl_F.masked_mean(kld, mask, axis=-1).mean().item()
    return rewards, {"kl": current_kl, "kl_coef": beta}
