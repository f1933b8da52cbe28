"""The attention function of the learner's packed micro-batches (`learner.model.collate`).

Design: one transformers attention implementation, ATTENTION, that every learner model is loaded
with. Packed (the sequences end to end in one row, ``packed_bounds`` their starts): causal
attention within each sequence, through a varlen kernel on CUDA (flash-attn's when installed, else
torch's ``torch.nn.attention.varlen`` once checked against SDPA on the device) or one SDPA call per
sequence. With a shared prefix (``packed_prefix``: the row's first part is the prefix every later
part continues) each part attends to the whole prefix and causally to itself: on CUDA through the
same varlen kernel, each part's queries against its own keys [prefix | part] (gathered by
``packed_key_index``, the prefix's keys and values copied per sequence, which costs far less than
running the prefix's tokens through every layer once per sequence), where the kernel passed the
prefixed check too (`prefix_kernel`); else one SDPA call per part. Padded: SDPA with the causal and
padding masks. The kernels take q/k/v as [tokens, heads, D]; transformers hands [B, heads, T, D]
in and takes [B, T, heads, D] back.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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
    packed_keys: PrefixKeys | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function ([B, heads, T, D] in, [B, T, heads, D] out). Packed
    (``packed_bounds``: sequence starts in the one row): causal attention within each sequence,
    and with ``packed_prefix`` each sequence after the first part also sees that part, the shared
    prefix. Otherwise causal SDPA, with the 2-D padding mask (all the mask function below hands
    over)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_bounds is None:
        if (
            attention_mask is not None and attention_mask.dim() == 2
        ):  # [B, T] keys: causal & not padding
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
        kernel = prefix_kernel(query.device) if kernel_ok else None
        if kernel is not None and packed_keys is not None and packed_cu_seqlens is not None:
            q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, D]
            out = _run_prefixed(kernel, q, k, v, packed_cu_seqlens, packed_keys, scaling)
            return out.unsqueeze(0), None
        return _prefixed_attention(module, query, key, value, packed_bounds, dropout, scaling), None
    kernel = varlen_kernel(query.device) if kernel_ok else None
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


@dataclass(frozen=True)
class PrefixKeys:
    """The keys of a shared-prefix row for a varlen kernel: sequence 0 is the prefix, sequence i > 0
    the prefix again and then part i, so that part i's queries (the row's own, split at the row's
    bounds) see the prefix and causally themselves (`prefix_key_layout`)."""

    index: torch.Tensor  # int64 [prefix + sum(prefix + part)]: row positions, in key order
    cu_seqlens: torch.Tensor  # int32 [B + 2]: key sequence starts, then the end
    longest: tuple[int, int]  # the longest query part, the longest key sequence


def _run_prefixed(
    kernel: VarlenKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    keys: PrefixKeys,
    scale: float | None,
) -> torch.Tensor:
    """A shared-prefix row ([N, heads, D] each, ``cu_q`` its bounds) through a varlen kernel."""
    k, v = k.index_select(0, keys.index), v.index_select(0, keys.index)
    return kernel(q, k, v, cu_q, keys.cu_seqlens, *keys.longest, scale)


def prefix_key_layout(bounds: tuple[int, ...], device: torch.device) -> PrefixKeys:
    """`PrefixKeys` of a row whose ``bounds`` are (0, prefix, part starts..., end)."""
    pre = bounds[1]
    parts = list(itertools.pairwise(bounds[1:]))
    index = torch.cat(
        [torch.arange(pre)] + [torch.cat([torch.arange(pre), torch.arange(a, b)]) for a, b in parts]
    )
    key_lens = [pre] + [pre + b - a for a, b in parts]
    cu = torch.tensor([0, *itertools.accumulate(key_lens)], dtype=torch.int32)
    longest_q = max([pre] + [b - a for a, b in parts])
    return PrefixKeys(index.to(device), cu.to(device), (longest_q, max(key_lens)))


VarlenKernel = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        int,
        int,
        "float | None",
    ],
    torch.Tensor,
]
"""(q [Nq, heads, D], k, v [Nk, kv heads, D], cu_seqlens_q, cu_seqlens_k int32 [B + 1], longest q,
longest k, scale) -> [Nq, heads, D]: sequence i's queries attend to its keys causally, aligned at
the end (query j of n over m keys sees keys 0 .. m - n + j: flash attention's convention), which is
plain causal attention where queries and keys are the same tokens."""


@functools.cache
def varlen_kernel(device: torch.device) -> VarlenKernel | None:
    """The varlen attention kernel packed micro-batches use on ``device`` (CUDA), or None: one SDPA
    call per sequence. flash-attn's when installed; else torch's ``varlen_attn`` (prototype since
    torch 2.9, its arguments changed between releases) if it matches per-sequence SDPA, forward and
    gradients, on a small GQA case on this device (`check_varlen_kernel`)."""
    try:
        from flash_attn import flash_attn_varlen_func  # pyright: ignore[reportMissingImports]
    except ImportError:  # optional package
        pass
    else:
        return lambda q, k, v, cu_q, cu_k, max_q, max_k, scale: flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True
        )
    kernel = torch_varlen_kernel()
    if kernel is None:
        return None
    problem = check_varlen_kernel(kernel, device, torch.bfloat16)
    if problem:
        from common.logging import get_logger

        get_logger("learner.attention").warning(
            "torch varlen_attn not used for packed micro-batches: one SDPA call "
            "per sequence instead",
            problem=problem,
        )
        return None
    return kernel


@functools.cache
def prefix_kernel(device: torch.device) -> VarlenKernel | None:
    """`varlen_kernel` where it also runs shared-prefix rows right (`check_varlen_kernel` with a
    prefix: queries fewer than keys, causality aligned at the end), else None."""
    kernel = varlen_kernel(device)
    if kernel is None:
        return None
    problem = check_varlen_kernel(kernel, device, torch.bfloat16, prefix=7)
    if problem:
        from common.logging import get_logger

        get_logger("learner.attention").warning(
            "the varlen kernel gets shared-prefix rows wrong: micro-batches share no prefix",
            problem=problem,
        )
        return None
    return kernel


def can_share_prefix(device: torch.device) -> bool:
    """Whether packed micro-batches on ``device`` may share their prefix: always where attention
    runs one SDPA call per sequence (the CPU, a GPU with no varlen kernel), and on a GPU whose
    varlen kernel passed the prefixed check (sharing there would otherwise mean leaving the kernel
    for the per-sequence path)."""
    return (
        device.type != "cuda" or varlen_kernel(device) is None or prefix_kernel(device) is not None
    )


def torch_varlen_kernel() -> VarlenKernel | None:
    """torch.nn.attention.varlen.varlen_attn behind `VarlenKernel`, for the argument names this torch
    has (causality as ``is_causal`` or ``window_size=(-1, 0)``; GQA through ``enable_gqa`` or by
    repeating the key/value heads); None when it has no such function."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any] = (
        {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    )
    if "is_causal" not in params and "window_size" not in params:
        return None

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        scale: float | None,
    ) -> torch.Tensor:
        extra = dict(causal)
        if k.size(1) != q.size(1):
            if "enable_gqa" in params:
                extra["enable_gqa"] = True
            else:  # each key/value head serves a run of query heads, as transformers' repeat_kv
                k, v = (x.repeat_interleave(q.size(1) // x.size(1), dim=1) for x in (k, v))
        if scale is not None and "scale" in params:
            extra["scale"] = scale
        elif scale is not None and scale != q.size(-1) ** -0.5:
            raise ValueError("this torch's varlen_attn takes no scale")
        out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **extra)
        assert isinstance(out, torch.Tensor)  # (out, aux) only when return_aux is asked for
        return out

    return run


@torch.enable_grad()  # its first caller may be a forward-only pass (no_grad): it needs gradients
def check_varlen_kernel(
    kernel: VarlenKernel, device: torch.device, dtype: torch.dtype, prefix: int = 0
) -> str | None:
    """None when ``kernel`` gives per-sequence causal SDPA's output and gradients (to ``dtype``'s
    precision) on two sequences with grouped key/value heads; with ``prefix`` > 0, on a row of a
    shared prefix and two parts laid out as `collate` shares them (the kernel called as
    `packed_attention` calls it); else what went wrong."""
    gen = torch.Generator().manual_seed(0)
    lens, heads, kv_heads, dim = (5, 11), 4, 2, 64
    bounds = tuple(itertools.accumulate((0, prefix, *lens) if prefix else (0, *lens)))
    n = bounds[-1]
    q, k, v = (
        torch.randn(n, h, dim, generator=gen).to(device, dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    try:
        if prefix:
            keys = prefix_key_layout(bounds, device)
            out = _run_prefixed(kernel, q, k, v, cu, keys, dim**-0.5)
        else:
            out = kernel(q, k, v, cu, cu, max(lens), max(lens), dim**-0.5)
        got = [out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))]
    except Exception as exc:  # a prototype API: any failure means "do not use it"
        return f"{type(exc).__name__}: {exc}"
    parts = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        rows = torch.cat([torch.arange(prefix), torch.arange(a, b)]) if prefix and i else None
        qs = q[a:b].transpose(0, 1)[None]
        ks, vs = (
            (x[a:b] if rows is None else x[rows.to(device)]).transpose(0, 1)[None] for x in (k, v)
        )
        ks, vs = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (ks, vs))
        nq, nk = b - a, ks.shape[2]
        seen = torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq)
        parts.append(
            torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=seen, scale=dim**-0.5
            )[0].transpose(0, 1)
        )
    ref = torch.cat(parts)
    want = [ref, *torch.autograd.grad(ref.float().square().sum(), (q, k, v))]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        a, b = a.detach().float(), b.detach().float()
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
        if not err <= tol:
            return f"{name} differs from SDPA by {err:.3g} (relative)"
    return None


@functools.cache
def register_attention() -> None:
    """Make ATTENTION a transformers attention implementation. Its mask function is flash
    attention's: no mask when nothing is padded (so a packed row never gets an N x N mask), else the
    2-D padding mask that `packed_attention` turns into SDPA's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, flash_attention_mask)
