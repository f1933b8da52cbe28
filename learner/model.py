"""Sharded models of a learner worker: the policy (actor and reference) and the critic.

Design: each Hugging Face model is wrapped in a small head module whose forward returns only what
training needs at the response positions (per-token logprobs and entropy, or values), so the full
[batch, sequence, vocabulary] logits never exist: the hidden states of the real response positions
are picked out first (a flat list, no padding) and only those go through the LM head. FSDP2's
``fully_shard`` is applied to every decoder layer and then to the wrapper, so the wrapper's forward
unshards the embeddings, final norm and LM head together (`keep_unsharded` chooses the resharding).

A micro-batch (`collate`) is packed or padded. Packed: the sequences end to end in one row with
``position_ids`` restarting at each sequence and no padding anywhere (verl's
``use_remove_padding``). Attention stays inside each sequence through
`learner.attention.packed_attention`, the attention function the models are loaded with: on CUDA a
varlen kernel (flash-attn's when the package is installed, else torch's own
``torch.nn.attention.varlen``, a prototype API that is first checked against SDPA on the device),
else one SDPA call per sequence (exact; on the CPU the only cost is a Python loop; on a GPU the
launches add up when a micro-batch holds many short sequences).
Transformers' own packed-sequence detection from ``position_ids`` is not relied on: with SDPA it
would build an N x N mask, and with transformers 5.19 a Qwen2 forward given restarting
``position_ids`` still let the sequences attend to each other (checked by hand). Padded:
right-padded to the longest sequence, and the same function runs SDPA with the padding mask. Both
layouts give the same numbers to float rounding (tests/learner/test_packing.py).

A packed micro-batch may also share its prefix (``share_prefix``): the tokens every sequence of the
micro-batch starts with (in agentic batches the system prompt and the tool schemas, often most of
each prompt) come once at the head of the row, and each sequence's rest attends to them and to
itself. The prefix's activations feed every sequence, so with no dropout (the Qwen2 family has
none) the gradient is the unshared one. The linear layers then see each distinct token once;
attention still reads the prefix's keys for every sequence: one SDPA call per part, or on CUDA the
varlen kernel with each part's keys gathered as [prefix | part] (``Packing.keys``), where that
kernel passed the prefixed check (`learner.varlen.can_share_prefix`; else nothing is shared).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from learner.algorithms import entropy_from_logits, logprobs_from_logits
from learner.attention import ATTENTION, register_attention
from learner.samples import Sample, TokenField, shared_prefix
from learner.varlen import PrefixKeys, can_share_prefix, prefix_kernel, prefix_key_layout

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Packing:
    """How a packed row [1, N] holds its sequences: what the attention function needs besides the
    tokens. Integer tensors and Python values only, so FSDP's mixed-precision input cast (which
    rebuilds dataclasses field by field) leaves it as it is."""

    position_ids: torch.Tensor  # [1, N]: restarting at each sequence, continuing after a prefix
    # the starts as Python ints (no device sync to read them), then the end; with a shared prefix
    # B + 2 of them: 0, then the starts of the B sequences' parts after the prefix, then the end
    bounds: tuple[int, ...]
    # int32 ``bounds``, for a varlen kernel (CUDA); a shared row's only with ``keys``, which say
    # what each part's queries attend to (a kernel would read it as separate sequences otherwise)
    cu_seqlens: torch.Tensor | None = None
    prefix: int = 0  # > 0: [0, prefix) is the shared prefix, every later part's head
    keys: PrefixKeys | None = None

    def decoder_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the decoder's forward, which hands the ``packed_*`` ones on to
        `learner.attention.packed_attention`."""
        return {
            "position_ids": self.position_ids,
            "packed_bounds": self.bounds,
            "packed_cu_seqlens": self.cu_seqlens,
            "packed_prefix": self.prefix,
            "packed_keys": self.keys,
        }


