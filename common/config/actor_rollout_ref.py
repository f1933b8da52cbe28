"""The `actor_rollout_ref` section: the policy model, its trainer (actor), its sampler (rollout) and
the frozen reference model.

Design: key names and meanings follow verl's `actor_rollout_ref` so that verl recipes translate
key for key. Checks that involve a single section live here as field constraints; checks that
compare sections (mini-batch size against the data batch size, prompt lengths) live in `root.py`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from common.config.base import Section

KlType = Literal["kl", "abs", "mse", "low_var_kl"]

POLICY_LOSS_MODES: tuple[str, ...] = (
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
)
"""verl's ``core_algos.POLICY_LOSS_REGISTRY`` (0.9.1), spelled out so that loading a config imports
no torch; tests/learner/test_policy_losses.py holds it equal to verl's registry."""


class LoraBlock(Section):
    """verl's ``actor_rollout_ref.model.lora`` block, as far as it applies here."""

    merge: bool = False
    """How rollout servers get the policy when lora_rank > 0. false (verl's default): each weight
    update ships the adapter alone (a few MB), and the servers' vLLM serves the base model plus the
    newest adapter; generation does not pause for it. true: the learner merges the adapter into the
    base weights and ships the full model, for engines that cannot serve adapters."""


class ModelConfig(Section):
    """The Hugging Face model that the actor, the reference and the rollout engine load."""

    path: str = Field(min_length=1)
    """Local directory of the Hugging Face model (config, tokenizer, safetensors). Required; a run
    and `--check` refuse a directory that does not exist."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of the actor to save memory."""
    trust_remote_code: bool = False
    """Allow model/tokenizer code shipped with the checkpoint to run (Hugging Face option)."""
    use_remove_padding: bool = True
    """Padding-free micro-batches in the learner: the sequences end to end in one row, attention
    kept within each (on CUDA a varlen kernel: flash-attn's, or torch's torch.nn.attention.varlen
    once checked on the device; on the CPU one SDPA call per sequence), so a micro-batch costs its
    tokens. Same numbers as padded micro-batches (false). On a GPU without a varlen kernel
    micro-batches stay padded (a warning says so): one SDPA call per sequence there costs more than
    the padding (learner.worker.TrainWorker.can_pack)."""
    share_prefix: bool = True
    """With use_remove_padding: the tokens that every sequence of a micro-batch starts with (the
    system prompt, the tool schemas, a GRPO group's prompt) go through the model once, and each
    sequence attends to them. Same numbers and gradient, fewer tokens. On the CPU one SDPA call per
    sequence; on a GPU through the varlen kernel (each sequence's keys gathered as [prefix | own]),
    once it passed a shared-prefix check on the device (else nothing is shared, with a warning).
    There each sequence's keys and values hold a copy of the prefix's (kv heads only): GPU memory
    beside the activations, B x prefix tokens a layer for B sequences of a micro-batch."""
    lora_rank: int = Field(default=0, ge=0)
    """LoRA rank of the actor's adapters (peft); 0 (verl's default) trains the full model. > 0:
    the base weights stay frozen and only the adapters (rank x (in + out) per targeted linear) are
    trained, and a weight update ships the adapter alone (see lora.merge)."""
    lora_alpha: int = Field(default=16, gt=0)
    """LoRA scaling numerator: an adapter adds (lora_alpha / lora_rank) * B @ A to its weight."""
    target_modules: str | list[str] = "all-linear"
    """Linears that get adapters, as peft reads it: "all-linear" (every linear layer but the
    output head), a list of module-name suffixes (["q_proj", "v_proj"]) or one regular expression
    matched against whole module names."""
    exclude_modules: str | list[str] | None = None
    """Linears kept without adapters (peft's exclude_modules: suffixes or one regular expression);
    null: none."""
    lora_adapter_path: str | None = None
    """A peft adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``, as
    ``save_pretrained`` or a checkpoint's ``hf/lora_adapter`` hold it) that the actor's adapters
    start from instead of zero, as verl's key. Its rank and alpha must equal lora_rank and
    lora_alpha, and it must hold exactly the targeted linears; the run's first version is then this
    adapter. Needs lora_rank > 0 and lora.merge false. null: adapters start at zero (B = 0)."""
    lora: LoraBlock = Field(default_factory=LoraBlock)
    """verl's LoRA block; only ``merge`` applies here (how rollout servers get the policy)."""

    @field_validator("target_modules", "exclude_modules")
    @classmethod
    def _module_patterns(cls, value: str | list[str] | None) -> str | list[str] | None:
        # peft reads a string as one regular expression ("all-linear" aside) and a list as
        # name suffixes: refuse here what it would only refuse, or silently match nothing, later.
        if isinstance(value, list):
            if not value or not all(value):
                raise ValueError(f"must be a non-empty list of module names (got {value!r})")
        elif value == "":
            raise ValueError('must be "all-linear", a list of module names or a regular expression')
        elif value is not None and value != "all-linear":
            try:
                re.compile(value)
            except re.error as e:
                raise ValueError(
                    f'must be "all-linear", a list of module names or a regular expression '
                    f"(got {value!r}: {e})"
                ) from None
        return value


