"""verl's side of bench/vs_verl.py: which verl trainers run, with which hydra overrides, and how their
per-step metrics become the report's figures.

Design: a registry of `VerlConfig`s, each a verl entrypoint plus overrides layered on one job
(`job_overrides`: bench/e2e.py's long-tail workload as configs/longtail_e2e.yaml gives it to ours)
and on verl's best settings for these machines (`FAIR`): FSDP2 for actor and reference, padding
removal with packed rows through our learner's varlen kernel (bench/verl_plugins/varlen_attention.py),
token logprobs in one vectorised call where verl without flash-attn loops over tokens
(bench/verl_plugins/logprobs.py; both loaded by bench/verl_plugins/workers.py), token-capped
micro-batches. The old-logprob forward stays where ours has one too (the long-tail
job's two mini-batches a step: ours recomputes the old logprobs in its prepare phase). Names:

- ``sync``: verl's maintained trainer (V1, ``trainer.v1.trainer_mode=sync``), colocated on every
  GPU of the run (vLLM sleeps while FSDP trains): what a verl user runs;
- ``v0-sync``: the same job on the deprecated v0 RayPPOTrainer (``trainer.use_v1=false``), a
  labelled row;
- ``separate-async-sK``: V1's ``separate_async`` mode, trainer and rollout on separate GPUs as
  below, trajectories at most K versions old as our ``max_staleness`` K (verl counts the steps a
  prompt spans: ``max_off_policy_threshold`` K + 1, strategy ``wait``, which drops nothing, as our
  admission; K batches generated ahead, ``num_warmup_batches``), a version = 16 prompts;
- ``fully-async-tT``: ``verl.experimental.fully_async_policy`` with ``staleness_threshold`` T, the
  trainer on the first half of the GPUs and the rollouter (standalone vLLM) on the rest, partial
  rollouts on, one version = 16 prompts (2 mini-batches), as our step. T = 0 is its separated
  synchronous pipeline; generation pauses once (1 + T) versions' samples were made since the last
  weight sync, so T = 1 lets about one version run ahead (our ``max_staleness`` 1), T = 2 two.

Metrics: verl's file logger writes a line per record and no time; `MetricsWatcher` stamps each
line when it appears, so that a step's wall-clock is the same for every verl trainer: the time
between two consecutive versions' records (records of one version are merged).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.file_tail import JsonlTail

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "bench" / "verl_plugins"
ATTENTION_LIB = "bench.verl_plugins.varlen_attention"  # its device check runs before verl
WORKER_LIB = "bench.verl_plugins.workers"  # what verl's workers import: attention + logprobs
TOKEN_CAP = 16384  # tokens per micro-batch per GPU, as our learner's token cap on the same job
VERSION_PROMPTS = 16  # prompts per policy version (our data.train_batch_size)

WORKER_MARK = "verl_plugins.workers loaded:"  # bench/verl_plugins/workers.py's MARK (no torch here)


def plugin_report(log_text: str) -> dict[str, Any]:
    """How many of verl's processes loaded bench/verl_plugins/workers.py, from the run's log (Ray
    forwards each worker's output, prefixed), and whether every one patched the logprobs."""
    lines = [line.split(WORKER_MARK, 1)[1] for line in log_text.splitlines() if WORKER_MARK in line]
    return {
        "processes": len(lines),
        "logprobs_patched": bool(lines) and all("logprobs in -" not in line for line in lines),
    }


VERL_TIMINGS = {  # verl's metric -> the report's split name
    "timing_s/gen": "generate",
    "timing_s/reward": "reward",
    "timing_s/old_log_prob": "old_log_prob",
    "timing_s/ref": "ref",
    "timing_s/adv": "adv",
    "timing_s/update_actor": "update",
    "timing_s/update_weights": "weights",
    "timing_s/param_sync": "weights",
    "timing_s/wait_for_enough_samples": "wait",
    "timing_s/step": "step_reported",
}
SEPARATE_TIMINGS = VERL_TIMINGS | {"timing_s/gen": "wait"}
"""V1's separate_async trainer times as ``gen`` its wait for the rollout's samples (both
mini-batches of a step), not generation, which runs on the other GPU meanwhile."""
MEMORY_KEYS = {  # the report's name -> verl's metric (V1 logs the actor's under actor/)
    "allocated": ("perf/max_memory_allocated_gb", "actor/perf/max_memory_allocated_gb"),
    "reserved": ("perf/max_memory_reserved_gb", "actor/perf/max_memory_reserved_gb"),
}
STALENESS_KEYS = {  # V1's sampler: how many versions the trained trajectories spanned
    "mean": "training/off_policy/trajectory_staleness/mean",
    "max": "training/off_policy/trajectory_staleness/max",
}

FAIR = [
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.ref.strategy=fsdp2",
    "actor_rollout_ref.model.use_remove_padding=true",
    f"actor_rollout_ref.model.external_lib={WORKER_LIB}",
    "+actor_rollout_ref.model.override_config.attn_implementation=torch_varlen",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TOKEN_CAP}",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
    f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={TOKEN_CAP}",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
    f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={TOKEN_CAP}",
]