@dataclass
class MicroBatch:
    """The tensors of one micro-batch. Response arrays are [B, R] (R: longest response), with the
    model's outputs for the real response tokens in row-major order of ``response_valid``."""

    input_ids: torch.Tensor  # [B, T] padded, or [1, N] packed
    # [Nr]: row of the flattened hidden states that predicts each response token
    hidden_idx: torch.Tensor
    labels: torch.Tensor  # [Nr]: the response tokens
    response_valid: torch.Tensor  # [B, R] bool: position j < sample i's response length
    response_mask: torch.Tensor  # [B, R] float: 1 = trained on
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # TOKEN_FIELDS present, [B, R]
    attention_mask: torch.Tensor | None = None  # [B, T], padded only
    packing: Packing | None = None  # packed only

    @property
    def packed(self) -> bool:
        return self.packing is not None

    @property
    def prefix(self) -> int:
        """Tokens of the shared prefix at the head of the row (0: none)."""
        return self.packing.prefix if self.packing is not None else 0

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of `PolicyHead` / `ValueHead` (integer tensors and Python values only,
        so FSDP's mixed-precision input cast leaves them alone)."""
        return {
            "input_ids": self.input_ids,
            "hidden_idx": self.hidden_idx,
            "attention_mask": self.attention_mask,
            "packing": self.packing,
        }

    def to_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[Nr] per response token -> [B, R], zeros past each response (differentiable)."""
        return torch.zeros(
            self.response_valid.shape, dtype=flat.dtype, device=flat.device
        ).masked_scatter(self.response_valid, flat)


def collate(
    samples: Sequence[Sample],
    device: torch.device,
    *,
    packed: bool = False,
    share_prefix: bool = False,
) -> MicroBatch:
    """The micro-batch tensors of ``samples``. Response token j of sample i is predicted by the
    output at position prompt_len - 1 + j of its sequence. ``share_prefix`` (packed only): the
    prefix all samples share comes once, first in the row (module docstring)."""
    share = share_prefix and packed and can_share_prefix(device)
    pre = shared_prefix(samples) if share else 0
    b = len(samples)
    lens = [len(s.input_ids) - pre for s in samples]  # what each sample puts in the row
    r = max(max(s.response_len for s in samples), 1)
    valid = np.zeros((b, r), bool)
    mask = np.zeros((b, r), np.float32)
    extra: dict[TokenField, np.ndarray] = {
        k: np.zeros((b, r), np.float32) for k in samples[0].token_fields()
    }
    labels, hidden = [], []
    starts = np.concatenate([[0], np.cumsum(lens)]) + pre if packed else np.arange(b) * max(lens)
    for i, s in enumerate(samples):
        p, rl = s.prompt_len, s.response_len
        valid[i, :rl] = True
        mask[i, :rl] = s.response_mask
        labels.append(s.input_ids[p:])
        hidden.append(starts[i] + np.arange(p - 1 - pre, p - 1 - pre + rl))
        for k, arr in extra.items():
            arr[i, :rl] = s.get(k)

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    out = MicroBatch(
        input_ids=put(np.zeros(0, np.int64)),
        hidden_idx=put(np.concatenate(hidden).astype(np.int64)),
        labels=put(np.concatenate(labels).astype(np.int64)),
        response_valid=put(valid),
        response_mask=put(mask),
        fields={k: put(v) for k, v in extra.items()},
    )
    if packed:
        head = [samples[0].input_ids[:pre]] if pre else []
        ids = np.concatenate(head + [s.input_ids[pre:] for s in samples]).astype(np.int64)
        pos = [np.arange(pre)] + [np.arange(pre, pre + n) for n in lens]
        out.input_ids = put(ids[None])
        bounds = tuple(int(x) for x in (np.concatenate([[0], starts]) if pre else starts))
        kernel = pre and device.type == "cuda" and prefix_kernel(device) is not None
        keys = prefix_key_layout(bounds, device) if kernel else None
        out.packing = Packing(
            position_ids=put(np.concatenate(pos).astype(np.int64)[None]),
            bounds=bounds,
            cu_seqlens=None if pre and keys is None else put(np.array(bounds, np.int32)),
            prefix=pre,
            keys=keys,
        )
    else:
        ids = np.zeros((b, max(lens)), np.int64)
        attn = np.zeros((b, max(lens)), np.int64)
        for i, s in enumerate(samples):
            ids[i, : lens[i]] = s.input_ids
            attn[i, : lens[i]] = 1
        out.input_ids, out.attention_mask = put(ids), put(attn)
    return out


def layout_counts(b: MicroBatch, sequences: int) -> dict[str, float]:
    """The tokens ``b``'s rows hold, and those its shared prefix kept out of them (it comes once
    instead of once per sequence): ``learner.prepare.reduce_worker_metrics`` makes the share."""
    return {"row_tokens": float(b.input_ids.numel()), "shared_tokens": b.prefix * (sequences - 1.0)}


def _decoder_kwargs(
    config: object, attention_mask: torch.Tensor | None, packing: Packing | None
) -> dict[str, Any]:
    if packing is None:
        return {"attention_mask": attention_mask}
    attn = getattr(config, "_attn_implementation", None)  # a transformers PretrainedConfig's
    if attn != ATTENTION:
        # Any other attention would let the packed sequences attend to each other.
        raise ValueError(
            f"a packed micro-batch needs a model loaded with attn_implementation={ATTENTION!r} "
            f"(learner.model.load_causal_lm), not {attn!r}"
        )
    return packing.decoder_kwargs()


def hidden_states(
    decoder: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    packing: Packing | None = None,
) -> torch.Tensor:
    """The decoder's last hidden states, flattened to [B*T or N, H]."""
    kw = _decoder_kwargs(decoder.config, attention_mask, packing)
    hidden = decoder(input_ids=input_ids, use_cache=False, **kw).last_hidden_state
    return hidden.reshape(-1, hidden.size(-1))


