"""bench/verl_side.py's configurations composed through verl's own hydra configs on the CPU: every
override lands on a key verl's config has, with the value given, and the values that decide where
verl places its trainer and rollout and how stale its samples may be read back as the bench means
them. verl's checks that need no GPU (validate_config; the separate_async trainer's asserts, whose
class needs transfer_queue, mirrored here with their file and line) run on the composed config, so
a run that would die at start-up on the GPU machine fails here first."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

verl = pytest.importorskip("verl")
hydra = pytest.importorskip("hydra")
from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from bench import verl_side  # noqa: E402

VERL = Path(verl.__file__).resolve().parent
CONFIG_DIRS = {  # entrypoint module -> (its @hydra.main config_path, config_name)
    "verl.trainer.main_ppo": (VERL / "trainer" / "config", "ppo_trainer"),
    "verl.experimental.fully_async_policy.fully_async_main": (
        VERL / "experimental" / "fully_async_policy" / "config",
        "fully_async_ppo_trainer",
    ),
}
GPUS, STEPS = 2, 10
NAMES = [
    "sync",
    "v0-sync",
    "fully-async-t0",
    "fully-async-t1",
    "separate-async-s0",
    "separate-async-s2",
]


def _overrides(name: str, work: Path) -> list[str]:
    cfg = verl_side.verl_config(name, GPUS)
    args = argparse.Namespace(gpus=GPUS, steps=STEPS, verl_arg=[])
    return verl_side.overrides(cfg, args, "/tmp/model", work)


def _compose(name: str, work: Path) -> DictConfig:
    config_dir, config_name = CONFIG_DIRS[verl_side.verl_config(name, GPUS).module]
    with hydra.initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra.compose(config_name, overrides=_overrides(name, work))


@pytest.fixture(scope="module")
def composed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DictConfig]:
    work = tmp_path_factory.mktemp("work")
    return {name: _compose(name, work) for name in NAMES}


def _get(cfg: DictConfig, key: str) -> Any:
    value = OmegaConf.select(cfg, key, throw_on_missing=True)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


@pytest.mark.parametrize("name", NAMES)
def test_every_override_reads_back(name: str, composed: dict[str, DictConfig]) -> None:
    """Each override's key is in verl's composed config with the value given (a later override or
    an interpolation that changed it, or a key hydra put somewhere else, fails here)."""
    cfg = composed[name]
    work = Path(_get(cfg, "trainer.default_local_dir")).parent
    parsed = OverridesParser.create().parse_overrides(_overrides(name, work))
    assert parsed
    for o in parsed:
        assert not o.is_delete(), o.input_line
        assert _get(cfg, o.key_or_group) == o.value(), o.input_line


@pytest.mark.parametrize("name", NAMES)
def test_fair_settings_reach_the_worker_config(name: str, composed: dict[str, DictConfig]) -> None:
    """FSDP2 for actor and reference, padding removal, our worker plugins and attention, token-capped
    dynamic micro-batches, and the long-tail job's batch shape: in every configuration."""
    arr = composed[name].actor_rollout_ref
    assert arr.actor.strategy == "fsdp2" and arr.ref.strategy == "fsdp2"
    assert arr.model.use_remove_padding is True
    assert arr.model.external_lib == verl_side.WORKER_LIB
    assert arr.model.override_config.attn_implementation == "torch_varlen"
    assert arr.actor.use_dynamic_bsz is True
    assert arr.actor.ppo_max_token_len_per_gpu == verl_side.TOKEN_CAP
    # engine_workers.py reads the ref's log_prob_* keys (renamed at init_model) and the actor's
    # infer cap from the rollout section
    assert arr.ref.log_prob_use_dynamic_bsz is True
    assert arr.ref.log_prob_max_token_len_per_gpu == verl_side.TOKEN_CAP
    assert arr.rollout.log_prob_use_dynamic_bsz is True
    assert arr.rollout.log_prob_max_token_len_per_gpu == verl_side.TOKEN_CAP
    assert arr.actor.ppo_mini_batch_size == 8 and arr.rollout.n == 8
    assert arr.actor.use_kl_loss is True and composed[name].algorithm.adv_estimator == "grpo"
    assert arr.rollout.name == "vllm" and arr.rollout.mode == "async"
    assert composed[name].trainer.nnodes == 1


@pytest.mark.parametrize("name", ["sync", "v0-sync"])
def test_colocated_placement(name: str, composed: dict[str, DictConfig]) -> None:
    cfg = composed[name]
    assert cfg.trainer.use_v1 is (name == "sync")
    if name == "sync":
        assert cfg.trainer.v1.trainer_mode == "sync"
    assert cfg.trainer.n_gpus_per_node == GPUS  # FSDP and a vLLM replica on every GPU
    assert cfg.actor_rollout_ref.hybrid_engine is True
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.35
    assert cfg.data.train_batch_size == verl_side.VERSION_PROMPTS
    assert cfg.trainer.total_training_steps == STEPS


