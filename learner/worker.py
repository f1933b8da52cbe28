"""One training worker: a rank of the learner's torch.distributed group, holding FSDP2 shards.

Design: a plain class (run as a Ray actor by `learner.workers`, or directly in tests) whose methods
are the collective steps of a training step, each taking one request and returning one result of
`learner.worker_api`; every rank is called with its own share of the data and the same number of
micro-batches, so FSDP's collectives line up. Losses are normalised by the
global counts of the mini-batch (`MiniBatchPlan`), so the gradient is the same whatever the number of
ranks and micro-batches. Metrics come back as sums with their weights; the trainer reduces them.
Micro-batches are laid out as their plan says (packed or padded, `learner.model.collate`). Between
calls a small model may stay gathered (`learner.model.keep_unsharded`); FSDP2's state-dict hooks
reshard it before a checkpoint or a weight gather reads it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from learner import checkpoint_io, rendezvous
from learner.checkpoint_io import WIRE_TO_TORCH, weight_array
from learner.samples import MiniBatchPlan, OldFromForward, Sample
from learner.varlen import can_share_prefix, varlen_kernel
from learner.weights_file_writer import WeightsFileWriter
from learner.worker_api import (
    AdapterFileRequest,
    AdapterRequest,
    ForwardRequest,
    ForwardResult,
    Role,
    TrainedRole,
    UpdateRequest,
    UpdateResult,
    WeightArray,
    WeightsFileRequest,
    WeightsFileResult,
    WeightsRequest,
    WorkerInfo,
)
from learner.worker_settings import WorkerSettings

if TYPE_CHECKING:
    from learner.model import MicroBatch


def lr_factor(step: int, s: WorkerSettings) -> float:
    """Multiplier of the peak lr after ``step`` scheduler steps: linear warm-up, then constant or
    cosine decay to min_lr_ratio at total_steps."""
    if s.warmup_steps > 0 and step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.lr_scheduler == "constant":
        return 1.0
    span = max(1, s.total_steps - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / span)
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class TrainWorker:
    def __init__(self, rank: int, world_size: int, settings: WorkerSettings) -> None:
        self.rank, self.world, self.s = rank, world_size, settings
        self.device = torch.device("cpu")
        self.models: dict[str, torch.nn.Module] = {}  # by Role
        self.optims: dict[str, torch.optim.Optimizer] = {}  # by TrainedRole
        self.scheds: dict[str, torch.optim.lr_scheduler.LambdaLR] = {}
        # by TrainedRole: the sums of a first mini-batch whose step waits (`UpdateRequest.hold`)
        self._held: dict[str, dict[str, float]] = {}
        self._weights_writer: WeightsFileWriter | None = None  # made at the first file hand-over

    # -- set-up ---------------------------------------------------------------------------------
    def machine(self) -> str:
        """The machine this rank runs on (`learner.rendezvous`)."""
        return rendezvous.machine_id()

    def rendezvous(self, one_machine: bool) -> str:
        """Rank 0 only: where every rank's process group starts (`learner.rendezvous`)."""
        return rendezvous.init_method(one_machine)

    def setup(self, init_method: str) -> WorkerInfo:
        import torch.distributed as dist

        if self.s.threads:
            torch.set_num_threads(self.s.threads)
        if self.s.device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        rendezvous.use_loopback(init_method, os.environ)
        dist.init_process_group(
            backend, init_method=init_method, rank=self.rank, world_size=self.world
        )
        # same initialisation everywhere (value head of the critic, LoRA's A matrices)
        torch.manual_seed(self.s.seed)
        self._build()
        # lazy: learner.lora imports peft (and with it transformers)
        from learner import lora

        actor = self.models["actor"]
        # DTensors: global sizes
        return WorkerInfo(
            rank=self.rank,
            backend=backend,
            device=str(self.device),
            params=sum(p.numel() for p in actor.parameters()),
            trainable_params=sum(p.numel() for p in lora.trainable(actor)),
        )

    def _build(self) -> None:
        # lazy: learner.model imports verl, learner.lora peft
        from learner.lora import add_adapters, load_adapter
        from learner.model import PolicyHead, ValueHead, load_causal_lm, load_value_model, shard

        s, bf16 = self.s, self.device.type == "cuda"

        def sharded(head: PolicyHead | ValueHead, model: torch.nn.Module) -> torch.nn.Module:
            return shard(
                head,
                model,
                device=self.device,
                param_offload=s.param_offload,
                bf16=bf16,
                world_size=self.world,
                keep_gathered=s.keep_gathered,
            )

        lm = _on(
            load_causal_lm(
                s.model_path,
                trust_remote_code=s.trust_remote_code,
                gradient_checkpointing=s.gradient_checkpointing,
            ),
            self.device,
        )
        if s.lora is not None:
            add_adapters(lm, s.lora)  # before sharding: FSDP2 shards the adapters with their layer
            if s.lora.adapter_path is not None:
                load_adapter(lm, s.lora)
        self.models["actor"] = sharded(PolicyHead(lm, s.temperature), lm)
        self._add_optimizer("actor", s.lr, s.weight_decay)
        if s.need_ref:
            ref = _on(
                load_causal_lm(
                    s.model_path,
                    trust_remote_code=s.trust_remote_code,
                    gradient_checkpointing=False,
                ),
                self.device,
            ).eval()
            ref.requires_grad_(False)
            self.models["ref"] = sharded(PolicyHead(ref, s.temperature), ref)
        if s.critic_model_path:
            vm = _on(
                load_value_model(s.critic_model_path, trust_remote_code=s.trust_remote_code),
                self.device,
            )
            self.models["critic"] = sharded(ValueHead(vm), vm)
            self._add_optimizer("critic", s.critic_lr, s.critic_weight_decay)

    def can_pack(self) -> bool:
        """Whether packed micro-batches pay here: on the CPU always (one SDPA call per sequence is
        cheap), on a GPU only with a varlen attention kernel (`learner.varlen.varlen_kernel`): without
        one every sequence is its own SDPA call, and measured on an H100 a long-tail update took
        11-21 s packed that way vs 6 s padded."""

        return self.device.type == "cpu" or varlen_kernel(self.device) is not None

    def can_share_prefix(self) -> bool:
        """Whether packed micro-batches may share their prefix here
        (`learner.varlen.can_share_prefix`): the token cap counts a shared prefix once, so it
        must know whether `collate` will share it."""

        return can_share_prefix(self.device)

    def _add_optimizer(self, role: TrainedRole, lr: float, weight_decay: float) -> None:
        # lazy: learner.lora imports peft (and with it transformers)
        from learner.lora import trainable

        # only what is trained: with LoRA the adapters, so no optimizer state for the frozen base
        opt = torch.optim.AdamW(
            trainable(self.models[role]), lr=lr, betas=self.s.betas, weight_decay=weight_decay
        )
        self.optims[role] = opt
        self.scheds[role] = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_factor(step, self.s)
        )
        self._offload_optimizer(role)

    # -- forward-only passes ----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, req: ForwardRequest) -> ForwardResult:
        """Per real sample: logprobs (+ entropy) for actor/ref, values for the critic. Placeholder
        (None) entries run nothing of their own; a micro-batch of placeholders only runs a dummy
        sample so that this rank joins the collectives."""
        # lazy: learner.model imports verl
        from learner.model import collate

        model = self.models[req.role]
        # eval() changes nothing in these models (no dropout), but the update runs in train():
        # the numbers are the same, which the skipped old-logprob forward relies on.
        model.eval()
        outputs: list[np.ndarray] = []
        entropy: list[np.ndarray] | None = [] if req.with_entropy and req.role != "critic" else None
        for micro in req.micro_batches:
            real = [s for s in micro if s is not None]
            batch = collate(
                real or [_placeholder()],
                self.device,
                packed=req.packed,
                share_prefix=req.share_prefix,
            )
            out, ent = self._run(req.role, model, batch, req.with_entropy)
            # one device-to-host copy per micro-batch, not one (and one sync) per sample
            rows = out.float().cpu().numpy()
            ent_rows = None if entropy is None or ent is None else ent.float().cpu().numpy()
            for i, s in enumerate(real):
                outputs.append(rows[i, : s.response_len])
                if entropy is not None and ent_rows is not None:
                    entropy.append(ent_rows[i, : s.response_len])
        return ForwardResult(outputs, entropy)

    def _run(
        self, role: Role, model: torch.nn.Module, b: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # lazy: learner.model imports verl
        from learner.model import policy_outputs, value_outputs

        if role == "critic":
            return value_outputs(model, b), None
        return policy_outputs(model, b, with_entropy)

    # -- updates --------------------------------------------------------------------------------
    def update(self, req: UpdateRequest) -> UpdateResult:
        """One PPO update. ``old_from_forward``: the first mini-batch's samples carry no old
        logprobs; each of its micro-batches takes its own forward's, detached, which is exact only
        before the first optimizer step, so only with one epoch. ``hold`` / ``continues``: the
        update in two calls, its first mini-batch's step held between them (`UpdateRequest`)."""
        # lazy: learner.update imports verl
        from learner.update import actor_micro_loss, critic_micro_loss

        split = req.hold or req.continues
        if (split or req.old_from_forward is not None) and req.epochs != 1:
            what = "an update in two calls" if split else "old logprobs from the update's forward"
            raise ValueError(f"{what} needs one epoch (got {req.epochs})")
        if req.hold and len(req.plans) != 1:
            raise ValueError(
                f"a held update takes its first mini-batch alone (got {len(req.plans)})"
            )
        held = self._held.pop(req.role, None)  # any other update drops it: zero_grad comes first
        if req.continues and held is None:
            raise RuntimeError(f"this {req.role} update continues one, but none is held")
        micro_loss = critic_micro_loss if req.role == "critic" else actor_micro_loss
        old = req.old_from_forward if req.role == "actor" else None
        if req.hold:
            self._held[req.role] = self._hold(req.role, req.plans[0], micro_loss, old)
            lr = float(self.scheds[req.role].get_last_lr()[0])
            return UpdateResult(
                req.role, optimizer_steps=0, skipped_steps=0, grad_norm_sum=0.0, lr=lr
            )
        return self._update(
            req.role, req.plans, req.epochs, micro_loss, old, held if req.continues else None
        )

    def _hold(
        self,
        role: TrainedRole,
        plan: MiniBatchPlan,
        micro_loss: MicroLoss,
        old_from_forward: OldFromForward | None,
    ) -> dict[str, float]:
        """The first mini-batch's forward and backward; its gradients stay for the next update."""
        model, opt = self.models[role], self.optims[role]
        self._onload_optimizer(role)
        model.train()
        opt.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        self._accumulate(model, plan, micro_loss, old_from_forward, sums)
        return sums

    def _update(
        self,
        role: TrainedRole,
        plans: Sequence[MiniBatchPlan],
        epochs: int,
        micro_loss: MicroLoss,
        old_from_forward: OldFromForward | None = None,
        held: dict[str, float] | None = None,
    ) -> UpdateResult:
        """``held``: the sums of a first mini-batch whose gradients wait in the model (`_hold`):
        its step comes first, and ``plans`` are the mini-batches after it."""
        model, opt = self.models[role], self.optims[role]
        self._onload_optimizer(role)
        model.train()
        # lazy: learner.model imports verl
        from learner.model import reshard

        sums: dict[str, float] = dict(held or {})
        grad_norms: list[float] = []
        if held is not None:
            # the forwards since the hold (the later mini-batches' old logprobs) may have left the
            # parameters gathered: the held gradients are on the shards
            reshard(model)
            grad_norms.append(self._step(role, model, opt))
        for _ in range(epochs):
            for p, plan in enumerate(plans):
                # only the first mini-batch's forward runs on the weights before the update
                off_policy = old_from_forward
                if off_policy is not None and (p > 0 or held is not None):
                    off_policy = replace(off_policy, from_own_forward=False)
                opt.zero_grad(set_to_none=True)
                self._accumulate(model, plan, micro_loss, off_policy, sums)
                grad_norms.append(self._step(role, model, opt))
        self.scheds[role].step()
        self._offload_optimizer(role)
        opt.zero_grad(set_to_none=True)
        return UpdateResult(
            role=role,
            optimizer_steps=len(grad_norms),
            skipped_steps=sum(not math.isfinite(n) for n in grad_norms),
            grad_norm_sum=float(np.nansum(grad_norms)),
            lr=float(self.scheds[role].get_last_lr()[0]),
            sums=sums,
        )

    def _accumulate(
        self,
        model: torch.nn.Module,
        plan: MiniBatchPlan,
        micro_loss: MicroLoss,
        off_policy: OldFromForward | None,
        sums: dict[str, float],
    ) -> None:
        """Forward and backward of every micro-batch of ``plan``: the gradients add up in the
        model, the loss terms in ``sums``."""
        # lazy: learner.model imports verl
        from learner.model import collate, layout_counts, set_micro_batch

        for i, micro in enumerate(plan.micro_batches):
            set_micro_batch(model, i, len(plan.micro_batches))
            batch = collate(micro, self.device, packed=plan.packed, share_prefix=plan.share_prefix)
            loss, metrics = micro_loss(model, batch, plan, self.s, self.world, off_policy)
            loss.backward()
            metrics.update(layout_counts(batch, len(micro)))
            for k, v in metrics.items():
                sums[k] = max(sums.get(k, v), v) if k.endswith("_max") else sums.get(k, 0.0) + v

    def _step(self, role: TrainedRole, model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        """Clip the gradients and step; a non-finite norm skips the step (it would poison the
        weights). Returns the norm."""
        clip = self.s.grad_clip if role == "actor" else self.s.critic_grad_clip
        norm = _full_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        if math.isfinite(norm):
            opt.step()
        return norm

    def _offload_optimizer(self, role: TrainedRole) -> None:
        if self.s.optimizer_offload and self.device.type == "cuda":
            _move_optimizer_state(self.optims[role], torch.device("cpu"))

    def _onload_optimizer(self, role: TrainedRole) -> None:
        if self.s.optimizer_offload and self.device.type == "cuda":
            _move_optimizer_state(self.optims[role], self.device)

    # -- weights and checkpoints ------------------------------------------------------------------
    def _policy_lm(self) -> torch.nn.Module:
        """The actor's language model inside its `PolicyHead` (the tensors rollout servers load)."""
        lm = self.models["actor"].lm
        assert isinstance(lm, torch.nn.Module)
        return lm

    def full_weights(self, req: WeightsRequest) -> list[WeightArray] | None:
        """Collective: the full policy weights; rank 0 returns them (as raw arrays), others None."""
        return checkpoint_io.full_weights(self._policy_lm(), req.names, self.rank, req.dtypes)

    def adapter_weights(self, req: AdapterRequest) -> list[WeightArray] | None:
        """Collective: the actor's LoRA adapter alone (peft's saved names, `learner.lora`), cast to
        ``req.dtype``; rank 0 returns it, others None. Only the adapter tensors are gathered."""
        # lazy: learner.lora imports peft (and with it transformers)
        from learner.lora import gather_adapter

        tensors = gather_adapter(self._policy_lm(), self.rank)
        if tensors is None:
            return None
        dtype = WIRE_TO_TORCH[req.dtype]
        return [weight_array(n, t.to(dtype)) for n, t in tensors.items()]

    def write_weights_file(self, req: WeightsFileRequest) -> WeightsFileResult | None:
        """Collective: the full policy written by rank 0 into the request's slot file (see
        ``learner.weights_file_writer``); rank 0 returns timings, others None."""

        if self._weights_writer is None:
            self._weights_writer = WeightsFileWriter()
        return self._weights_writer.write(
            self._policy_lm(), req.weights.names, self.rank, req.weights.dtypes, req.slot, req.path
        )

    def write_adapter_file(self, req: AdapterFileRequest) -> WeightsFileResult | None:
        """Collective: the LoRA adapter alone written by rank 0 into the request's slot file;
        rank 0 returns timings, others None."""
        if self._weights_writer is None:
            self._weights_writer = WeightsFileWriter()
        return self._weights_writer.write_adapter(
            self._policy_lm(), self.rank, WIRE_TO_TORCH[req.dtype], req.slot, req.path
        )

    def save_checkpoint(self, directory: str) -> None:
        checkpoint_io.save(Path(directory), self.models, self.optims, self.scheds, self.rank)

    def load_checkpoint(self, directory: str) -> None:
        checkpoint_io.load(Path(directory), self.models, self.optims, self.scheds, self.rank)

    def export_hf(self, directory: str, source_dir: str) -> None:
        checkpoint_io.export_hf(
            self._policy_lm(), Path(directory), Path(source_dir), self.rank, self.s.lora
        )

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self._weights_writer is not None:
            self._weights_writer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


MicroLoss = Callable[
    [torch.nn.Module, "MicroBatch", MiniBatchPlan, WorkerSettings, int, "OldFromForward | None"],
    tuple[torch.Tensor, dict[str, float]],
]
"""`learner.update.actor_micro_loss` or ``critic_micro_loss``."""


M = TypeVar("M", bound=torch.nn.Module)


def _on(model: M, device: torch.device) -> M:
    """``model`` moved to ``device`` in place (through nn.Module.to: transformers' wrapper of ``to``
    confuses type checkers about its ``self``)."""
    torch.nn.Module.to(model, device)
    return model


def _full_norm(norm: torch.Tensor) -> float:
    """A gradient norm as a float; on FSDP2 it is a DTensor whose full value needs a collective."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def _placeholder() -> Sample:
    return Sample(np.zeros(2, np.int64), 1, np.zeros(1, np.float32))


def _move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device) -> None:
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to(device, non_blocking=True)
