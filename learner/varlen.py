"""Varlen attention kernels for the learner's packed micro-batches: which one, whether to trust it,
and how a shared-prefix row goes through it.

Design: a `VarlenKernel` is flash attention's varlen call behind one signature (flash-attn's when
installed, else torch's prototype ``torch.nn.attention.varlen``), used on CUDA only after
`check_varlen_kernel` compared it with per-sequence SDPA, forward and gradients, on the device.
A shared-prefix row (`learner.model.collate` with ``share_prefix``: the prefix once, then each
sequence's rest) goes through the same kernel with queries and keys laid out differently
(`prefix_key_layout`): the queries are the row's own tokens, split at its bounds; sequence 0's keys
are the prefix, sequence i's the prefix again and then part i, gathered by index. Flash attention
aligns causality at the end of a sequence's keys, so part i sees the whole prefix and causally
itself. That costs a copy of the prefix's keys and values per sequence (kv heads only), far less
than running the prefix's tokens through every layer once per sequence; the gradients of the
repeated rows are summed in fp32 (`_GatherRows`). Sharing is used on a GPU only where the kernel
also passed the prefixed check (`prefix_kernel`, `can_share_prefix`). `learner.attention` calls
these; the checks are cached per device.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.logging import get_logger


@dataclass(frozen=True)
class PrefixKeys:
    """The keys of a shared-prefix row for a varlen kernel: sequence 0 is the prefix, sequence i > 0
    the prefix again and then part i, so that part i's queries (the row's own, split at the row's
    bounds) see the prefix and causally themselves (`prefix_key_layout`)."""

    index: torch.Tensor  # int64 [prefix + sum(prefix + part)]: row positions, in key order
    cu_seqlens: torch.Tensor  # int32 [B + 2]: key sequence starts, then the end
    longest: tuple[int, int]  # the longest query part, the longest key sequence


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward sums the gradients of repeated rows in fp32: a
    prefix row's keys serve every sequence, and bf16 atomics would add B + 1 contributions at bf16
    precision, where the unshared layout sums them in the projection's fp32 GEMM."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        (grad,), (index,) = grads, ctx.saved_tensors
        acc = torch.zeros((ctx.rows, *grad.shape[1:]), dtype=torch.float32, device=grad.device)
        return acc.index_add_(0, index, grad.float()).to(grad.dtype), None


def run_prefixed(
    kernel: VarlenKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    keys: PrefixKeys,
    scale: float | None,
) -> torch.Tensor:
    """A shared-prefix row through a varlen kernel: q [N, heads, D], k and v [N, kv heads, D],
    ``cu_q`` the row's bounds (int32), ``keys`` its `prefix_key_layout`."""
    gather: Any = _GatherRows.apply  # typed by its forward only at run time
    k, v = gather(k, keys.index), gather(v, keys.index)
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
"""(q [Nq, heads, D], k, v [Nk, kv heads, D], cu_seqlens_q, cu_seqlens_k int32 [S + 1] for S
sequences (a shared-prefix row's prefix is one of them), longest q,
longest k, scale) -> [Nq, heads, D]: sequence i's queries attend to its keys causally, aligned at
the end (query j of n over m keys sees keys 0 .. m - n + j: flash attention's convention), which is
plain causal attention where queries and keys are the same tokens."""


def _one_name(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N`` (the current device, what tensors report): one cache entry each."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def varlen_kernel(device: torch.device) -> VarlenKernel | None:
    """The varlen attention kernel packed micro-batches use on ``device`` (CUDA), or None: one SDPA
    call per sequence. flash-attn's when installed; else torch's ``varlen_attn`` (prototype since
    torch 2.9, its arguments changed between releases) if it matches per-sequence SDPA, forward and
    gradients, on a small GQA case on this device (`check_varlen_kernel`)."""
    return _varlen_kernel(_one_name(device))


@functools.cache
def _varlen_kernel(device: torch.device) -> VarlenKernel | None:
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
        get_logger("learner.attention").warning(
            "torch varlen_attn not used for packed micro-batches: one SDPA call "
            "per sequence instead",
            problem=problem,
        )
        return None
    return kernel


def prefix_kernel(device: torch.device) -> VarlenKernel | None:
    """`varlen_kernel` where it also runs shared-prefix rows right (`check_varlen_kernel` with a
    short and a long prefix: queries fewer than keys, causality aligned at the end, sequences
    longer than a kernel tile), else None."""
    return _prefix_kernel(_one_name(device))


@functools.cache
def _prefix_kernel(device: torch.device) -> VarlenKernel | None:
    kernel = varlen_kernel(device)
    if kernel is None:
        return None
    problem = check_varlen_kernel(kernel, device, torch.bfloat16, prefix=7) or check_varlen_kernel(
        kernel, device, torch.bfloat16, prefix=200
    )
    if problem:
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
    lens, heads, kv_heads, dim = (5, 11) if prefix < 100 else (5, 150), 4, 2, 64
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
            out = run_prefixed(kernel, q, k, v, cu, keys, dim**-0.5)
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
