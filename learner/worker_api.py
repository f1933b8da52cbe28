"""What the trainer and a training worker say to each other: one request and one result type per
collective call.

Design: every call that crosses the Ray boundary takes one frozen dataclass and returns one (or
None from ranks other than 0 where only rank 0 has something to say), so both sides are checked by
the type checker and a field is renamed in one place. Ray pickles them as it pickled the tuples
before; nothing here imports torch, so the trainer process can build requests without the model
code. `learner.workers.WorkerGroup` is the typed facade that sends them; `learner.worker.TrainWorker`
answers them. Metrics the trainer's control flow depends on are typed fields (``optimizer_steps``),
the rest travel as named sums for ``learner.prepare.reduce_worker_metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from learner.samples import MiniBatchPlan, OldFromForward, Sample

Role = Literal["actor", "ref", "critic"]
TrainedRole = Literal["actor", "critic"]


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker reports once its model is built."""

    rank: int
    backend: str  # torch.distributed backend: nccl or gloo
    device: str
    params: int  # the policy's parameters (global sizes, not this rank's shard)
    trainable_params: int = 0  # those the optimizer steps: all, or with LoRA the adapters'


@dataclass(frozen=True)
class ForwardRequest:
    """A forward-only pass of ``role`` over one rank's micro-batches. None entries are placeholders
    that keep the rank in step with the others (FSDP's collectives); they get no result."""

    role: Role
    micro_batches: list[list[Sample | None]]
    with_entropy: bool = False
    packed: bool = False  # how the micro-batches are laid out (`learner.samples.Batching.packed`)
    share_prefix: bool = False  # `learner.samples.Batching.share_prefix`


@dataclass(frozen=True)
class ForwardResult:
    """Per real sample of the request, in micro-batch order: the logprobs of its response tokens
    (actor, ref) or the critic's values, float32 [response_len]; entropy when asked for."""

    outputs: list[np.ndarray]
    entropy: list[np.ndarray] | None = None


@dataclass(frozen=True)
class UpdateRequest:
    """One PPO update of ``role`` over this rank's share of each mini-batch. ``old_from_forward``
    (actor only): take the old logprobs from the update's own forward (`OldFromForward`).

    An update may come in two calls (`learner.early_update`), one epoch only: ``hold`` runs the
    forward and backward of the one plan given, the update's first mini-batch, and keeps its
    gradients and its optimizer step for the next call; that call has ``continues`` and the later
    mini-batches, and steps the held one first. Any other update drops what is held."""

    role: TrainedRole
    plans: list[MiniBatchPlan]
    epochs: int = 1
    old_from_forward: OldFromForward | None = None
    hold: bool = False
    continues: bool = False


@dataclass(frozen=True)
class UpdateResult:
    """One rank's account of an update. ``sums``: the loss terms and weighted sums of
    `learner.update` (``*_tok``, ``*_seq``, ``*_max``, ``tokens``, ``seqs``), reduced over ranks by
    ``learner.prepare.reduce_worker_metrics``."""

    role: TrainedRole
    optimizer_steps: int
    skipped_steps: int  # optimizer steps skipped for a non-finite gradient
    grad_norm_sum: float  # over the optimizer steps (non-finite norms left out)
    lr: float  # after the scheduler's step
    sums: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightsRequest:
    """The full policy, as tensors named as in the model's checkpoint, cast to ``dtypes[name]``
    where given (the serving engine's dtypes)."""

    names: list[str]
    dtypes: dict[str, str] | None = None


@dataclass(frozen=True)
class AdapterRequest:
    """The actor's LoRA adapter alone (`learner.lora.gather_adapter`: peft's saved names), every
    tensor cast to ``dtype``: what an adapter-only weight update ships."""

    dtype: str = "float32"  # wire dtype name


class WeightArray(NamedTuple):
    """One full tensor as rank 0 gathered it: bf16 travels as its raw 16-bit pattern."""

    name: str
    dtype: str  # wire dtype name (`protocol.weights.NamedBuffer`)
    shape: tuple[int, ...]
    array: np.ndarray


@dataclass(frozen=True)
class WeightsFileRequest:
    """The full policy written by rank 0 into the slot file ``path`` (`learner.weights_file_writer`);
    ``slot`` identifies the file's mapping across versions."""

    weights: WeightsRequest
    slot: int
    path: str


@dataclass(frozen=True)
class AdapterFileRequest:
    """The actor's LoRA adapter alone, cast to ``dtype``, written by rank 0 into the slot file
    ``path`` (`learner.weights_file_writer`); ``slot`` as in `WeightsFileRequest`."""

    dtype: str
    slot: int
    path: str


@dataclass(frozen=True)
class WeightsFileResult:
    gather_s: float  # FSDP2's full state dict on the device
    copy_s: float  # device -> file
    bytes: int  # tensor data written (the header not counted)
    pinned: bool  # the file's pages were registered with the CUDA driver
