"""The learner's training loop: intake -> prepare -> update -> broadcast -> metrics -> checkpoint.

Design: one async task owns the loop; the intake serves rollout servers concurrently in the same
task group, so receiving, acknowledging and credit-granting never pause while the workers train.
The workers (Ray actors, FSDP2) are driven through `WorkerGroup`; the trainer itself only does the
light, batch-level work (advantages, KL-in-reward, importance weights, metrics). Freshness is
enforced on data, not on acknowledgements: the learner never waits for a rollout server's
WEIGHTS_APPLIED. With admission (``learner.admission``, the default) the intake grants servers only
groups that can still be trained within max_staleness and waits for a slow one rather than drop it,
so nothing generated is wasted (``rollout/waste_frac``); a server that dies takes its grants with
it, so it never stalls the learner. Without it, groups older than max_staleness are dropped.
Validation (``trainer.val_before_train``, every ``trainer.test_freq`` steps) is the one wait on the
rollout servers: ``_validate`` asks them to run the validation set and blocks training until they
answered, left, or ``trainer.val_timeout_s`` passed (``learner.validation``).
"""

from __future__ import annotations

import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from common.epochs import total_steps
from common.logging import get_logger
from common.run_events import Kind, emit
from common.rundir import checkpoint_dir
from learner import checkpoints, trained_log, versions
from learner.prepare import (
    batch_metrics,
    reduce_worker_metrics,
    remax_baselines,
    response_tensors,
    set_tokens,
    to_samples,
    token_level_scores,
)
from learner.samples import Sample, split_for_ranks, split_forward
from learner.validation import due
from learner.versions import VersionLedger
from learner.worker import WorkerSettings
from protocol.weights import NamedBuffer

TRAINED_IDS = trained_log.TRAINED_IDS


def worker_settings(config: Any, total_steps: int) -> WorkerSettings:
    arr, critic, trainer = config.actor_rollout_ref, config.critic, config.trainer
    actor, optim = arr.actor, arr.actor.optim
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total_steps)
    device = trainer.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return WorkerSettings(
        model_path=arr.model.path, device=device, trust_remote_code=arr.model.trust_remote_code,
        gradient_checkpointing=arr.model.enable_gradient_checkpointing,
        param_offload=actor.fsdp_config.param_offload, optimizer_offload=actor.fsdp_config.optimizer_offload,
        lr=optim.lr, betas=(optim.betas[0], optim.betas[1]), weight_decay=optim.weight_decay,
        warmup_steps=warmup, total_steps=total_steps, lr_scheduler=optim.lr_scheduler,
        min_lr_ratio=optim.min_lr_ratio, grad_clip=actor.grad_clip, temperature=arr.rollout.temperature,
        clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c, loss_agg_mode=actor.loss_agg_mode, entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type,
        need_ref=actor.use_kl_loss or config.algorithm.use_kl_in_reward,
        critic_model_path=(critic.model_path or arr.model.path) if critic.enable else None,
        critic_lr=critic.optim.lr, critic_weight_decay=critic.optim.weight_decay,
        critic_grad_clip=critic.grad_clip, cliprange_value=critic.cliprange_value, seed=trainer.seed,
    )


@dataclass
class Timer:
    marks: dict[str, float]

    @classmethod
    def start(cls) -> Timer:
        return cls({"_t": time.perf_counter()})

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.marks[name] = now - self.marks["_t"]
        self.marks["_t"] = now

    def metrics(self) -> dict[str, float]:
        parts = {f"timing/{k}_s": v for k, v in self.marks.items() if k != "_t"}
        return parts | {"timing/step_s": sum(parts.values())}