def job_overrides(model: str, work: Path) -> list[str]:
    """The long-tail job for any verl trainer: data, model, optimizer, KL, GRPO, rollout."""
    data = work / "data-longtail-verl"
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}",
        "data.max_prompt_length=512",
        "data.max_response_length=1792",
        "data.return_raw_chat=true",
        "data.dataloader_num_workers=0",
        "data.shuffle=true",
        "data.seed=0",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.optim.lr=2e-5",
        "actor_rollout_ref.actor.optim.weight_decay=0.01",
        "actor_rollout_ref.actor.optim.clip_grad=1.0",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # prompts: 8 x n 8 = our 64 samples
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=bfloat16",
        "actor_rollout_ref.rollout.max_num_seqs=256",
        "actor_rollout_ref.rollout.max_model_len=2304",
        "actor_rollout_ref.rollout.enforce_eager=false",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=33",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=1",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=128",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={PLUGINS / 'calculator_tool.py'}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        f"reward.custom_reward_function.path={PLUGINS / 'reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=2",
        "trainer.nnodes=1",
        "trainer.total_epochs=100",
        "trainer.logger=[console,file]",
        "trainer.project_name=vs_verl",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={work / 'verl-ckpt'}",
        "ray_kwargs.ray_init.num_cpus=48",  # the trainer and rollouter actors ask for 10 each
        *FAIR,
    ]


def _colocated(a: argparse.Namespace, v1: bool) -> list[str]:
    return [
        f"trainer.use_v1={str(v1).lower()}",
        *(["trainer.v1.trainer_mode=sync"] if v1 else []),
        f"data.train_batch_size={VERSION_PROMPTS}",
        f"trainer.n_gpus_per_node={a.gpus}",
        f"trainer.total_training_steps={a.steps}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.35",  # FSDP shares the GPU
        f"actor_rollout_ref.rollout.agent.num_workers={2 * a.gpus}",
        f"trainer.experiment_name={'sync' if v1 else 'v0-sync'}",
    ]


def _fully_async(a: argparse.Namespace, threshold: float) -> list[str]:
    half = a.gpus // 2
    rollout = a.gpus - half
    # a version = require_batches x sync_step mini-batches of 8 prompts = 16 prompts, as our step;
    # one more version than asked for, as step 1 pays the start-up and is left out
    return [
        "data.train_batch_size=0",
        "data.gen_batch_size=1",
        "actor_rollout_ref.hybrid_engine=false",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512",
        f"actor_rollout_ref.rollout.agent.num_workers={2 * rollout}",
        f"trainer.n_gpus_per_node={half}",
        "rollout.nnodes=1",
        f"rollout.n_gpus_per_node={rollout}",
        f"rollout.total_rollout_steps={VERSION_PROMPTS * (a.steps + 1)}",
        "async_training.require_batches=1",
        "async_training.trigger_parameter_sync_step=2",
        f"async_training.staleness_threshold={threshold}",
        "async_training.partial_rollout=true",
        "async_training.concurrent_samples_per_replica=32",
        f"trainer.experiment_name=fully_async_t{threshold:g}",
    ]


