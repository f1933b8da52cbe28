"""Learner-side sections: `algorithm`, `critic`, `data`, `trainer` and `ray`.

Design: verl's key names and meanings, so verl recipes translate key for key. Choices are Literals
(the loader lists the allowed values when one is wrong). Agent types stay free strings because the
agent registry lives in the rollout service and grows without touching the config.
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from common.config.base import Section

AdvEstimator = Literal[
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "remax",
    "opo",
    "gpg",
]


class KlCtrlConfig(Section):
    """Controller of the KL penalty coefficient when the KL is put into the reward."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: constant kl_coef; adaptive: move kl_coef towards target_kl over `horizon` steps."""
    kl_coef: float = Field(default=0.001, ge=0)
    """(Initial) KL coefficient."""
    target_kl: float = Field(default=0.1, gt=0)
    """KL the adaptive controller aims at."""
    horizon: int = Field(default=10000, gt=0)
    """Adaptation horizon of the adaptive controller, in samples."""


ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "seq_max_k2",
    "seq_max_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "token_k1",
    "token_k2",
    "token_k3",
)
"""verl 0.9.1's rejection modes (``rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS``; a test holds
this copy to verl's set, which the config cannot import: verl takes seconds to import)."""


def _threshold(value: float | str, key: str) -> None:
    parts = str(value).split("_") if isinstance(value, str) else [value]
    try:
        bounds = [float(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"{key} must be a number or 'lower_upper' (e.g. 0.5_2.0), got {value!r}"
        ) from None
    if (
        len(bounds) > 2
        or any(b <= 0 for b in bounds)
        or (len(bounds) == 2 and bounds[0] > bounds[1])
    ):
        raise ValueError(
            f"{key} must be > 0, or 'lower_upper' with 0 < lower <= upper; got {value!r}"
        )


class RolloutCorrectionConfig(Section):
    """Train/inference mismatch correction between the rollout's and the learner's logprobs: verl's
    ``algorithm.rollout_correction`` keys, run by verl's own functions
    (``verl.trainer.ppo.rollout_corr_helper``; docs/training.md, Rollout correction). Off unless
    rollout_is or rollout_rs is set; then it replaces actor.off_policy.is_level / is_cap."""

    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights pi_old / pi_rollout per token or per sequence; null: none."""
    rollout_is_threshold: float | str = 2.0
    """A number: truncation of the weights (TIS); 'lower_upper' (e.g. '0.5_2.0'): weights outside
    the band are zeroed (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Normalise the weights to mean 1 over the batch."""
    rollout_rs: str | None = None
    """Rejection: tokens or sequences whose divergence leaves the band are masked out of the loss;
    comma-separated options of token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3 (seq_mean_k1: the
    geometric mean ratio), seq_max_k2, seq_max_k3; null: none."""
    rollout_rs_threshold: float | str | None = None
    """Band of rollout_rs (required with it): one value, or one per option (comma-separated); k1
    options take ratio bounds 'lower_upper' (a single upper u means 1/u_u), k2/k3 an upper bound."""
    bypass_mode: bool = False
    """verl's bypass mode: the rollout's logprobs are the old policy (sets
    actor.off_policy.old_logprobs=rollout and actor.policy_loss.loss_mode=bypass_mode)."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Loss of bypass mode: PPO clip around the rollout policy, or REINFORCE with IS weights."""

    @property
    def active(self) -> bool:
        """Whether importance weights or rejection are configured here."""
        return self.rollout_is is not None or self.rollout_rs is not None

    @field_validator("rollout_rs")
    @classmethod
    def _check_rs(cls, value: str | None) -> str | None:
        if value is None:
            return None
        options = [o.strip() for o in value.split(",") if o.strip()]
        unknown = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
        if not options or unknown:
            raise ValueError(
                f"unknown rollout_rs mode {(unknown or [value])[0]!r}; valid: "
                f"{', '.join(ROLLOUT_RS_OPTIONS)} (comma-separated for several)"
            )
        return value

    @field_validator("rollout_is_threshold")
    @classmethod
    def _check_is_threshold(cls, value: float | str) -> float | str:
        _threshold(value, "rollout_is_threshold")
        return value

    @model_validator(mode="after")
    def _rs_needs_threshold(self) -> RolloutCorrectionConfig:
        if self.rollout_rs is None:
            return self
        if self.rollout_rs_threshold is None:
            raise ValueError("rollout_rs needs rollout_rs_threshold")
        specs = str(self.rollout_rs_threshold).split(",")
        options = [o.strip() for o in self.rollout_rs.split(",") if o.strip()]
        if len(specs) not in (1, len(options)):
            raise ValueError(
                f"rollout_rs_threshold needs one value or one per rollout_rs option "
                f"({len(options)}), got {len(specs)}"
            )
        for option, spec in zip(
            options, specs * len(options) if len(specs) == 1 else specs, strict=True
        ):
            if not option.endswith("k1") and "_" in spec:
                raise ValueError(f"rollout_rs option {option} takes one upper bound, got {spec!r}")
            _threshold(spec.strip(), "rollout_rs_threshold")
        return self


class FilterGroupsConfig(Section):
    """Dynamic sampling (DAPO's group filter): verl's ``algorithm.filter_groups`` keys. A group whose
    episodes all score the same under `metric` has zero advantage and is not trained; admission
    generates more groups instead (docs/training.md, Dynamic sampling)."""

    enable: bool = False
    """Leave groups whose `metric` is equal over all their episodes out of training."""
    metric: str = Field(default="reward", min_length=1)
    """What is compared within a group: reward, seq_reward or score (the scored reward),
    seq_final_reward (the reward after over-long shaping), or a name of the reward's extras
    (e.g. acc)."""
    max_num_gen_batches: int = 0
    """At most this many batches' worth of groups (train_batch_size each) are judged for one step;
    a step still short of groups then stops the run. 0 or less: no bound."""
    max_inflight_gen_batches: int = Field(default=1, ge=1)
    """Accepted for verl's recipes; admission decides what is generating (its window and the filter's
    pass rate)."""


class AlgorithmConfig(Section):
    """Advantage estimation and KL-in-reward."""

    adv_estimator: AdvEstimator = "grpo"
    """Advantage estimator (gae needs critic.enable)."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount factor."""
    lam: float = Field(default=1.0, ge=0, le=1)
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group's std (false gives Dr.GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef * KL(actor || reference) from the per-token reward."""
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl"] = "kl"
    """KL estimator used in the reward."""
    kl_ctrl: KlCtrlConfig = Field(default_factory=KlCtrlConfig)
    """KL coefficient controller."""
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    """Importance weights and rejection between rollout and learner logprobs (verl's keys)."""
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    """Dynamic sampling: groups of equal rewards are not trained (verl's keys)."""


class CriticOptimConfig(Section):
    """Optimizer settings of the critic."""

    lr: float = Field(default=1e-5, gt=0)
    """Learning rate of the critic."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW weight decay."""


class CriticFsdpConfig(Section):
    """FSDP2 offloading switches of the critic."""

    param_offload: bool = False
    """Keep parameters on the CPU between uses."""
    optimizer_offload: bool = False
    """Keep optimizer state on the CPU between steps."""


class CriticConfig(Section):
    """Value model for GAE; off unless enabled."""

    enable: bool = False
    """Train a critic (required by algorithm.adv_estimator=gae)."""
    optim: CriticOptimConfig = Field(default_factory=CriticOptimConfig)
    """Optimizer settings."""
    ppo_micro_batch_size_per_gpu: int = Field(default=4, gt=0)
    """Samples per forward/backward pass on one worker."""
    cliprange_value: float = Field(default=0.5, gt=0)
    """Clip of the value update around the old values."""
    model_path: str | None = None
    """Model the value head is put on; null: actor_rollout_ref.model.path."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clipping threshold."""
    fsdp_config: CriticFsdpConfig = Field(default_factory=CriticFsdpConfig)
    """FSDP2 settings."""


def _one_or_many(value: object) -> object:
    # A single path is the common case on the command line (`data.train_files=x.jsonl`).
    return [value] if isinstance(value, str) else value


class DatasetConfig(Section):
    """One source of a mixed training set; every batch holds exactly `ratio` of it."""

    name: str = Field(min_length=1, validation_alias=AliasChoices("name", "data_source"))
    """Data source name (also accepted as `data_source`): groups samples, labels metrics."""
    path: list[str] = Field(min_length=1)
    """Data file(s) of this source (one path or a list)."""
    ratio: float = Field(gt=0, le=1)
    """Share of every training batch; the ratios of all datasets sum to 1."""
    agent_type: str | None = Field(default=None, min_length=1)
    """Agent loop that runs this source's samples; null: data.agent_type."""
    tools: list[str] | None = None
    """Tools this source's agent offers (their schemas are its prompt's), in place of the agent's
    own list (multi_turn.tools, or its agents.* section's); null: the agent's. A small model
    learns a source's task faster when the prompt shows only the tools that task needs. A tool
    the agent cannot run without (the code agent's python) must stay in the list: start-up and
    --check refuse the source otherwise."""

    @field_validator("path", mode="before")
    @classmethod
    def _one_path(cls, value: object) -> object:
        return _one_or_many(value)


class DataConfig(Section):
    """Training and validation data."""

    train_files: list[str] = Field(default_factory=list)
    """Training data file(s) (one path or a list); leave empty when `datasets` is used."""
    val_files: list[str] = Field(default_factory=list)
    """Validation data file(s) (one path or a list)."""
    datasets: list[DatasetConfig] = Field(default_factory=list)
    """Mixed training set: sources with per-batch ratios (replaces train_files)."""
    agent_type: str = Field(default="single_turn", min_length=1)
    """Agent loop for samples that do not name one."""
    train_batch_size: int = Field(default=4, gt=0)
    """Prompts per training step (each sampled rollout.n times)."""
    val_batch_size: int | None = Field(default=None, gt=0)
    """Validation prompts a rollout server plays at once (its share of a validation run); null: as
    many as rollout_server.max_concurrent_episodes holds."""
    max_prompt_length: int = Field(default=256, gt=0)
    """Prompt token budget (actor_rollout_ref.rollout.prompt_length unless set): with
    rollout.max_model_len null the engine's context is this plus the response budget. A rendered
    prompt that does not fit the context ends its episode at once (termination `length`)."""
    max_response_length: int = Field(default=128, gt=0)
    """Token budget of a response (all turns of an episode, tool tokens included)."""
    shuffle: bool = True
    """Shuffle the training data every epoch."""
    seed: int = 0
    """Seed of the data order and the mixed-batch schedule."""
    prompt_key: str = Field(default="prompt", min_length=1)
    """Field of a verl-layout row that holds the prompt: a chat-message list (rendered with the chat
    template as given) or a string (one user message). Rows with `question` (ours, AgentFly's) do
    not use it. See docs/rollout-server.md, Data."""
    max_row_bytes: int = Field(default=4 << 20, gt=0)
    """Largest data row in bytes (a JSONL line; a JSON or parquet row as compact JSON): a bigger one
    stops the load naming the file, the line or row, its size and this limit. 4 MiB holds long
    documents; raise it for data that needs more."""

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_file(cls, value: object) -> object:
        return _one_or_many(value)

    @field_validator("datasets")
    @classmethod
    def _check_datasets(cls, datasets: list[DatasetConfig]) -> list[DatasetConfig]:
        names = [d.name for d in datasets]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"dataset names must be unique (repeated: {', '.join(duplicates)})")
        total = sum(d.ratio for d in datasets)
        if datasets and abs(total - 1.0) > 1e-6:
            parts = ", ".join(f"{d.name}={d.ratio:g}" for d in datasets)
            raise ValueError(f"ratios must sum to 1 (got {total:g}: {parts})")
        return datasets


class TrainerConfig(Section):
    """The training run: length, checkpoints, logging, hardware."""

    project_name: str = Field(default="agentrl", min_length=1)
    """Project name (metrics grouping)."""
    experiment_name: str = Field(default="tiny-cpu", min_length=1)
    """Name of this run; names the run directory by default."""
    total_training_steps: int | None = Field(default=None, gt=0)
    """Stop after this many steps; null: total_epochs over the training data."""
    total_epochs: int = Field(default=1, gt=0)
    """Passes over the training data (when total_training_steps is null)."""
    nnodes: int = Field(default=1, gt=0)
    """Learner nodes."""
    n_gpus_per_node: int = Field(default=1, gt=0)
    """Learner workers per node (GPUs, or processes with device=cpu)."""
    save_freq: int = Field(default=-1, ge=-1)
    """Checkpoint every this many steps; -1 or 0 never."""
    export_final_model: bool = True
    """With save_freq -1 or 0: export the trained model to RUN_DIR/final-hf at the end, so that a
    run without checkpoints still leaves a model transformers and vLLM load; false leaves none (a
    benchmark's runs, whose model nobody reads)."""
    max_actor_ckpt_to_keep: int | None = Field(default=None, gt=0)
    """Keep only the newest this many checkpoints (verl's key); null: keep every one."""
    keep_best_ckpt: bool = False
    """With max_actor_ckpt_to_keep: also keep the checkpoint whose last validation before it had the
    best reward (val/reward/mean), beyond the newest ones."""
    test_freq: int = Field(default=-1, ge=-1)
    """Validate every this many steps; -1 or 0 never."""
    val_before_train: bool = False
    """Validate once before the first step."""
    val_timeout_s: float = Field(default=600.0, gt=0)
    """How long one validation may take: waiting for a rollout server to connect (before the first
    step), then for every asked server's result. Training waits meanwhile; when it expires the
    results that arrived are logged and training goes on."""
    val_shard_wait_s: float = Field(default=120.0, ge=0)
    """Once every asked rollout server answered, how much longer (within val_timeout_s) a
    validation waits for the servers of shards of the validation set that no answer covered (one
    still starting joins and is asked); 0: not at all."""
    critic_warmup: int = Field(default=0, ge=0)
    """Steps that update only the critic before the actor starts learning."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """auto: resume from the latest checkpoint in default_local_dir if any; disable: start fresh;
    resume_path: resume from resume_from_path."""
    resume_from_path: str | None = None
    """Checkpoint directory to resume from (resume_mode=resume_path)."""
    logger: list[Literal["console", "tensorboard", "jsonl", "wandb", "prometheus"]] = Field(
        default_factory=lambda: ["console"]
    )
    """Metric sinks (wandb needs the wandb package; it runs offline unless WANDB_API_KEY or
    WANDB_MODE is set; prometheus serves the latest step's metrics on learner.metrics_port)."""
    seed: int = 0
    """Seed of the learner's initialisation and sampling (checkpoints restore the RNG state)."""
    default_local_dir: str | None = None
    """Checkpoint directory; null: <run_dir>/checkpoints."""
    run_dir: str = Field(default="runs/{experiment_name}", min_length=1)
    """Directory of this run (resolved config, logs, metrics); may use {experiment_name} and
    {project_name}."""
    device: Literal["cpu", "cuda", "auto"] = "auto"
    """Learner device; auto picks cuda when available."""

    @field_validator("run_dir")
    @classmethod
    def _check_placeholders(cls, value: str) -> str:
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(value) if f is not None}
        except ValueError as exc:
            raise ValueError(f"bad format string {value!r}: {exc}") from None
        unknown = fields - RUN_DIR_FIELDS
        if unknown:
            allowed = ", ".join("{" + f + "}" for f in sorted(RUN_DIR_FIELDS))
            raise ValueError(f"unknown placeholder {{{sorted(unknown)[0]}}} (allowed: {allowed})")
        return value


RUN_DIR_FIELDS = frozenset({"experiment_name", "project_name"})
"""Placeholders trainer.run_dir may contain."""


class RayConfig(Section):
    """Ray cluster used by the learner."""

    address: str | None = None
    """Address of an existing cluster (e.g. `auto` or `host:6379`); null: start a local one."""
    num_cpus: int | None = Field(default=None, gt=0)
    """CPUs of the local cluster; null: all."""
    place_timeout_s: float = Field(default=120.0, gt=0)
    """How long the learner's workers may wait for free resources on the cluster before the learner
    fails naming the one missing (a cluster that could never hold them fails at once)."""
