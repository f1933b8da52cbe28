"""The attention function of the learner's packed micro-batches (`learner.model.collate`).

Design: one transformers attention implementation, ATTENTION, that every learner model is loaded
with. Packed (the sequences end to end in one row, ``packed_bounds`` their starts): causal
attention within each sequence, through a varlen kernel on CUDA (flash-attn's when installed, else
torch's ``torch.nn.attention.varlen`` once checked against SDPA on the device) or one SDPA call per
sequence. With a shared prefix (``packed_prefix``: the row's first part is the prefix every later
part continues) each part attends to the whole prefix and causally to itself: on CUDA through the
same varlen kernel, each part's queries against its own keys [prefix | part] (``packed_keys``,
`learner.varlen.prefix_key_layout`), where the kernel passed the prefixed check too; else one SDPA
call per part. Padded: SDPA with the causal and padding masks. The kernels (`learner.varlen`) take
q/k/v as [tokens, heads, D]; transformers hands [B, heads, T, D] in and takes [B, T, heads, D] back.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch import nn

from learner import varlen

ATTENTION = "learner_packed_sdpa"  # registered with transformers by register_attention()


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_bounds: tuple[int, ...] | None = None,
    packed_cu_seqlens: torch.Tensor | None = None,
    packed_prefix: int = 0,
    packed_keys: varlen.PrefixKeys | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function ([B, heads, T, D] in, [B, T, heads, D] out). Packed
    (``packed_bounds``: sequence starts in the one row, then its end; ``packed_cu_seqlens`` the same
    as int32 for a varlen kernel): causal attention within each sequence, and with
    ``packed_prefix`` each sequence after the first part also sees that part, the shared prefix
    (through the kernel with ``packed_keys``, `learner.model.Packing`). Otherwise causal SDPA,
    with the 2-D padding mask (all the mask function below hands over)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_bounds is None:
        # [B, T] keys: causal & not padding
        if attention_mask is not None and attention_mask.dim() == 2:
            t = query.shape[2]
            causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
            attention_mask = causal[None, None] & attention_mask[:, None, None, -t:].bool()
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling
        )
    if kwargs.get("sliding_window"):
        raise NotImplementedError(
            "packed micro-batches with sliding-window attention: set "
            "actor_rollout_ref.model.use_remove_padding=false"
        )
    kernel_ok = query.is_cuda and not dropout and query.dtype in (torch.float16, torch.bfloat16)
    if packed_prefix:
        kernel = varlen.prefix_kernel(query.device) if kernel_ok else None
        if kernel is not None and packed_keys is not None and packed_cu_seqlens is not None:
            q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, D]
            out = varlen.run_prefixed(kernel, q, k, v, packed_cu_seqlens, packed_keys, scaling)
            return out.unsqueeze(0), None
        return _prefixed_attention(module, query, key, value, packed_bounds, dropout, scaling), None
    kernel = varlen.varlen_kernel(query.device) if kernel_ok else None
    if kernel is not None and packed_cu_seqlens is not None:
        longest = max(b - a for a, b in itertools.pairwise(packed_bounds))
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, D]
        cu = packed_cu_seqlens
        return kernel(q, k, v, cu, cu, longest, longest, scaling).unsqueeze(0), None
    parts = _causal_parts(module, query, key, value, packed_bounds, dropout, scaling)
    return torch.cat(parts, dim=1), None


def _causal_parts(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: tuple[int, ...],
    dropout: float,
    scaling: float | None,
) -> list[torch.Tensor]:
    """Causal SDPA within each [a, b) of consecutive ``bounds``, one call per part."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return [
        sdpa_attention_forward(
            module,
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
        )[0]
        for a, b in itertools.pairwise(bounds)
    ]


def _prefixed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: tuple[int, ...],
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Packed attention whose first part, [0, bounds[1]), is a prefix every later part continues:
    the prefix attends causally to itself, each part to the whole prefix and causally to itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pre = bounds[1]
    parts = _causal_parts(module, query, key, value, bounds[:2], dropout, scaling)
    for a, b in itertools.pairwise(bounds[1:]):
        n = b - a
        # SDPA's is_causal aligns a short query with the keys' start, not their end: say it all
        seen = torch.ones(n, pre + n, dtype=torch.bool, device=query.device)
        seen[:, pre:] = seen[:, pre:].tril()
        k = torch.cat([key[:, :, :pre], key[:, :, a:b]], dim=2)
        v = torch.cat([value[:, :, :pre], value[:, :, a:b]], dim=2)
        parts.append(
            sdpa_attention_forward(
                module, query[:, :, a:b], k, v, seen[None, None], dropout=dropout, scaling=scaling
            )[0]
        )
    return torch.cat(parts, dim=1)


@functools.cache
def register_attention() -> None:
    """Make ATTENTION a transformers attention implementation. Its mask function is flash
    attention's: no mask when nothing is padded (so a packed row never gets an N x N mask), else the
    2-D padding mask that `packed_attention` turns into SDPA's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, flash_attention_mask)