def _separate_async(a: argparse.Namespace, versions: int) -> list[str]:
    half = a.gpus // 2
    # one version = parameter_sync_step x ppo_mini_batch_size prompts = 2 x 8 = 16, as our step.
    # verl's threshold counts the steps a prompt spans (trained at step g, added at p: g - p + 1),
    # so data at most `versions` updates old is a span of versions + 1; and it generates ahead only
    # the batches its warm-up put in flight, one a version (its default 1 whatever the threshold)
    return [
        "trainer.use_v1=true",
        "trainer.v1.trainer_mode=separate_async",
        f"data.train_batch_size={VERSION_PROMPTS}",
        "trainer.v1.separate_async.parameter_sync_step=2",
        f"trainer.v1.separate_async.num_warmup_batches={versions}",
        f"trainer.v1.sampler.max_off_policy_threshold={versions + 1}",
        "trainer.v1.sampler.max_off_policy_strategy=wait",  # drops nothing, as our admission
        "transfer_queue.enable=true",
        "actor_rollout_ref.hybrid_engine=false",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
        # separate_async refuses the default naive engine (trainer_separate_async.py, its __init__)
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512",
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={a.gpus - half}",
        f"actor_rollout_ref.rollout.agent.num_workers={2 * (a.gpus - half)}",
        f"trainer.n_gpus_per_node={half}",
        f"trainer.total_training_steps={a.steps}",
        f"trainer.experiment_name=separate_async_s{versions}",
    ]


@dataclass(frozen=True)
class VerlConfig:
    """One verl trainer run: its label, entrypoint module, overrides and placement in words."""

    label: str
    module: str
    overrides: Callable[[argparse.Namespace], list[str]]
    placement: Callable[[int], str]
    staleness: str
    timings: Mapping[str, str] = field(default_factory=lambda: VERL_TIMINGS)
    """verl's timing metrics -> the report's split names, for this trainer."""


def _sync_placement(gpus: int) -> str:
    return f"colocated on {gpus} GPU(s): FSDP over all, a vLLM replica on each, asleep in training"


def _split_placement(gpus: int) -> str:
    half = gpus // 2
    return f"trainer on {half} GPU(s), rollouter (standalone vLLM) on the other {gpus - half}"


FIXED = {
    "sync": VerlConfig(
        "verl-sync",
        "verl.trainer.main_ppo",
        lambda a: _colocated(a, v1=True),
        _sync_placement,
        "0 (synchronous)",
    ),
    "v0-sync": VerlConfig(
        "verl-v0-sync",
        "verl.trainer.main_ppo",
        lambda a: _colocated(a, v1=False),
        _sync_placement,
        "0 (synchronous)",
    ),
}
ASYNC_PREFIX = "fully-async-t"
SEPARATE_PREFIX = "separate-async-s"


def verl_config(name: str, gpus: int) -> VerlConfig:
    """The `VerlConfig` of ``name`` (see the module docstring), or ValueError naming the valid ones
    (fully-async needs a GPU for each side)."""
    if name in FIXED:
        return FIXED[name]
    t = _threshold(name, ASYNC_PREFIX)
    k = _threshold(name, SEPARATE_PREFIX)
    if (t is None and k is None) or (k is not None and k != int(k)):
        raise ValueError(
            f"unknown verl configuration {name!r}: expected one of {sorted(FIXED)}, "
            f"{ASYNC_PREFIX}T (T >= 0, verl's async_training.staleness_threshold) or "
            f"{SEPARATE_PREFIX}K (K >= 0 versions, our max_staleness: V1's "
            "max_off_policy_threshold K + 1 with K batches generated ahead)"
        )
    if gpus < 2:
        raise ValueError(f"{name}: verl's separated trainers need >= 2 GPUs (--gpus {gpus})")
    if k is not None:
        return VerlConfig(
            f"verl-{name}",
            "verl.trainer.main_ppo",
            lambda a: _separate_async(a, int(k)),
            _split_placement,
            f"at most {int(k)} versions old (max_off_policy_threshold {int(k) + 1}, "
            f"{int(k)} batches ahead, strategy wait)",
            SEPARATE_TIMINGS,
        )
    assert t is not None
    return VerlConfig(
        f"verl-{name}",
        "verl.experimental.fully_async_policy.fully_async_main",
        lambda a: _fully_async(a, t),
        _split_placement,
        f"staleness_threshold {t:g}: up to {1 + t:g} versions' samples between syncs",
    )


def _threshold(name: str, prefix: str) -> float | None:
    if not name.startswith(prefix):
        return None
    try:
        t = float(name.removeprefix(prefix))
    except ValueError:
        return None
    return t if t >= 0 else None


def overrides(cfg: VerlConfig, a: argparse.Namespace, model: str, work: Path) -> list[str]:
    """All hydra overrides of one run: the job, the configuration's own, then ``--verl-arg``s."""
    return [*job_overrides(model, work), *cfg.overrides(a), *a.verl_arg]


