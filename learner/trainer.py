"""The learner's training loop: intake -> prepare -> update -> broadcast -> metrics -> checkpoint.

Design: one async task owns the loop; the learner link (``learner.link``) serves rollout servers
concurrently in the same task group, so receiving, acknowledging and credit-granting never pause while the workers train.
The workers (Ray actors, FSDP2) are driven through `WorkerGroup`'s typed calls; the trainer itself
only does the light, batch-level work (advantages, KL-in-reward, importance weights, metrics).
Each new policy version goes out through one call of `learner.publisher.WeightPublisher`.
Freshness is enforced on data, not on acknowledgements: the learner never waits for a rollout
server's WEIGHTS_APPLIED. With admission (``learner.admission``, the default) the link grants servers
only groups that can still be trained within max_staleness and waits for a slow one rather than drop it,
so nothing generated is wasted (``rollout/waste_frac``); a server that dies takes its grants with
it, so it never stalls the learner. Without it, groups older than max_staleness are dropped.
Validation (``trainer.val_before_train``, every ``trainer.test_freq`` steps) is the one wait on the
rollout servers: ``_validate`` asks them to run the validation set and blocks training until they
answered, left, or ``trainer.val_timeout_s`` passed (``learner.validation``).
The learner's timeline (``RUN_DIR/timeline/learner.jsonl``, ``common.timeline``) gets a span per
phase of every step (the same laps as the ``timing/*`` metrics), per validation and per checkpoint,
the link's grants and publishes, and the buffer's levels sampled by a task of the training group.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import torch
from anyio.abc import TaskStatus

from common.config.errors import ConfigError, Issue
from common.config.root import Config
from common.epochs import total_steps
from common.logging import get_logger
from common.run_events import Kind, emit
from common.rundir import checkpoint_dir
from common.safetensors_buffers import load_dir, load_file
from common.timeline import (
    CHECKPOINT_SPAN,
    Role,
    TimelineWriter,
    Track,
    sample_every,
    timeline_path,
)
from learner import checkpoints, trained_log, versions, waits
from learner.agent_metrics import KnownNames, agent_metrics
from learner.checkpoint_io import ADAPTER_DIR
from learner.early_reference import EarlyReference
from learner.early_update import EarlyUpdate, Held, unavailable
from learner.link import LearnerLink
from learner.prepare import (
    batch_metrics,
    batching,
    mini_batch_count,
    old_logprobs_from_update,
    reduce_worker_metrics,
    rewards_and_advantages,
    to_samples,
)
from learner.publisher import WeightPublisher
from learner.run_settings import check_lora_resume, lora_record, worker_settings
from learner.samples import Batching, Sample, split_for_ranks
from learner.sinks import MetricSinks
from learner.step_forwards import forward_passes
from learner.validation import due, validate_policy
from learner.versions import VersionLedger
from learner.worker_api import UpdateRequest, WorkerInfo
from learner.workers import WorkerGroup, init_ray
from protocol.adapters import ADAPTER_FILE
from protocol.staleness import weights_lag
from protocol.trajectory import Trajectory
from protocol.weights import NamedBuffer

if TYPE_CHECKING:
    from learner.algorithms.kl import KLController
    from learner.intake import TakenBatch

TRAINED_IDS = trained_log.TRAINED_IDS


def initial_weights(
    model: list[NamedBuffer],
    resume: Path | None,
    publisher: WeightPublisher,
    adapter_path: str | None = None,
) -> list[NamedBuffer]:
    """What the run's first version is: the model, or the resumed checkpoint's export; with
    adapter-only updates that export's adapter alone (servers run the base model already), or at a
    fresh start the adapter of ``lora_adapter_path`` (else the model)."""
    if resume is None:
        if adapter_path is not None:
            return load_file(Path(adapter_path) / ADAPTER_FILE)
        return model
    if publisher.adapter_dtype is not None:
        return load_file(resume / "hf" / ADAPTER_DIR / ADAPTER_FILE)
    return load_dir(resume / "hf")


def lora_metrics(info: WorkerInfo, publisher: WeightPublisher) -> dict[str, float]:
    """What LoRA trains and what its adapter weighs: the trainable parameters and their share of
    the policy's, the bytes an adapter-only weight update moves (in the served dtype) and those a
    full one would (``weights/bytes`` is what each update did move)."""
    return {
        "actor/trainable_params": float(info.trainable_params),
        "actor/lora_trainable_frac": info.trainable_params / max(info.params, 1),
        "weights/adapter_bytes": float(publisher.adapter_bytes(info.trainable_params)),
        "weights/full_bytes": float(publisher.model_bytes),
    }


@dataclass
class Timer:
    marks: dict[str, float]
    wall: float  # wall clock at the start of the current lap (time.time(): the timeline's clock)

    @classmethod
    def start(cls) -> Timer:
        return cls({"_t": time.perf_counter()}, time.time())

    def lap(self, name: str) -> tuple[float, float]:
        """End the lap ``name``; its (start, end) in wall-clock time, as long as the metric says."""
        now = time.perf_counter()
        self.marks[name] = now - self.marks["_t"]
        self.marks["_t"] = now
        start, self.wall = self.wall, self.wall + self.marks[name]
        return start, self.wall

    def metrics(self) -> dict[str, float]:
        parts = {f"timing/{k}_s": v for k, v in self.marks.items() if k != "_t"}
        return parts | {"timing/step_s": sum(parts.values())}


@dataclass(frozen=True)
class StepUpdate:
    metrics: dict[str, float]
    # the policy changed: a new version to publish (false during critic warm-up)
    actor_updated: bool


class Trainer:
    def __init__(self, config: Config, run_dir: Path) -> None:
        self.config, self.run_dir = config, run_dir
        key = "actor_rollout_ref.actor.first_mini_batch_in_waits"
        if config.actor_rollout_ref.actor.first_mini_batch_in_waits and (
            why := unavailable(config)
        ):
            raise ConfigError(
                [Issue(key, f"true needs a step whose first mini-batch is final: {why}")]
            )
        self.log = get_logger("learner")
        self.total = total_steps(config)
        self.settings = worker_settings(config, self.total)
        self.world = config.trainer.nnodes * config.trainer.n_gpus_per_node
        self.step = 0
        self.version = 0
        self.ckpt_root = checkpoint_dir(config, run_dir)
        self.max_staleness = config.actor_rollout_ref.rollout.max_staleness
        self._kl_ctrl: KLController | None = None
        self._workers: WorkerGroup | None = None
        self._link: LearnerLink | None = None
        self.publisher: WeightPublisher | None = None  # made once the link is bound
        # versions only go up across restarts (learner.versions)
        self.ledger = VersionLedger(run_dir)
        self._resume_metrics: dict[str, float] = {}  # logged with the first step
        self._model_metrics: dict[str, float] = {}  # logged with every step (`lora_metrics`)
        self._val_reward: float | None = None  # the last validation's val/reward/mean
        self.timeline = TimelineWriter.off()  # opened by run()
        self._early_ref: EarlyReference | None = None  # made with the workers
        self._early_update: EarlyUpdate | None = None  # likewise

    # The parts made at start-up (`run`), each checked once here rather than at every use.
    @property
    def kl_ctrl(self) -> KLController:
        if self._kl_ctrl is None:
            raise RuntimeError("the algorithm state is not initialised yet (_init_algorithm_state)")
        return self._kl_ctrl

    @property
    def workers(self) -> WorkerGroup:
        if self._workers is None:
            raise RuntimeError("the workers are not started yet")
        return self._workers

    @workers.setter
    def workers(self, group: WorkerGroup) -> None:
        self._workers = group

    @property
    def link(self) -> LearnerLink:
        if self._link is None:
            raise RuntimeError("the learner link is not bound yet")
        return self._link

    # -- start-up --------------------------------------------------------------------------------
    def _resume_state(self) -> tuple[Path | None, dict[str, Any] | None]:
        t = self.config.trainer
        path = checkpoints.resume_point(t.resume_mode, self.ckpt_root, t.resume_from_path)
        return path, (checkpoints.read_state(path) if path else None)

    async def _start_workers(self, resume: Path | None) -> None:

        self.workers = WorkerGroup(
            self.settings, self.world, place_timeout_s=self.config.ray.place_timeout_s
        )
        info = await self.workers.start()
        self.log.info(
            "workers ready",
            world_size=self.world,
            backend=info[0].backend,
            device=info[0].device,
            params=info[0].params,
        )
        if self.settings.lora is not None and self.publisher is not None:
            self._model_metrics = lora_metrics(info[0], self.publisher)
            self.log.info("LoRA adapters on the actor", **self._model_metrics)
        if resume is not None:
            await self.workers.load_checkpoint(str(resume))
        arr = self.config.actor_rollout_ref
        early_update = arr.actor.first_mini_batch_in_waits
        if self.settings.need_ref and (arr.ref.forward_in_waits or early_update):
            chunk = arr.actor.ppo_micro_batch_size_per_gpu * self.world
            self._early_ref = EarlyReference(self.workers, self._batching, chunk, self.timeline)
        if early_update:
            self._early_update = EarlyUpdate(
                self.config,
                self.settings,
                self.workers,
                self._batching,
                self.kl_ctrl,
                self._early_ref,
                self.timeline,
            )

    def _init_algorithm_state(
        self, state: dict[str, Any] | None, resume_path: Path | None = None
    ) -> None:
        # lazy: learner.algorithms imports verl
        from learner.algorithms import make_kl_controller

        k = self.config.algorithm.kl_ctrl
        self._kl_ctrl = make_kl_controller(
            k.type, kl_coef=k.kl_coef, target_kl=k.target_kl, horizon=k.horizon
        )
        torch.manual_seed(self.config.trainer.seed)
        if state:
            check_lora_resume(state, self.settings.lora, resume_path)
            self.step, self.version = state["step"], state["policy_version"]
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
            self._val_reward = state.get("val_reward")
        # After a restart the restored weights may need a version above every one published.
        r = versions.resume(
            self.run_dir,
            self.ledger,
            step=self.step,
            checkpoint_version=self.version,
            checkpoint=resume_path,
        )
        self.version, self._resume_metrics = r.version, r.metrics()

    # -- one step --------------------------------------------------------------------------------
    def _batching(self, micro_size: int | None = None) -> Batching:
        """How this learner's passes cut micro-batches, as far as its workers can lay them out."""

        return batching(
            self.config,
            micro_size,
            can_pack=self.workers.can_pack,
            can_share=self.workers.can_share_prefix,
        )

    async def _prepare(
        self, trajs: list[Trajectory], samples: list[Sample], ref_missing: list[int] | None
    ) -> dict[str, float]:
        """The forwards (`learner.step_forwards`; reference logprobs only for ``ref_missing`` when
        the wait computed the others), then rewards, advantages and importance weights
        (``learner.prepare``)."""
        # Old logprobs (of the first mini-batch at least) from the update's own forward: then the
        # importance weights and logprob_diff come from the workers with the update's metrics (the
        # rule: old_logprobs_from_update).
        in_update = old_logprobs_from_update(self.config, self.step) is not None
        await forward_passes(
            self.config,
            self.settings,
            self.workers,
            self._batching(),
            samples,
            in_update=in_update,
            ref_missing=ref_missing,
        )
        return rewards_and_advantages(
            self.config,
            trajs,
            samples,
            self.kl_ctrl,
            in_update=in_update,
            critic=bool(self.settings.critic_model_path),
        )

    async def _update(self, samples: list[Sample], held: Held | None = None) -> StepUpdate:
        """``held``: the workers hold this step's first mini-batch (`learner.early_update`): the
        update continues it with the later ones."""

        cfg = self.config.actor_rollout_ref.actor
        n_mini = mini_batch_count(self.config)
        old_from_forward = old_logprobs_from_update(self.config, self.step)
        for s in samples:
            if old_from_forward is None:  # else the workers compare old and rollout logprobs
                s.rollout_logprobs = None  # not needed by the loss: do not ship it
            if not self.settings.use_kl_loss:
                s.ref_logprobs = None
        metrics: dict[str, float] = {}
        if self.settings.critic_model_path:
            plans = split_for_ranks(
                samples,
                mini_batches=n_mini,
                ranks=self.world,
                batching=self._batching(self.config.critic.ppo_micro_batch_size_per_gpu),
            )
            res = await self.workers.update(
                [UpdateRequest("critic", p, cfg.ppo_epochs) for p in plans]
            )
            metrics |= reduce_worker_metrics(res, "critic")
        if self.step < self.config.trainer.critic_warmup:
            return StepUpdate(metrics, actor_updated=False)
        plans = split_for_ranks(
            samples,
            mini_batches=n_mini,
            ranks=self.world,
            batching=self._batching(),
        )
        if held is not None:
            requests = [
                UpdateRequest("actor", p[1:], 1, old_from_forward, continues=True) for p in plans
            ]
        else:
            requests = [UpdateRequest("actor", p, cfg.ppo_epochs, old_from_forward) for p in plans]
        res = await self.workers.update(requests)
        metrics |= reduce_worker_metrics(res, "actor")
        self.version += 1
        return StepUpdate(metrics, actor_updated=True)

    async def train_step(self) -> dict[str, float]:
        timer = Timer.start()
        rollout = self.config.actor_rollout_ref.rollout
        step, tl = self.step + 1, self.timeline
        intake, early, early_update = self.link.intake, self._early_ref, self._early_update
        in_waits = early if self.config.actor_rollout_ref.ref.forward_in_waits else None
        taken = await waits.next_batch(
            intake,
            self.config.data.train_batch_size,
            self.version,
            self.max_staleness,
            step,
            early_ref=in_waits,
            early_update=early_update if self.step >= self.config.trainer.critic_warmup else None,
        )
        held = early_update.take(taken) if early_update else None
        trajs = list(taken.trajectories)
        tl.span(Track.STEP, "wait", *timer.lap("wait"), step=step, groups=groups_by_server(taken))
        metrics = batch_metrics(trajs, taken.staleness, self.version)
        metrics |= agent_metrics(trajs, KnownNames.from_config(self.config))
        if taken.mix:  # mixed run: groups per source, and places another source filled
            metrics["batch/mix_shortfall"] = float(taken.mix_shortfall)
            for src in sorted({*taken.mix, *taken.sources}):
                metrics[f"batch/groups/{src or 'unknown'}"] = float(taken.sources.count(src))
        samples = to_samples(trajs)
        ref_missing = early.take(trajs, samples, intake.buffered()) if early else None
        metrics |= await self._prepare(trajs, samples, ref_missing)
        metrics |= early.metrics(len(samples)) if early else {}
        metrics |= early_update.metrics(held) if early_update else {}
        tl.span(Track.STEP, "prepare", *timer.lap("prepare"), step=step)
        tokens = sum(len(s.input_ids) for s in samples)
        update = await self._update(samples, held)
        metrics |= update.metrics
        tl.span(Track.STEP, "update", *timer.lap("update"), step=step, tokens=tokens)
        if update.actor_updated:
            assert self.publisher is not None  # made in run(), before any step
            metrics |= await self.publisher.publish(self.version, self.workers)
        tl.span(Track.STEP, "broadcast", *timer.lap("broadcast"), step=step, version=self.version)
        metrics |= self.link.weights.metrics()
        self.link.intake.mark_trained(taken)
        metrics |= self.link.intake.waste_metrics()
        # Dynamic sampling (algorithm.filter_groups): groups not trained, counted apart from waste.
        metrics |= self.link.intake.filter_metrics()
        # intake/violations/<CODE>: refused peer messages.
        metrics |= self.link.peer_logs.metrics()
        self.step += 1
        self._audit(trajs)
        metrics |= timer.metrics()
        stats = self.link.stats
        metrics |= {
            "perf/tokens_per_s": tokens / max(metrics["timing/step_s"], 1e-9),
            "perf/update_tokens_per_s": tokens
            * self.config.actor_rollout_ref.actor.ppo_epochs
            / max(timer.marks.get("update", 0.0), 1e-9),
            "policy/version": float(self.version),
            "intake/dropped_stale": float(taken.dropped_stale),
            "intake/carried_past_bound": float(taken.carried_past_bound),
            "intake/dropped_stale_total": float(stats.get("dropped_stale_groups", 0)),
            "intake/peers": float(stats.get("peers", 0)),
            "kl_ctrl/coef": float(self.kl_ctrl.value),
            "rollout/n": float(rollout.n),
        }
        lag = [weights_lag(self.version, v) for v in self.link.weights.peer_versions.values()]
        if lag:
            metrics["weights/servers_behind"] = float(sum(x > 0 for x in lag))
        return metrics

    def _audit(self, trajs: list[Trajectory]) -> None:
        """One line per step in RUN_DIR/trained.jsonl: which trajectories this step trained on (for
        replay checks and for proving exactly-once training across restarts). A resumed run appends,
        after a rollback record for the steps it undid (``learner.trained_log``)."""
        trained_log.append_step(
            self.run_dir / TRAINED_IDS, self.step, self.version, [t.trajectory_id for t in trajs]
        )

    # -- checkpoints -----------------------------------------------------------------------------
    async def save_checkpoint(self) -> Path:
        started = time.time()
        staging = checkpoints.staging_dir(self.ckpt_root, self.step)
        await self.workers.save_checkpoint(str(staging))
        await self.workers.export_hf(str(staging / "hf"), self.config.actor_rollout_ref.model.path)
        intake_state = self.link.intake.state_dict()
        state = {
            "step": self.step,
            "policy_version": self.version,
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "intake": intake_state,
            "val_reward": self._val_reward,  # the last validation's, for keep_best_ckpt
            "lora": lora_record(self.settings.lora),  # a resume with other adapters is refused
        }
        t = self.config.trainer
        path = checkpoints.finalize(
            self.ckpt_root,
            staging,
            self.step,
            state,
            keep=t.max_actor_ckpt_to_keep,
            keep_best=t.keep_best_ckpt,
        )
        self.link.intake.checkpoint_saved(intake_state)
        self.log.info("checkpoint saved", step=self.step, version=self.version, path=str(path))
        self.timeline.span(Track.STEP, CHECKPOINT_SPAN, started, time.time(), step=self.step)
        return path

    # -- the run ---------------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> int:
        resume, state = self._resume_state()
        self._init_algorithm_state(state, resume)
        self.timeline = TimelineWriter(
            timeline_path(self.run_dir, Role.LEARNER, "learner"), role=Role.LEARNER
        )
        # ray.init blocks for seconds: done before the intake listens, so heartbeats never stall.
        init_ray(self.config.ray.address, self.config.ray.num_cpus)
        v0 = load_dir(self.config.actor_rollout_ref.model.path)
        self._link = LearnerLink(
            self.config,
            self.run_dir,
            state=state["intake"] if state else None,
            fresh=resume is None and self.config.trainer.resume_mode == "disable",
            timeline=self.timeline,
            lineage=self.ledger.lineage,  # restarts: the journaled groups aged by real updates
        )
        if self.config.learner.admission:
            b = self.config.data.train_batch_size
            self.link.admission.configure(b, self.max_staleness, (self.total - self.step) * b)
        if self.config.data.datasets:  # each step in the configured mix (learner/intake.py)
            self.link.intake.configure_mix(
                {d.name: d.ratio for d in self.config.data.datasets},
                self.config.learner.mix_wait_s,
            )
        # The policy the run starts from, straight from disk (the model, or the resumed checkpoint's
        # export): rollout servers that join get it at once, before the workers are even up.
        publisher = self.publisher = WeightPublisher.open(
            self.config, self.link.weights, self.ledger, v0
        )
        start = initial_weights(
            v0, resume, publisher, self.config.actor_rollout_ref.model.lora_adapter_path
        )
        publisher.publish_initial(self.version, start)
        t = self.config.trainer
        sinks = MetricSinks(
            t.logger,
            self.run_dir,
            total_steps=self.total,
            start_step=self.step,
            project=t.project_name,
            experiment=t.experiment_name,
            config=self.config.model_dump(mode="json"),
        )
        try:
            async with anyio.create_task_group() as tg:
                address = await tg.start(self.link.run)
                # bin/train starts rollout servers on it
                emit(Kind.LISTENING, "learner", address=address)
                try:
                    async with anyio.create_task_group() as training:
                        training.start_soon(self._on_signal, training.cancel_scope)
                        training.start_soon(
                            sample_every, self.timeline, self.link.intake.timeline_levels
                        )
                        await self._train(resume, address, sinks, task_status)
                        training.cancel_scope.cancel()  # stops the signal watcher and sampler
                finally:
                    self.link.close()  # BYE to every rollout server; link.run returns once sent
        finally:
            # The slot files first: a SIGKILL during the slower steps must not leave them on /dev/shm.
            publisher.close()
            sinks.close()
            self.timeline.close()
            if self._workers is not None:
                self._workers.shutdown()
        return 0

    async def _train(
        self, resume: Path | None, address: str, sinks: MetricSinks, task_status: TaskStatus[str]
    ) -> None:
        t = self.config.trainer
        await self._start_workers(resume)
        self.log.info(
            "training",
            address=address,
            from_step=self.step,
            to_step=self.total,
            policy_version=self.version,
            resumed_from=str(resume) if resume else None,
        )
        task_status.started(address)
        if t.val_before_train:  # also when resuming, as verl does
            sinks.log(self.step, await self._validate())
        while self.step < self.total:
            metrics = await self.train_step()
            metrics |= self._model_metrics | self._resume_metrics
            self._resume_metrics = {}
            if due(self.step, t.test_freq):
                metrics |= await self._validate()
            sinks.log(self.step, metrics)
            if t.save_freq > 0 and (self.step % t.save_freq == 0 or self.step == self.total):
                await self.save_checkpoint()
        if t.save_freq <= 0 and t.export_final_model:  # no checkpoints: leave the model behind
            final = self.run_dir / "final-hf"
            await self.workers.export_hf(str(final), self.config.actor_rollout_ref.model.path)
            self.log.info("model exported", path=str(final))
        self.log.info("training done", steps=self.step, policy_version=self.version)

    # -- validation ------------------------------------------------------------------------------
    async def _validate(self) -> dict[str, float]:
        """Validate the current policy on the rollout servers (blocking, bounded by
        trainer.val_timeout_s); the ``val/...`` metrics of what arrived."""
        t = self.config.trainer
        metrics = await validate_policy(
            self.link.validation,
            self.version,
            self.step,
            timeout_s=t.val_timeout_s,
            shard_wait_s=t.val_shard_wait_s,
            timeline=self.timeline,
            log=self.log,
        )
        if "val/reward/mean" in metrics:  # for keep_best_ckpt
            self._val_reward = float(metrics["val/reward/mean"])
        return metrics

    async def _on_signal(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for sig in signals:
                self.log.info("stopping", signal=signal.Signals(sig).name, step=self.step)
                scope.cancel()
                return


def groups_by_server(taken: TakenBatch) -> dict[str, int]:
    """How many of a step's groups each rollout server generated (the timeline's wait spans)."""
    out: dict[str, int] = {}
    i = 0
    for size in taken.group_sizes:
        if size:
            server = taken.trajectories[i].source_server or "unknown"
            out[server] = out.get(server, 0) + 1
        i += size
    return out