class PolicyHead(nn.Module):
    """Causal LM -> (logprobs of the response tokens, entropy at those positions), flat [Nr]."""

    keep_gathered: bool = False  # FSDP2 parameters stay gathered through a step (`shard`)

    def __init__(self, lm: PreTrainedModel, temperature: float = 1.0) -> None:
        super().__init__()
        self.lm = lm
        # The rollout's logprobs are of the temperature-scaled distribution it sampled from.
        self.temperature = temperature if temperature > 0 else 1.0

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_idx: torch.Tensor,
        labels: torch.Tensor,
        with_entropy: bool = False,
        *,
        attention_mask: torch.Tensor | None = None,
        packing: Packing | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.lm.get_output_embeddings()
        assert head is not None  # a causal LM has one
        hidden = hidden_states(self.lm.get_decoder(), input_ids, attention_mask, packing)
        logits = head(hidden[hidden_idx]).float()
        if self.temperature != 1.0:  # x / 1.0 is x: no pass over [tokens, vocabulary] for it
            logits = logits / self.temperature
        logp = logprobs_from_logits(logits, labels)
        ent = entropy_from_logits(logits) if with_entropy else None
        return logp, ent


def policy_outputs(
    model: nn.Module, mb: MicroBatch, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, R] logprobs (and entropy) of ``mb``'s response tokens under the (sharded) PolicyHead."""
    logp, ent = model(labels=mb.labels, with_entropy=with_entropy, **mb.model_inputs())
    return mb.to_rows(logp), (mb.to_rows(ent) if ent is not None else None)


class ValueHead(nn.Module):
    """Token-classification model with one label -> value of the state before each response token."""

    keep_gathered: bool = False  # as PolicyHead's

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_idx: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        kw = _decoder_kwargs(self.model.config, attention_mask, packing)
        out = self.model(input_ids=input_ids, use_cache=False, **kw).logits
        return out.float().reshape(-1)[hidden_idx]


def value_outputs(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """[B, R] values at ``mb``'s response positions under the (sharded) ValueHead."""
    return mb.to_rows(model(**mb.model_inputs()))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (each becomes one FSDP unit)."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(
            f"{type(model).__name__}: no decoder layers found (_no_split_modules={classes})"
        )
    return layers


# -- FSDP2 -----------------------------------------------------------------------------------------

SMALL_MODEL_SHARE = 1 / 16
"""A model whose unsharded parameters (in the compute dtype) take at most this share of the
device's memory stays unsharded from forward to backward and across the micro-batches of an
optimizer step."""