class MetricsWatcher:
    """Tails verl's file-logger JSONL while the run goes on and stamps each record with the wall
    clock (time.time()) at which it appeared: verl writes no time of its own. With ``out``, each
    stamped record is also appended there as it comes, so a run killed from outside keeps them."""

    def __init__(self, path: Path, interval: float = 0.2, out: Path | None = None) -> None:
        self.path, self.interval, self.out = path, interval, out
        self.records: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tail = JsonlTail(path, from_start=True)

    def _poll(self) -> None:
        now = time.time()
        for rec in self._tail.read():
            if isinstance(rec.get("data"), dict):
                stamped = {"t": now, "step": rec.get("step"), "data": rec["data"]}
                self.records.append(stamped)
                if self.out is not None:
                    with self.out.open("a") as f:
                        f.write(json.dumps(stamped) + "\n")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._poll()

    def has_versions(self, n: int, settle_s: float = 5.0) -> bool:
        """Whether ``n`` versions are in and no record came for ``settle_s`` (a version's records
        come within a moment of each other): the run has what the bench asked for. verl's
        trainers do not stop after the versions asked for, so the bench stops them here."""
        records = self.records
        if not records or time.time() - records[-1]["t"] < settle_s:
            return False
        return len(by_version(records)) >= n

    def __enter__(self) -> MetricsWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._poll()


TRAINED = "training/global_step"
"""The key of a record that a training step wrote (the fully-async rollouter also logs alone)."""


def by_version(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records merged per step (verl's fully-async trainer logs a version in several records), in
    step order, each with ``t``: when its last record appeared. A step no training record names is
    left out: the fully-async rollouter logs a step 0 of its own before the trainer's first."""
    merged: dict[int, dict[str, Any]] = {}
    for r in records:
        if not isinstance(r.get("step"), int):
            continue
        m = merged.setdefault(r["step"], {"t": r["t"]})
        m.update(r["data"])
        m["t"] = max(m["t"], r["t"])
    return [{"step": s, **merged[s]} for s in sorted(merged) if TRAINED in merged[s]]


def _first(record: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    """The first of ``keys`` that ``record`` has (a metric verl's trainers name differently)."""
    return next((k for k in keys if k in record), None)


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def summarize(
    records: list[dict[str, Any]], timings: Mapping[str, str] = VERL_TIMINGS
) -> dict[str, Any]:
    """The report's figures of one verl run, from its stamped records: per version (step) after the
    first (start-up), the wall-clock between versions, its split as verl times it (``timings``:
    the trainer's metric names), tokens/s (prompt and response tokens of those versions / their
    wall-clock), the reward and the clock curves, verl's own memory and staleness figures."""
    steps = by_version(records)
    if not steps:
        return {"steps_done": 0}
    walls = [b["t"] - a["t"] for a, b in itertools.pairwise(steps)]
    body = steps[1:]
    split: dict[str, float] = {}
    for key, name in timings.items():
        mean = _mean([float(s[key]) for s in body if isinstance(s.get(key), (int, float))])
        if mean is not None:
            split[name] = round(split.get(name, 0.0) + mean, 4)
    split["step"] = _mean(walls) or 0.0
    counted = [
        (float(s["perf/total_num_tokens"]), w)
        for s, w in zip(body, walls, strict=True)
        if isinstance(s.get("perf/total_num_tokens"), (int, float)) and w > 0
    ]
    seconds = sum(w for _, w in counted)  # tokens over time, as bench/e2e.py counts ours
    t0 = steps[0]["t"]
    return {
        "steps_done": len(steps),
        "split_s": split,
        "step_s_each": [round(w, 3) for w in walls],
        "tokens_per_s": round(sum(n for n, _ in counted) / seconds, 4) if seconds else None,
        "response_length_mean": _mean(
            [float(s["response_length/mean"]) for s in body if "response_length/mean" in s]
        ),
        "reward_curve": [round(float(s.get("critic/score/mean", float("nan"))), 4) for s in steps],
        "clock_curve": [round(s["t"] - t0, 2) for s in steps],
        "verl_memory_gb": {
            k: v
            for k, keys in MEMORY_KEYS.items()
            if (v := _mean([float(s[key]) for s in body if (key := _first(s, keys))])) is not None
        },
        "trajectory_staleness": {
            k: v
            for k, key in STALENESS_KEYS.items()
            if (v := _mean([float(s[key]) for s in body if key in s])) is not None
        },
    }