class OptimConfig(Section):
    """AdamW settings of the actor."""

    lr: float = Field(default=1e-6, gt=0)
    """Peak learning rate."""
    lr_warmup_steps: int = Field(default=-1, ge=-1)
    """Linear warm-up steps; -1 means use lr_warmup_steps_ratio instead."""
    lr_warmup_steps_ratio: float = Field(default=0.0, ge=0, le=1)
    """Warm-up length as a fraction of the total training steps (used when lr_warmup_steps is -1)."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW weight decay."""
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999], min_length=2, max_length=2)
    """AdamW (beta1, beta2)."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule after the warm-up: constant, or cosine decay to min_lr_ratio * lr at the last step."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate of the cosine schedule as a fraction of lr."""


class FsdpConfig(Section):
    """FSDP2 offloading switches of the actor."""

    param_offload: bool = False
    """Keep parameters on the CPU between uses."""
    optimizer_offload: bool = False
    """Keep optimizer state on the CPU between steps."""


class OffPolicyConfig(Section):
    """Correction for trajectories generated by older policy versions (asynchronous training)."""

    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """recompute: decoupled PPO, the clip is around the learner's current weights before the update
    (one extra forward pass); rollout: bypass mode, the rollout's own logprobs are the old policy
    (no extra pass; only sound for fresh data)."""
    is_level: Literal["token", "sequence", "off"] = "token"
    """Importance weight old policy / rollout policy applied to the policy loss (recompute mode):
    per token, per sequence (product of the token ratios), or off."""
    is_cap: float = Field(default=2.0, gt=0)
    """Truncation of the importance weight (truncated IS): weights above it are clipped to it."""
    skip_old_logprob_forward: Literal["auto", "never"] = "auto"
    """auto: in recompute mode, when a step has one PPO epoch and algorithm.use_kl_in_reward is
    off, take the first mini-batch's old logprobs from the update's own forward pass (detached)
    instead of a separate forward; later mini-batches still get a separate forward, of their
    samples only, in the micro-batches the update runs them in. The same weights give the same
    numbers, so the ratio, loss, gradient, importance weights and metrics are unchanged (verl does
    the same with one mini-batch). never: always run the separate forward over every sample."""


class PolicyLossConfig(Section):
    """Which of verl's policy losses the actor trains with, and its mode-specific parameters (verl's
    `actor.policy_loss` keys and defaults; learner/algorithms/policy_losses.py calls verl's
    functions)."""

    loss_mode: str = "vanilla"
    """verl's policy loss: vanilla (PPO clip with dual clip), dppo_tv, dppo_kl, gspo, sapo, gpg,
    clip_cov, kl_cov, geo_mean, dro, cispo, bypass_mode (needs off_policy.old_logprobs=rollout)."""
    clip_cov_ratio: float = Field(default=0.0002, gt=0)
    """clip_cov: fraction of tokens whose gradient is cut among those of high covariance."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance of the tokens that may be cut."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance of the tokens that may be cut."""
    kl_cov_ratio: float = Field(default=0.0002, gt=0)
    """kl_cov: fraction of tokens (those of highest covariance) that get the KL penalty."""
    ppo_kl_coef: float = Field(default=0.1, ge=0)
    """kl_cov: weight of the |log ratio| penalty on those tokens."""
    dro_beta: float | None = Field(default=None, gt=0)
    """dro: weight of the quadratic log-ratio penalty; required with loss_mode=dro."""

    @field_validator("loss_mode")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        if value not in POLICY_LOSS_MODES:
            raise ValueError(
                f"unknown policy loss mode {value!r}; valid: {', '.join(POLICY_LOSS_MODES)}"
            )
        return value