def keep_unsharded(world_size: int, numel: int, *, bf16: bool, device: torch.device) -> bool:
    """Whether FSDP2 keeps a model's parameters gathered between its forward and backward passes
    (``reshard_after_forward=False``) and from one micro-batch to the next (no reshard after a
    backward that does not end the optimizer step).

    One rank: always (nothing is sharded, so resharding only frees and re-casts the same tensors;
    measured on an H200, that re-unshard was the largest gap to a bare step). Several ranks: when
    the model is small against the device (`SMALL_MODEL_SHARE`). The cost is one gathered copy of
    the parameters, held through the step; gradient accumulation already holds one of the gradients
    (FSDP2 keeps them unsharded, in fp32, until the last micro-batch's reduce-scatter), which is
    twice as large under bf16 compute, so this at most adds half of what accumulation already needs.
    What it saves is every all-gather but the first of each optimizer step: one per layer in the
    backward of every micro-batch, and one per layer in the forward of every micro-batch after the
    first."""
    if world_size <= 1:
        return True
    unsharded = numel * (2 if bf16 else 4)
    return unsharded <= SMALL_MODEL_SHARE * _device_memory(device)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def shard(
    wrapper: PolicyHead | ValueHead,
    inner: nn.Module,
    *,
    device: torch.device,
    param_offload: bool,
    bf16: bool,
    world_size: int = 2,
    keep_gathered: bool | None = None,
) -> nn.Module:
    """FSDP2 over every decoder layer of ``inner``, then the wrapper as the root unit.

    ``keep_gathered`` (None: `keep_unsharded` decides) sets ``reshard_after_forward``; the worker
    turns resharding after backward off for the micro-batches before an optimizer step's last
    (`set_micro_batch`). Several ranks on CUDA: each layer's forward also prefetches the next
    layer's all-gather explicitly (FSDP2 only prefetches implicitly in backward), so a step bound by
    kernel launches still overlaps communication with compute."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if keep_gathered is None:
        keep_gathered = keep_unsharded(
            world_size, sum(p.numel() for p in wrapper.parameters()), bf16=bf16, device=device
        )
    kwargs: dict[str, Any] = {"reshard_after_forward": not keep_gathered}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if param_offload and device.type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = [fully_shard(layer, **kwargs) for layer in decoder_layers(inner)]
    fully_shard(wrapper, **kwargs)
    if world_size > 1 and device.type == "cuda":
        for layer, nxt in itertools.pairwise(layers):
            layer.set_modules_to_forward_prefetch([nxt])
    wrapper.keep_gathered = keep_gathered
    return wrapper


def set_micro_batch(model: nn.Module, index: int, count: int) -> None:
    """Before micro-batch ``index`` of ``count`` in one optimizer step: gradients are reduced only
    after the last, and a model that keeps its parameters gathered reshards only then too (the
    optimizer step must see, and the next step gather, the updated shards)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"set_micro_batch needs a model sharded by `shard`, got {type(model).__name__}"
        )
    last = index == count - 1
    model.set_requires_gradient_sync(last)
    if getattr(model, "keep_gathered", False):
        model.set_reshard_after_backward(last)


def reshard(model: nn.Module) -> None:
    """Every FSDP unit of ``model`` back to its shards: a forward of a model that keeps its
    parameters gathered (`keep_unsharded`) leaves them gathered, and then the module holds the
    gathered tensors, not the sharded ones that carry the gradients and that the optimizer steps
    (a step taken then would not reach the next forward, which reuses the gathered tensors)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def load_causal_lm(
    path: str, *, trust_remote_code: bool, gradient_checkpointing: bool
) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    register_attention()
    # float32 master weights: mixed precision (bf16 on GPU) is FSDP's job, not the checkpoint's.
    lm = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        trust_remote_code=trust_remote_code,
        attn_implementation=ATTENTION,
    )
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.config.use_cache = False
    return lm


def load_value_model(path: str, *, trust_remote_code: bool) -> PreTrainedModel:
    from transformers import AutoModelForTokenClassification

    register_attention()
    model = AutoModelForTokenClassification.from_pretrained(
        path,
        num_labels=1,
        dtype=torch.float32,
        trust_remote_code=trust_remote_code,
        attn_implementation=ATTENTION,
    )
    return model
