"""Sharded models of a learner worker: the policy (actor and reference) and the critic.

Design: each Hugging Face model is wrapped in a small head module whose forward returns only what
training needs at the response positions (per-token logprobs and entropy, or values), so the full
[batch, sequence, vocabulary] logits never exist: the hidden states are gathered at the response
positions first and only those go through the LM head. FSDP2's ``fully_shard`` is applied to every
decoder layer and then to the wrapper, so the wrapper's forward unshards the embeddings, final norm
and LM head together. Padding is right-padding inside a micro-batch (`collate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from learner.algorithms import entropy_from_logits, logprobs_from_logits
from learner.samples import TOKEN_FIELDS, Sample


def collate(samples: Sequence[Sample], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded micro-batch tensors. ``gather_idx[i, j]`` is the position whose output predicts
    response token j of sample i (prompt_len - 1 + j)."""
    b = len(samples)
    t = max(len(s.input_ids) for s in samples)
    r = max(max(s.response_len for s in samples), 1)
    input_ids = np.zeros((b, t), np.int64)
    attn = np.zeros((b, t), np.int64)
    gather = np.zeros((b, r), np.int64)
    labels = np.zeros((b, r), np.int64)
    mask = np.zeros((b, r), np.float32)
    extra = {k: np.zeros((b, r), np.float32) for k in TOKEN_FIELDS if k in samples[0].tokens}
    for i, s in enumerate(samples):
        n, p, rl = len(s.input_ids), s.prompt_len, s.response_len
        input_ids[i, :n] = s.input_ids
        attn[i, :n] = 1
        gather[i, :rl] = np.arange(p - 1, p - 1 + rl)
        labels[i, :rl] = s.input_ids[p:]
        mask[i, :rl] = s.response_mask
        for k, arr in extra.items():
            arr[i, :rl] = s.tokens[k]
    out = {"input_ids": input_ids, "attention_mask": attn, "gather_idx": gather, "labels": labels,
           "response_mask": mask, **extra}
    return {k: torch.from_numpy(v).to(device) for k, v in out.items()}


def _gather_hidden(hidden: torch.Tensor, gather_idx: torch.Tensor) -> torch.Tensor:
    return hidden.gather(1, gather_idx.unsqueeze(-1).expand(-1, -1, hidden.size(-1)))


class PolicyHead(nn.Module):
    """Causal LM -> (logprobs of the response tokens, entropy at those positions)."""

    def __init__(self, lm: nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        self.lm = lm
        # The rollout's logprobs are of the temperature-scaled distribution it sampled from.
        self.temperature = temperature if temperature > 0 else 1.0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, gather_idx: torch.Tensor,
                labels: torch.Tensor, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        base = self.lm.get_decoder()
        hidden = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        logits = self.lm.get_output_embeddings()(_gather_hidden(hidden, gather_idx)).float()
        logits = logits / self.temperature
        logp = logprobs_from_logits(logits, labels)
        ent = entropy_from_logits(logits) if with_entropy else None
        return logp, ent


class ValueHead(nn.Module):
    """Token-classification model with one label -> value of the state before each response token."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                gather_idx: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return out.float().squeeze(-1).gather(1, gather_idx)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (each becomes one FSDP unit)."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (_no_split_modules={classes})")
    return layers


def shard(wrapper: nn.Module, inner: nn.Module, *, device: torch.device, param_offload: bool,
          bf16: bool, world_size: int = 2) -> nn.Module:
    """FSDP2 over every decoder layer of ``inner``, then the wrapper as the root unit.

    On one rank nothing is sharded, so freeing the unsharded (bf16) parameters after forward only
    costs time: the backward pass (and its gradient-checkpointing recompute) would gather and cast
    them again. Measured on an H200 (bench/learner.py --profile), that re-unshard was the largest
    part of the gap to a bare training step; with several ranks the memory saving is the point."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"reshard_after_forward": world_size > 1}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if param_offload and device.type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(inner):
        fully_shard(layer, **kwargs)
    fully_shard(wrapper, **kwargs)
    return wrapper


def load_causal_lm(path: str, *, trust_remote_code: bool, gradient_checkpointing: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM

    # float32 master weights: mixed precision (bf16 on GPU) is FSDP's job, not the checkpoint's.
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.config.use_cache = False
    return lm


def load_value_model(path: str, *, trust_remote_code: bool) -> nn.Module:
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return model
