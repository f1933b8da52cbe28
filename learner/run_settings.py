"""From the config to what the trainer's workers are told (`learner.worker_settings.WorkerSettings`),
and the check a resumed run makes against the adapters its checkpoint was trained with.

Design: pure functions of config sections and checkpoint state, with no worker, Ray or torch
device in them (the device's ``auto`` asks torch whether CUDA is there); the trainer calls them
once at start-up, and tests call them without starting anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.config.actor_rollout_ref import ModelConfig
from common.config.errors import ConfigError, Issue
from common.config.root import Config
from learner.loss_settings import policy_loss_settings
from learner.worker_settings import LoraSettings, WorkerSettings


def worker_settings(config: Config, total_steps: int) -> WorkerSettings:
    arr, critic, trainer = config.actor_rollout_ref, config.critic, config.trainer
    actor, optim = arr.actor, arr.actor.optim
    warmup = (
        optim.lr_warmup_steps
        if optim.lr_warmup_steps >= 0
        else int(optim.lr_warmup_steps_ratio * total_steps)
    )
    device = trainer.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return WorkerSettings(
        model_path=arr.model.path,
        device=device,
        trust_remote_code=arr.model.trust_remote_code,
        gradient_checkpointing=arr.model.enable_gradient_checkpointing,
        param_offload=actor.fsdp_config.param_offload,
        optimizer_offload=actor.fsdp_config.optimizer_offload,
        lr=optim.lr,
        betas=(optim.betas[0], optim.betas[1]),
        weight_decay=optim.weight_decay,
        warmup_steps=warmup,
        total_steps=total_steps,
        lr_scheduler=optim.lr_scheduler,
        min_lr_ratio=optim.min_lr_ratio,
        grad_clip=actor.grad_clip,
        temperature=arr.rollout.temperature,
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        loss_agg_mode=actor.loss_agg_mode,
        policy_loss=policy_loss_settings(actor, config.algorithm.rollout_correction),
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        need_ref=actor.use_kl_loss or config.algorithm.use_kl_in_reward,
        critic_model_path=(critic.model_path or arr.model.path) if critic.enable else None,
        critic_lr=critic.optim.lr,
        critic_weight_decay=critic.optim.weight_decay,
        critic_grad_clip=critic.grad_clip,
        cliprange_value=critic.cliprange_value,
        seed=trainer.seed,
        lora=lora_settings(arr.model),
    )


def lora_settings(model: ModelConfig) -> LoraSettings | None:
    """The actor's adapters as verl's keys ask for them; None with ``lora_rank`` 0."""
    if model.lora_rank == 0:
        return None

    def patterns(value: str | list[str]) -> str | tuple[str, ...]:
        return value if isinstance(value, str) else tuple(value)

    return LoraSettings(
        rank=model.lora_rank,
        alpha=model.lora_alpha,
        target_modules=patterns(model.target_modules),
        exclude_modules=None if model.exclude_modules is None else patterns(model.exclude_modules),
        adapter_path=model.lora_adapter_path,
    )


def lora_record(s: LoraSettings | None) -> dict[str, Any] | None:
    """The adapters a checkpoint was trained with, as its state records them."""
    if s is None:
        return None
    return {
        "lora_rank": s.rank,
        "lora_alpha": s.alpha,
        "target_modules": s.target_modules,
        "exclude_modules": s.exclude_modules,
    }


def check_lora_resume(state: dict[str, Any], lora: LoraSettings | None, path: Path | None) -> None:
    """A checkpoint resumes only under the adapters it was trained with: its sharded state holds
    exactly those tensors, and its policy is base + that adapter. Checkpoints that predate the
    record are not checked."""
    if "lora" not in state:
        return
    saved, now = state["lora"], lora_record(lora)
    if isinstance(saved, dict):  # msgpack brings tuples back as lists
        saved = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
    if saved == now:
        return
    key = "actor_rollout_ref.model"
    differ = (
        [k for k in (saved or {}) if (saved or {}).get(k) != (now or {}).get(k)]
        if saved and now
        else ["lora_rank"]
    )
    raise ConfigError(
        [
            Issue(
                f"{key}.{differ[0]}",
                f"the checkpoint {path} was trained with "
                f"{saved or 'no LoRA adapters (lora_rank 0)'}, this run asks for "
                f"{now or 'no LoRA adapters (lora_rank 0)'}: resume with the checkpoint's "
                f"settings, or start a new run (trainer.resume_mode=disable)",
                source=str(path) if path else None,
            )
        ]
    )
