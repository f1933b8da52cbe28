"""The `actor_rollout_ref` section: the policy model, its trainer (actor), its sampler (rollout) and
the frozen reference model.

Design: key names and meanings follow verl's `actor_rollout_ref` so that verl recipes translate
key for key. Checks that involve a single section live here as field constraints; checks that
compare sections (mini-batch size against the data batch size, prompt lengths) live in `root.py`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.base import Section

KlType = Literal["kl", "abs", "mse", "low_var_kl"]


class ModelConfig(Section):
    """The Hugging Face model that the actor, the reference and the rollout engine load."""

    path: str = Field(min_length=1)
    """Local directory of the Hugging Face model (config, tokenizer, safetensors). Required; a run
    and `--check` refuse a directory that does not exist."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of the actor to save memory."""
    trust_remote_code: bool = False
    """Allow model/tokenizer code shipped with the checkpoint to run (Hugging Face option)."""


class OptimConfig(Section):
    """AdamW settings of the actor."""

    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    lr_warmup_steps: int = Field(-1, ge=-1)
    """Linear warm-up steps; -1 means use lr_warmup_steps_ratio instead."""
    lr_warmup_steps_ratio: float = Field(0.0, ge=0, le=1)
    """Warm-up length as a fraction of the total training steps (used when lr_warmup_steps is -1)."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW weight decay."""
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999], min_length=2, max_length=2)
    """AdamW (beta1, beta2)."""


class FsdpConfig(Section):
    """FSDP2 offloading switches of the actor."""

    param_offload: bool = False
    """Keep parameters on the CPU between uses."""
    optimizer_offload: bool = False
    """Keep optimizer state on the CPU between steps."""


class ActorConfig(Section):
    """PPO-style policy update of the actor."""

    strategy: Literal["fsdp2"] = "fsdp2"
    """Data-parallel strategy of the learner (FSDP2 `fully_shard`)."""
    ppo_mini_batch_size: int = Field(8, gt=0)
    """Samples (trajectories) per optimizer step; data.train_batch_size * rollout.n must be a
    multiple of it."""
    ppo_micro_batch_size_per_gpu: int = Field(4, gt=0)
    """Samples per forward/backward pass on one worker (gradient accumulation unit)."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over each training batch."""
    clip_ratio_low: float = Field(0.2, ge=0)
    """PPO clip below 1: the ratio is clipped at 1 - clip_ratio_low."""
    clip_ratio_high: float = Field(0.2, ge=0)
    """PPO clip above 1: the ratio is clipped at 1 + clip_ratio_high (DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages (loss capped at -A * clip_ratio_c)."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses are reduced to one number (global token counts across workers)."""
    entropy_coeff: float = Field(0.0, ge=0)
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL(actor || reference) term to the loss (GRPO style) instead of to the reward."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """Weight of the KL loss term."""
    kl_loss_type: KlType = "low_var_kl"
    """KL estimator of the loss term (low_var_kl is k3)."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient norm clipping threshold."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer settings."""
    fsdp_config: FsdpConfig = Field(default_factory=FsdpConfig)
    """FSDP2 settings."""


class MultiTurnConfig(Section):
    """Tool-calling conversations: limits and tool-output handling (verl's multi_turn keys)."""

    enable: bool = False
    """Run agent loops with tool calls instead of single-turn generation."""
    max_assistant_turns: int | None = Field(None, gt=0)
    """Stop an episode after this many model turns; null: only the token budget stops it."""
    max_user_turns: int | None = Field(None, gt=0)
    """Stop an episode after this many user/tool turns; null: no limit."""
    max_parallel_calls: int = Field(1, gt=0)
    """Tool calls of one turn executed concurrently; further calls in that turn are refused."""
    max_tool_response_length: int = Field(256, gt=0)
    """Characters of a tool response kept before truncation."""
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    """Which part of a long tool response is cut (middle keeps both ends)."""
    format: Literal["hermes"] = "hermes"
    """Tool-call syntax parsed from model output (hermes: <tool_call>{json}</tool_call>)."""
    tools: list[str] = Field(default_factory=lambda: ["calculator", "finish"])
    """Tools offered to tool agents, by registry name (calculator, python, finish, answer, ...)."""
    max_tokens_per_turn: int | None = Field(None, gt=0)
    """Most tokens one model turn may generate; null: only the episode's budget limits a turn."""
    max_consecutive_tool_errors: int = Field(3, gt=0)
    """End an episode (termination tool_error) after this many turns in a row whose tool calls
    all failed."""


class RolloutConfig(Section):
    """Sampling by the vLLM engine of a rollout server."""

    name: Literal["vllm"] = "vllm"
    """Inference engine."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables it."""
    prompt_length: int | None = Field(None, gt=0)
    """Prompt token budget; null: data.max_prompt_length (filled in when the config is loaded)."""
    response_length: int | None = Field(None, gt=0)
    """Response token budget of a whole episode, tool tokens included; null: data.max_response_length."""
    max_model_len: int | None = Field(None, gt=0)
    """vLLM context length; null: the model's own. Must hold prompt_length + response_length."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Fraction of accelerator memory vLLM may use (of RAM on the CPU engine, where 0.9 fails)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Engine weight dtype; float32 is what the CPU engine runs reliably."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (faster start, needed on CPU)."""
    tensor_model_parallel_size: int = Field(1, gt=0)
    """GPUs one engine is sharded over."""
    seed: int = 0
    """Engine sampling seed."""
    n: int = Field(4, gt=0)
    """Samples per prompt (the GRPO group size)."""
    max_num_seqs: int = Field(64, gt=0)
    """Sequences the engine batches at once."""
    max_staleness: int = Field(1, ge=0)
    """Policy versions a trajectory may lag behind the learner and still be trained on; 0 is
    on-policy."""
    on_weight_update: Literal["abort", "keep", "drain"] = "keep"
    """In-flight episodes when new weights arrive: abort them, keep generating (tokens record the
    version that produced them), or drain them before loading the weights."""
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    """Multi-turn / tool settings."""


class RefFsdpConfig(Section):
    """FSDP2 settings of the reference model."""

    param_offload: bool = False
    """Keep reference parameters on the CPU between uses."""


class RefConfig(Section):
    """The frozen reference policy used for KL (loaded only when a KL term is enabled)."""

    fsdp_config: RefFsdpConfig = Field(default_factory=RefFsdpConfig)
    """FSDP2 settings."""


class ActorRolloutRefConfig(Section):
    """Policy model, its trainer, its sampler and its reference copy."""

    model: ModelConfig
    """The model (its path is required)."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """Policy update."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Sampling."""
    ref: RefConfig = Field(default_factory=RefConfig)
    """Reference model."""