class Trainer:
    def __init__(self, config: Any, run_dir: Path) -> None:
        self.config, self.run_dir = config, run_dir
        self.log = get_logger("learner")
        self.total = total_steps(config)
        self.settings = worker_settings(config, self.total)
        self.world = config.trainer.nnodes * config.trainer.n_gpus_per_node
        self.step = 0
        self.version = 0
        self.ckpt_root = checkpoint_dir(config, run_dir)
        self.max_staleness = config.actor_rollout_ref.rollout.max_staleness
        self.kl_ctrl: Any = None
        self.workers: Any = None
        self.intake: Any = None
        self.weight_names: list[str] = []
        self.weight_dtypes: dict[str, str] = {}
        self.weight_files: Any = None  # learner.weights_files.WeightFiles when learner.weights_file_dir is set
        self.ledger = VersionLedger(run_dir)  # versions only go up across restarts (learner.versions)
        self._resume_metrics: dict[str, float] = {}  # logged with the first step

    # -- start-up --------------------------------------------------------------------------------
    def _resume_state(self) -> tuple[Path | None, dict[str, Any] | None]:
        t = self.config.trainer
        path = checkpoints.resume_point(t.resume_mode, self.ckpt_root, t.resume_from_path)
        return path, (checkpoints.read_state(path) if path else None)

    async def _start_workers(self, resume: Path | None) -> None:
        from learner.workers import WorkerGroup

        self.workers = WorkerGroup(self.settings, self.world)
        info = await self.workers.start()
        self.log.info("workers ready", world_size=self.world, backend=info[0]["backend"],
                      device=info[0]["device"], params=info[0]["params"])
        if resume is not None:
            await self.workers.all("load_checkpoint", [(str(resume),)] * self.world)

    async def _publish(self) -> dict[str, Any]:
        """Gather the policy and send it as ``self.version`` to every rollout server: written by
        rank 0 into a /dev/shm slot file when there is one (servers on this machine reload it in
        place, others get chunks cut from its pages), else gathered through Ray and chunked."""
        from common.safetensors_buffers import load_file

        t0 = time.perf_counter()
        started = time.monotonic()
        self.ledger.record(self.version)
        take = None
        if self.weight_files is not None:
            take = self.weight_files.take(self.version, oldest_applied=self.intake.file_peers_oldest_version())
        if take is not None:
            slot, path = take
            try:
                parts = await self.workers.all(
                    "write_weights_file", [(self.weight_names, self.weight_dtypes, slot, str(path))] * self.world)
            except BaseException:
                self.weight_files.failed(slot)
                raise
            chunked = self.intake.chunks_planned  # of the version this one replaces
            self.intake.publish_weights(self.version, load_file(path), file=str(path), started=started)
            self.weight_files.published(self.version, replaced_chunked=chunked)
            info = parts[0]
            return {"weights/gather_s": info["gather_s"], "weights/copy_s": info["copy_s"],
                    "weights/pinned": float(info["pinned"]), "weights/via_file": 1.0,
                    "weights/publish_s": time.perf_counter() - t0}
        parts = await self.workers.all("full_weights", [(self.weight_names, self.weight_dtypes)] * self.world)
        tensors = [NamedBuffer(n, d, shape, memoryview(np.ascontiguousarray(a)).cast("B"))
                   for n, d, shape, a in parts[0]]
        chunked = self.intake.chunks_planned
        self.intake.publish_weights(self.version, tensors, started=started)
        if self.weight_files is not None:
            self.weight_files.published(self.version, replaced_chunked=chunked)
        return {"weights/via_file": 0.0, "weights/publish_s": time.perf_counter() - t0}

    def _weight_files(self, model_bytes: int) -> Any:
        """Slot files for the file hand-over, when ``learner.weights_file_dir`` is set and has room
        for every slot (else weights go as chunks only, with a warning)."""
        import shutil

        from learner.weights_files import WeightFiles

        c = self.config.learner
        if not c.weights_file_dir:
            return None
        from learner.weights_files import remove_stale

        for stale in remove_stale(c.weights_file_dir):  # first: they may hold the room needed below
            self.log.info("removed the weights files of a learner that is gone", path=str(stale))
        try:
            free = shutil.disk_usage(c.weights_file_dir).free
            if free < 1.1 * c.weights_file_slots * model_bytes:
                raise OSError(f"{free / 1e9:.2f} GB free, {c.weights_file_slots} slots need "
                              f"{1.1 * c.weights_file_slots * model_bytes / 1e9:.2f} GB")
            return WeightFiles(c.weights_file_dir, c.weights_file_slots)
        except OSError as e:
            self.log.warning("weights go to rollout servers as chunks only: learner.weights_file_dir is not usable",
                             dir=c.weights_file_dir, error=str(e))
            return None

    def _init_algorithm_state(self, state: dict[str, Any] | None, resume_path: Path | None = None) -> None:
        from learner.algorithms import make_kl_controller

        k = self.config.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(k.type, kl_coef=k.kl_coef, target_kl=k.target_kl, horizon=k.horizon)
        torch.manual_seed(self.config.trainer.seed)
        if state:
            self.step, self.version = state["step"], state["policy_version"]
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        # After a restart the restored weights may need a version above every one published.
        r = versions.resume(self.run_dir, self.ledger, step=self.step, checkpoint_version=self.version, checkpoint=resume_path)
        self.version, self._resume_metrics = r.version, r.metrics()

    # -- one step --------------------------------------------------------------------------------
    async def _forward(self, role: str, samples: list[Sample], key: str, *, with_entropy: bool = False) -> None:
        """Forward-only pass over ``samples`` on every rank; results land in sample.tokens[key]."""
        plan = split_forward(samples, ranks=self.world, micro_size=self.settings_micro)
        per_rank = [[[samples[i] if i >= 0 else None for i in chunk] for chunk in rank] for rank in plan]
        results = await self.workers.all("forward", [(role, chunks, with_entropy) for chunks in per_rank])
        out_key = "values" if role == "critic" else "logprobs"
        for rank, res in zip(plan, results, strict=True):
            real = [i for chunk in rank for i in chunk if i >= 0]
            flat = [r for chunk in res for r in chunk]
            for i, r in zip(real, flat, strict=True):
                samples[i].tokens[key] = r[out_key]

    @property
    def settings_micro(self) -> int:
        return self.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu

    async def _prepare(self, trajs: list[Any], samples: list[Sample]) -> dict[str, float]:
        from learner.algorithms import apply_kl_in_reward, compute_advantages, truncated_is_weights
        from learner.prepare import batching, old_logprobs_from_update

        cfg, alg = self.config.actor_rollout_ref.actor, self.config.algorithm
        metrics: dict[str, float] = {}
        # Old logprobs from the update's own forward: then the importance weights and logprob_diff
        # come from the workers with the update's metrics (the rule: old_logprobs_from_update).
        in_update = old_logprobs_from_update(self.config, self.step) is not None
        passes = batching(self.config, can_pack=self.workers.can_pack)
        if cfg.off_policy.old_logprobs == "rollout":
            for s in samples:
                s.tokens["old_logprobs"] = s.tokens["rollout_logprobs"]
        elif not in_update:
            await self.workers.forward("actor", samples, "old_logprobs", passes)
        if self.settings.need_ref:
            await self.workers.forward("ref", samples, "ref_logprobs", passes)
        if self.settings.critic_model_path:
            await self.workers.forward("critic", samples, "values", passes)
        mask = response_tensors(samples)
        old = None if in_update else response_tensors(samples, "old_logprobs")
        rewards = token_level_scores(trajs, mask)
        if alg.use_kl_in_reward:
            assert old is not None  # the rule keeps the separate forward with KL in the reward
            rewards, km = apply_kl_in_reward(rewards, old, response_tensors(samples, "ref_logprobs"), mask,
                                             controller=self.kl_ctrl, kl_penalty_kind=alg.kl_penalty)
            self.kl_ctrl.update(float(km["kl"]), n_steps=len(samples))
            metrics |= {f"kl_in_reward/{k}": float(v) for k, v in km.items()}
        kwargs: dict[str, Any] = {
            "token_level_rewards": rewards, "response_mask": mask,
            "index": np.array([t.group_uid for t in trajs], dtype=object),
            "gamma": alg.gamma, "lam": alg.lam, "norm_adv_by_std_in_grpo": alg.norm_adv_by_std_in_grpo,
        }
        if self.settings.critic_model_path:
            kwargs["values"] = response_tensors(samples, "values")
        if alg.adv_estimator == "remax":
            kwargs["reward_baselines"] = remax_baselines(trajs)
        adv, returns = compute_advantages(alg.adv_estimator, **kwargs)
        set_tokens(samples, "advantages", adv)
        set_tokens(samples, "returns", returns)
        if old is not None and cfg.off_policy.old_logprobs == "recompute" and cfg.off_policy.is_level != "off":
            w, wm = truncated_is_weights(old, response_tensors(samples, "rollout_logprobs"), mask,
                                         cap=cfg.off_policy.is_cap, level=cfg.off_policy.is_level)
            set_tokens(samples, "is_weights", w)
            metrics |= {f"off_policy/{k}": float(v) for k, v in wm.items()}
        m = mask.bool()
        metrics["advantages/mean"] = float(adv[m].mean()) if m.any() else 0.0
        if old is not None:
            metrics["rollout/logprob_diff"] = float((old - response_tensors(samples, "rollout_logprobs"))[m].abs().mean()) if m.any() else 0.0
        return metrics

    async def _update(self, samples: list[Sample]) -> dict[str, float]:
        from learner.prepare import batching, mini_batch_count, old_logprobs_from_update

        cfg = self.config.actor_rollout_ref.actor
        n_mini = mini_batch_count(self.config)
        old_from_forward = old_logprobs_from_update(self.config, self.step)
        for s in samples:
            if old_from_forward is None:  # else the workers compare old and rollout logprobs
                s.tokens.pop("rollout_logprobs", None)  # not needed by the loss: do not ship it
            if not self.settings.use_kl_loss:
                s.tokens.pop("ref_logprobs", None)
        metrics: dict[str, float] = {}
        if self.settings.critic_model_path:
            plans = split_for_ranks(samples, mini_batches=n_mini, ranks=self.world,
                                    batching=batching(self.config, self.config.critic.ppo_micro_batch_size_per_gpu,
                                                      can_pack=self.workers.can_pack))
            res = await self.workers.all("update_critic", [(p, cfg.ppo_epochs) for p in plans])
            metrics |= reduce_worker_metrics(res, "critic")
        if self.step >= self.config.trainer.critic_warmup:
            plans = split_for_ranks(samples, mini_batches=n_mini, ranks=self.world,
                                    batching=batching(self.config, can_pack=self.workers.can_pack))
            res = await self.workers.all("update_actor", [(p, cfg.ppo_epochs, old_from_forward) for p in plans])
            metrics |= reduce_worker_metrics(res, "actor")
            self.version += 1
        return metrics

    async def train_step(self) -> dict[str, float]:
        timer = Timer.start()
        rollout = self.config.actor_rollout_ref.rollout
        taken = await self.intake.next_batch(self.config.data.train_batch_size, self.version, self.max_staleness)
        timer.lap("wait")
        trajs = list(taken.trajectories)
        metrics = batch_metrics(trajs, taken.staleness, self.version)
        samples = to_samples(trajs)
        metrics |= await self._prepare(trajs, samples)
        timer.lap("prepare")
        tokens = sum(len(s.input_ids) for s in samples)
        metrics |= await self._update(samples)
        timer.lap("update")
        updated = "actor/pg_loss" in metrics
        if updated:
            metrics |= await self._publish()
        timer.lap("broadcast")
        metrics |= self.intake.weight_update_metrics()
        self.intake.mark_trained(taken)
        metrics |= self.intake.waste_metrics()
        metrics |= self.intake.peer_error_metrics()  # intake/violations/<CODE>: refused peer messages
        self.step += 1
        self._audit(trajs)
        metrics |= timer.metrics()
        stats = self.intake.stats
        metrics |= {"perf/tokens_per_s": tokens / max(metrics["timing/step_s"], 1e-9),
                    "perf/update_tokens_per_s": tokens * self.config.actor_rollout_ref.actor.ppo_epochs
                    / max(timer.marks.get("update", 0.0), 1e-9),
                    "policy/version": float(self.version), "intake/dropped_stale": float(taken.dropped_stale),
                    "intake/dropped_stale_total": float(stats.get("dropped_stale_groups", 0)),
                    "intake/peers": float(stats.get("peers", 0)), "kl_ctrl/coef": float(self.kl_ctrl.value),
                    "rollout/n": float(rollout.n)}
        lag = [self.version - v for v in self.intake.peer_versions.values()]
        if lag:
            metrics["weights/servers_behind"] = float(sum(x > 0 for x in lag))
        return metrics

    def _audit(self, trajs: list[Any]) -> None:
        """One line per step in RUN_DIR/trained.jsonl: which trajectories this step trained on (for
        replay checks and for proving exactly-once training across restarts). A resumed run appends,
        after a rollback record for the steps it undid (``learner.trained_log``)."""
        trained_log.append_step(self.run_dir / TRAINED_IDS, self.step, self.version,
                                [t.trajectory_id for t in trajs])

    # -- checkpoints -----------------------------------------------------------------------------
    async def save_checkpoint(self) -> Path:
        staging = checkpoints.staging_dir(self.ckpt_root, self.step)
        await self.workers.all("save_checkpoint", [(str(staging),)] * self.world)
        await self.workers.all("export_hf", [(str(staging / "hf"), self.config.actor_rollout_ref.model.path)] * self.world)
        intake_state = self.intake.state_dict()
        state = {"step": self.step, "policy_version": self.version, "kl_ctrl": self.kl_ctrl.state_dict(),
                 "intake": intake_state}
        path = checkpoints.finalize(self.ckpt_root, staging, self.step, state)
        self.intake.checkpoint_saved(intake_state)
        self.log.info("checkpoint saved", step=self.step, version=self.version, path=str(path))
        return path

    # -- the run ---------------------------------------------------------------------------------
    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> int:
        from common.safetensors_buffers import load_dir
        from learner.intake import Intake
        from learner.sinks import MetricSinks
        from learner.workers import init_ray

        resume, state = self._resume_state()
        self._init_algorithm_state(state, resume)
        # ray.init blocks for seconds: done before the intake listens, so heartbeats never stall.
        init_ray(self.config.ray.address, self.config.ray.num_cpus)
        v0 = load_dir(self.config.actor_rollout_ref.model.path)
        self.weight_names = [t.name for t in v0]
        self.weight_dtypes = {t.name: t.dtype for t in v0}
        self.intake = Intake(self.config, self.run_dir, state=state["intake"] if state else None,
                             fresh=resume is None and self.config.trainer.resume_mode == "disable")
        if self.config.learner.admission:
            b = self.config.data.train_batch_size
            self.intake.configure_admission(b, self.max_staleness, (self.total - self.step) * b)
        # The policy the run starts from, straight from disk (the model, or the resumed checkpoint's
        # export): rollout servers that join get it at once, before the workers are even up.
        self.ledger.record(self.version)
        self.intake.publish_weights(self.version, v0 if resume is None else load_dir(resume / "hf"))
        self.weight_files = self._weight_files(sum(t.data.nbytes for t in v0))
        t = self.config.trainer
        sinks = MetricSinks(t.logger, self.run_dir, total_steps=self.total, start_step=self.step,
                            project=t.project_name, experiment=t.experiment_name,
                            config=self.config.model_dump(mode="json"))
        try:
            async with anyio.create_task_group() as tg:
                address = await tg.start(self.intake.run)
                emit(Kind.LISTENING, "learner", address=address)  # bin/train starts rollout servers on it
                try:
                    async with anyio.create_task_group() as training:
                        training.start_soon(self._on_signal, training.cancel_scope)
                        await self._train(resume, address, sinks, task_status)
                        training.cancel_scope.cancel()  # stops the signal watcher
                finally:
                    self.intake.close()  # BYE to every rollout server; intake.run returns once sent
        finally:
            if self.weight_files is not None:  # first: a SIGKILL during the slower steps must not leave them
                self.weight_files.close()
            sinks.close()
            if self.workers is not None:
                self.workers.shutdown()
        return 0

    async def _train(self, resume: Path | None, address: str, sinks: Any,
                     task_status: Any) -> None:
        t = self.config.trainer
        await self._start_workers(resume)
        self.log.info("training", address=address, from_step=self.step, to_step=self.total,
                      policy_version=self.version, resumed_from=str(resume) if resume else None)
        task_status.started(address)
        if t.val_before_train:  # also when resuming, as verl does
            sinks.log(self.step, await self._validate())
        while self.step < self.total:
            metrics = await self.train_step()
            metrics |= self._resume_metrics
            self._resume_metrics = {}
            if due(self.step, t.test_freq):
                metrics |= await self._validate()
            sinks.log(self.step, metrics)
            if t.save_freq > 0 and (self.step % t.save_freq == 0 or self.step == self.total):
                await self.save_checkpoint()
        if t.save_freq <= 0:  # no checkpoints: still leave the trained model behind
            final = self.run_dir / "final-hf"
            await self.workers.all("export_hf", [(str(final), self.config.actor_rollout_ref.model.path)] * self.world)
            self.log.info("model exported", path=str(final))
        self.log.info("training done", steps=self.step, policy_version=self.version)

    # -- validation ------------------------------------------------------------------------------
    async def _validate(self) -> dict[str, float]:
        """Validate the current policy on the rollout servers (blocking, bounded by
        trainer.val_timeout_s); the ``val/...`` metrics of what arrived."""
        from learner.validation import validation_metrics

        rnd = await self.intake.validate(self.version, timeout_s=self.config.trainer.val_timeout_s,
                                         request_id=f"step{self.step}-{uuid.uuid4().hex[:6]}")
        metrics = validation_metrics(rnd)
        missing = {**rnd.lost, **dict.fromkeys(rnd.outstanding, "no answer within trainer.val_timeout_s")}
        self.log.info("validation", step=self.step, policy_version=self.version, servers=len(rnd.asked),
                      episodes=int(metrics["val/count"]), reward=metrics.get("val/reward/mean"),
                      seconds=round(rnd.duration_s, 1), missing=missing or None, failed=rnd.failed or None)
        if not rnd.asked:
            self.log.warning("validation skipped: no rollout server connected within trainer.val_timeout_s, or "
                             "none offers validation", step=self.step)
        elif not metrics["val/count"] and not missing:
            self.log.warning("validation ran no episode: do the rollout servers have data.val_files?", step=self.step)
        return metrics

    async def _on_signal(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for sig in signals:
                self.log.info("stopping", signal=signal.Signals(sig).name, step=self.step)
                scope.cancel()
                return
