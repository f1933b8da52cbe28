"""What a training worker is told at construction: the model, the optimizer, the loss and the
scheduler settings, as the trainer derives them from the config (`learner.run_settings.worker_settings`).

Design: a frozen dataclass of plain values that imports neither torch nor verl, so that the
trainer, the loss (`learner.update`) and the benches can name it without loading the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from learner.loss_settings import PolicyLossSettings


@dataclass(frozen=True)
class LoraSettings:
    """The actor's LoRA adapters (verl's ``actor_rollout_ref.model.lora_rank`` and its siblings;
    `learner.lora`). Lists are tuples so that the settings stay hashable and frozen."""

    rank: int
    alpha: int = 16
    target_modules: str | tuple[str, ...] = "all-linear"
    exclude_modules: str | tuple[str, ...] | None = None
    adapter_path: str | None = None  # a peft adapter directory the adapters start from

    @property
    def scaling(self) -> float:
        """What an adapter's B @ A is multiplied by (peft's ``lora_alpha / r``)."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class WorkerSettings:
    model_path: str
    device: str = "cpu"  # "cpu" or "cuda"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    param_offload: bool = False
    optimizer_offload: bool = False
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    warmup_steps: int = 0
    total_steps: int = 1
    lr_scheduler: str = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    policy_loss: PolicyLossSettings = field(default_factory=PolicyLossSettings)  # verl's modes
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    need_ref: bool = False
    critic_model_path: str | None = None  # None: no critic
    critic_lr: float = 1e-5
    critic_weight_decay: float = 0.01
    critic_grad_clip: float = 1.0
    cliprange_value: float = 0.5
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0: leave torch's default
    lora: LoraSettings | None = None  # None: the actor trains every weight
    keep_gathered: bool | None = (
        None  # FSDP2 parameters gathered through a step; None: by model size
    )