class ActorConfig(Section):
    """PPO-style policy update of the actor."""

    strategy: Literal["fsdp2"] = "fsdp2"
    """Data-parallel strategy of the learner (FSDP2 `fully_shard`)."""
    ppo_mini_batch_size: int = Field(default=8, gt=0)
    """Samples (trajectories) per optimizer step; data.train_batch_size * rollout.n must be a
    multiple of it."""
    ppo_micro_batch_size_per_gpu: int = Field(default=4, gt=0)
    """Samples per forward/backward pass on one worker (gradient accumulation unit) when
    use_dynamic_bsz is false."""
    use_dynamic_bsz: bool = True
    """Micro-batches by token count instead of by samples: each holds as many samples as fit in
    ppo_max_token_len_per_gpu tokens, and the ranks get equal tokens rather than equal sample
    counts. Applies to every learner pass (actor and critic updates, old-logprob, reference and
    value forwards). The loss is normalised by global counts, so the gradient does not change."""
    ppo_max_token_len_per_gpu: int = Field(default=16384, gt=0)
    """Token cap of a micro-batch with use_dynamic_bsz (prompt + response tokens; padded micro-
    batches count their padding). A longer sequence runs alone. Sets the learner's peak memory."""
    ppo_epochs: int = Field(default=1, gt=0)
    """Passes over each training batch."""
    clip_ratio_low: float = Field(default=0.2, ge=0)
    """PPO clip below 1: the ratio is clipped at 1 - clip_ratio_low."""
    clip_ratio_high: float = Field(default=0.2, ge=0)
    """PPO clip above 1: the ratio is clipped at 1 + clip_ratio_high (DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: float = Field(default=3.0, gt=1)
    """Dual-clip bound for negative advantages (loss capped at -A * clip_ratio_c)."""
    loss_agg_mode: Literal[
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ] = "token-mean"
    """How per-token losses are reduced to one number (global token counts across workers)."""
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    """verl's policy loss (loss_mode) and its parameters."""
    tau_pos: float = Field(default=1.0, gt=0)
    """sapo: temperature of the soft gate for tokens with positive advantage."""
    tau_neg: float = Field(default=1.05, gt=0)
    """sapo: temperature of the soft gate for tokens with non-positive advantage."""
    entropy_coeff: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL(actor || reference) term to the loss (GRPO style) instead of to the reward."""
    kl_loss_coef: float = Field(default=0.001, ge=0)
    """Weight of the KL loss term."""
    kl_loss_type: KlType = "low_var_kl"
    """KL estimator of the loss term (low_var_kl is k3)."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clipping threshold."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer settings."""
    fsdp_config: FsdpConfig = Field(default_factory=FsdpConfig)
    """FSDP2 settings."""
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    """Correction for stale trajectories."""
    first_mini_batch_in_waits: bool = False
    """Train a step's first mini-batch while the learner waits for the rest of its batch, once
    the buffer holds groups that fill it and are due at this step (learner/early_update.py): its
    forward and backward run in the wait, its optimizer step after the later mini-batches' old
    logprobs, so the step trains what it would have trained. Needs old logprobs from the update's
    own forward, one PPO epoch, advantages per group (grpo, rloo), no critic, dynamic sampling or
    dataset mix; the learner refuses it otherwise. Helps where the learner waits with idle
    devices; where it shares them with generation its compute slows generation down. false: the
    whole update after the wait, as verl does."""

    @model_validator(mode="after")
    def _policy_loss_needs(self) -> ActorConfig:
        mode = self.policy_loss.loss_mode
        if mode == "dro" and self.policy_loss.dro_beta is None:
            raise ValueError("policy_loss.loss_mode=dro needs policy_loss.dro_beta (> 0)")
        if mode == "bypass_mode" and self.off_policy.old_logprobs != "rollout":
            raise ValueError(
                "policy_loss.loss_mode=bypass_mode takes the rollout's logprobs as the old policy:"
                " set actor.off_policy.old_logprobs=rollout (its IS weights: off_policy.is_level,"
                " is_cap), or use vanilla with the default decoupled PPO"
            )
        return self


class MultiTurnConfig(Section):
    """Tool-calling conversations: limits and tool-output handling (verl's multi_turn keys)."""

    enable: bool = False
    """Run agent loops with tool calls instead of single-turn generation."""
    max_assistant_turns: int | None = Field(default=None, gt=0)
    """Stop an episode after this many model turns; null: only the token budget stops it."""
    max_user_turns: int | None = Field(default=None, gt=0)
    """Stop an episode after this many user/tool turns; null: no limit."""
    max_parallel_calls: int = Field(default=1, gt=0)
    """Tool calls of one turn executed concurrently; further calls in that turn are refused."""
    max_tool_response_length: int = Field(default=256, gt=0)
    """Characters of a tool response kept before truncation."""
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    """Which part of a long tool response is cut (middle keeps both ends)."""
    format: Literal["hermes"] = "hermes"
    """Tool-call syntax parsed from model output (hermes: <tool_call>{json}</tool_call>)."""
    tools: list[str] = Field(default_factory=lambda: ["calculator", "finish"])
    """Tools offered to tool agents, by registry name (calculator, python, finish, answer, ...)."""
    max_tokens_per_turn: int | None = Field(default=None, gt=0)
    """Most tokens one model turn may generate; null: only the episode's budget limits a turn."""
    max_consecutive_tool_errors: int = Field(default=3, gt=0)
    """End an episode (termination tool_error) after this many turns in a row whose tool calls
    all failed."""


class ValKwargsConfig(Section):
    """Sampling of validation episodes (verl's `val_kwargs`); the rest of the rollout settings (token
    budgets, agents, tools, rewards) are the training ones."""

    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature of validation episodes; 0 is greedy (only used when do_sample is true)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass of validation episodes (only used when do_sample is true)."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k of validation episodes; -1 disables it (only used when do_sample is true)."""
    n: int = Field(default=1, gt=0)
    """Episodes per validation prompt (metrics average over all of them)."""
    do_sample: bool = False
    """Sample validation episodes with temperature/top_p/top_k; false: greedy decoding whatever
    the temperature says."""


class RolloutConfig(Section):
    """Sampling by the vLLM engine of a rollout server."""

    name: Literal["vllm"] = "vllm"
    """Inference engine."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k sampling; -1 disables it."""
    prompt_length: int | None = Field(default=None, gt=0)
    """Prompt token budget; null: data.max_prompt_length (filled in when the config is loaded)."""
    response_length: int | None = Field(default=None, gt=0)
    """Response token budget of a whole episode, tool tokens included; null: data.max_response_length."""
    max_model_len: int | None = Field(default=None, gt=0)
    """vLLM context length; null: the model's own. Must hold prompt_length + response_length."""

    @property
    def prompt_budget(self) -> int:
        """prompt_length of a loaded config (the loader fills a null one in from data)."""
        if self.prompt_length is None:
            raise ValueError(
                "actor_rollout_ref.rollout.prompt_length is unset: load the config with load_config"
            )
        return self.prompt_length

    @property
    def response_budget(self) -> int:
        """response_length of a loaded config (the loader fills a null one in from data)."""
        if self.response_length is None:
            raise ValueError(
                "actor_rollout_ref.rollout.response_length is unset: load the config with load_config"
            )
        return self.response_length

    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    """Fraction of accelerator memory vLLM may use (of RAM on the CPU engine, where 0.9 fails)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Engine weight dtype; auto: bfloat16 on CUDA, float32 on CPU (what the CPU engine runs reliably)."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (faster start, needed on CPU)."""
    compilation_config: dict[str, Any] | None = None
    """vLLM's own ``compilation_config`` (its keys, passed through), used when enforce_eager is
    false. E.g. ``{mode: 0, cudagraph_mode: FULL_DECODE_ONLY}``: CUDA graphs for decode steps without
    torch.compile, which starts in seconds instead of minutes on a fresh GPU machine; null: vLLM's
    default (torch.compile + piecewise/full graphs). ``FULL`` (full graphs of mixed prefill-decode
    batches too) corrupted the agent's generation on an H200 (logprobs not finite or above 0); the
    server stops on such output (``EngineOutputError``)."""
    tensor_model_parallel_size: int = Field(default=1, gt=0)
    """GPUs one engine is sharded over."""
    prefetch_weights: bool = True
    """Copy each full weight update onto the engine's device while generation goes on, so that
    generation pauses only for device-to-device copies. Needs free device memory for one copy of
    the weights beyond gpu_memory_utilization's share; without it the engine reads the file during
    the pause, as with false."""
    seed: int = 0
    """Engine sampling seed."""
    n: int = Field(default=4, gt=0)
    """Samples per prompt (the GRPO group size)."""
    max_num_seqs: int = Field(default=64, gt=0)
    """Sequences the engine batches at once."""
    max_staleness: int = Field(default=1, ge=0)
    """Policy versions a trajectory may lag behind the learner and still be trained on; 0 is
    on-policy."""
    on_weight_update: Literal["abort", "keep", "drain"] = "keep"
    """In-flight episodes when new weights arrive: abort them, keep generating (tokens record the
    version that produced them), or drain them before loading the weights."""
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    """Multi-turn / tool settings."""
    val_kwargs: ValKwargsConfig = Field(default_factory=ValKwargsConfig)
    """Sampling of validation episodes (run by the rollout servers when the learner validates)."""


class RefFsdpConfig(Section):
    """FSDP2 settings of the reference model."""

    param_offload: bool = False
    """Keep reference parameters on the CPU between uses."""


class RefConfig(Section):
    """The frozen reference policy used for KL (loaded only when a KL term is enabled)."""

    fsdp_config: RefFsdpConfig = Field(default_factory=RefFsdpConfig)
    """FSDP2 settings."""
    forward_in_waits: bool = False
    """Run the reference forward over buffered trajectories while the learner waits for its batch
    (the reference never changes), so that a step's prepare runs it only for those that arrived
    last (learner/early_reference.py). Helps where the learner has its own devices and waits with
    them idle; where it shares them with generation (the CPU demo) the forwards slow generation
    down by more than prepare gains. false: all of it in prepare, as verl does."""


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