@pytest.mark.parametrize("threshold", [0, 1])
def test_fully_async_placement_and_staleness(
    threshold: int, composed: dict[str, DictConfig]
) -> None:
    cfg = composed[f"fully-async-t{threshold}"]
    # fully_async_main.main copies rollout.{nnodes,n_gpus_per_node} into actor_rollout_ref.rollout
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 1
    assert cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node == 1
    assert cfg.actor_rollout_ref.hybrid_engine is False
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "nccl"
    at = cfg.async_training
    assert at.staleness_threshold == threshold and at.partial_rollout is True
    # a version = require_batches x trigger_parameter_sync_step mini-batches of 8 prompts
    version = (
        at.require_batches
        * at.trigger_parameter_sync_step
        * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    )
    assert version == verl_side.VERSION_PROMPTS
    assert cfg.rollout.total_rollout_steps == verl_side.VERSION_PROMPTS * (STEPS + 1)


def _separate_async_checks(cfg: DictConfig) -> None:
    """verl 0.9.1's PPOTrainerSeparateAsync.__init__ (trainer/ppo/v1/trainer_separate_async.py:56-76)
    and ReplayBuffer.__init__ (trainer/ppo/v1/replay_buffer.py:165-177) asserts, on ``cfg``."""
    rollout = cfg.actor_rollout_ref.rollout
    sa = cfg.trainer.v1.separate_async
    assert (
        cfg.data.train_batch_size
        == sa.parameter_sync_step * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    )
    assert rollout.nnodes > 0 and rollout.n_gpus_per_node > 0
    assert rollout.checkpoint_engine.backend != "naive", "verl: use nccl/nixl/mooncake"
    threshold = cfg.trainer.v1.sampler.max_off_policy_threshold
    assert isinstance(threshold, int) and threshold > 0
    assert cfg.trainer.v1.sampler.max_off_policy_strategy in ("drop", "wait")


@pytest.mark.parametrize("versions", [0, 2])
def test_separate_async_placement_and_staleness(
    versions: int, composed: dict[str, DictConfig]
) -> None:
    cfg = composed[f"separate-async-s{versions}"]
    assert cfg.trainer.use_v1 is True and cfg.trainer.v1.trainer_mode == "separate_async"
    assert cfg.transfer_queue.enable is True
    # trainer_base._init_resource_pool_mgr: the trainer pool is trainer.{nnodes,n_gpus_per_node};
    # llm_server.LLMServerManager (standalone) sizes its replicas by actor_rollout_ref.rollout's
    trainer_gpus = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    rollout = cfg.actor_rollout_ref.rollout
    rollout_gpus = rollout.nnodes * rollout.n_gpus_per_node
    assert (trainer_gpus, rollout_gpus) == (1, 1)
    assert rollout_gpus % rollout.tensor_model_parallel_size == 0
    # hybrid_engine=False: no colocated replicas on the trainer GPU, no switching
    assert cfg.actor_rollout_ref.hybrid_engine is False
    assert cfg.trainer.v1.separate_async.hybrid_rollout.enable_switch is False
    # our max_staleness K: verl's threshold counts the steps a prompt spans (K + 1), and only the
    # batches its warm-up put in flight are generated ahead of training (K)
    sampler = cfg.trainer.v1.sampler
    assert sampler.max_off_policy_threshold == versions + 1
    assert sampler.max_off_policy_strategy == "wait"
    assert cfg.trainer.v1.separate_async.num_warmup_batches == versions
    # a version (global step) = parameter_sync_step local updates of ppo_mini_batch_size prompts
    sa = cfg.trainer.v1.separate_async
    version = sa.parameter_sync_step * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert version == cfg.data.train_batch_size == verl_side.VERSION_PROMPTS
    # honoured: trainer_base._init_dataloader takes it over total_epochs, fit stops after it
    assert cfg.trainer.total_training_steps == STEPS
    assert cfg.reward.reward_model.enable is False  # else it needs its own resource pool


@pytest.mark.parametrize("versions", [0, 2])
def test_separate_async_passes_verl_init_checks(
    versions: int, composed: dict[str, DictConfig]
) -> None:
    _separate_async_checks(composed[f"separate-async-s{versions}"])


@pytest.mark.parametrize("name", ["sync", "v0-sync", "separate-async-s0", "separate-async-s2"])
def test_verl_validate_config_passes(name: str, composed: dict[str, DictConfig]) -> None:
    """main_ppo.main's validate_config (batch-size divisibility, actor config) on the composed
    config; GRPO with a KL loss: a reference policy, no critic."""
    from verl.utils.config import validate_config

    cfg = composed[name].copy()
    validate_config(config=cfg, use_reference_policy=True, use_critic=False)
