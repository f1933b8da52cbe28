"""Our learner's packed attention as a transformers attention implementation that verl's workers
load, so that verl trains packed sequences on the same kernel as ours.

Design: verl's padding removal (``actor_rollout_ref.model.use_remove_padding=true``) hands the model
one row of sequences laid end to end, ``attention_mask=None`` and per-sequence ``position_ids``.
verl expects flash-attn to read the sequence starts from those position ids; the GPU machines have
no flash-attn, and transformers' SDPA fallback builds an N x N block-diagonal mask and does N^2
work. Importing this module registers NAME with transformers: a row's sequence starts are where
its position ids stop counting up by one (as transformers' ``find_packed_sequence_indices`` reads
them), computed once per forward (cached on the position-id tensor every layer receives), and the
row goes through `learner.attention.packed_attention`, our learner's own function: torch's varlen
flash kernel on CUDA once checked against SDPA on the device, else one SDPA call per sequence.
Anything else (a padded batch, a mask) takes that function's padded SDPA path. verl loads it in
every worker with ``actor_rollout_ref.model.external_lib=bench.verl_plugins.varlen_attention`` and
``+actor_rollout_ref.model.override_config.attn_implementation=torch_varlen`` (the repository root
on the workers' ``PYTHONPATH``). `packed_logprob_error` is the check bench/vs_verl.py runs on the
device before timing verl, and the tests run on the CPU.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from learner import varlen
from learner.attention import packed_attention

NAME = "torch_varlen"


def sequence_bounds(position_ids: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
    """Sequence starts of a packed row, then its end, from its position ids [1, N]: a sequence
    starts wherever the ids do not go up by one. Also as int32 cu_seqlens on their device."""
    cached = getattr(position_ids, "_varlen_bounds", None)
    if cached is not None:
        return cached
    ids = position_ids[0]
    starts = torch.nonzero(ids[1:] - ids[:-1] != 1).flatten() + 1
    bounds = (0, *starts.tolist(), ids.numel())
    out = bounds, torch.tensor(bounds, dtype=torch.int32, device=ids.device)
    # every layer of one forward receives this same tensor: work the bounds out once
    position_ids._varlen_bounds = out  # type: ignore[attr-defined]
    return out


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function ([B, heads, T, D] in, [B, T, heads, D] out): a packed row
    (one row, no mask, position ids) as `packed_attention` runs our learner's packed rows."""
    kwargs.pop("packed_bounds", None)
    packed = position_ids is not None and attention_mask is None and query.shape[0] == 1
    if packed and position_ids is not None and position_ids.dim() == 2:
        bounds, cu = sequence_bounds(position_ids)
        return packed_attention(
            module,
            query,
            key,
            value,
            None,
            dropout,
            scaling,
            packed_bounds=bounds,
            packed_cu_seqlens=cu,
            **kwargs,
        )
    return packed_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def register() -> None:
    """NAME as a transformers attention implementation, with flash attention's mask function: no
    mask for a packed row (never an N x N one), the 2-D padding mask otherwise."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def packed_logprob_error(
    model: nn.Module, lengths: list[int], vocab: int, seed: int = 0
) -> tuple[float, float, float]:
    """Token log-probabilities of random sequences of ``lengths``, packed in one row through NAME
    against one SDPA forward per sequence, on ``model``'s device and dtype: (the largest absolute
    difference, the largest absolute logprob, the noise floor: the largest absolute difference
    between the per-sequence logprobs in this dtype and in float32). ``model`` is a transformers
    causal LM; its weights are back in their dtype on return."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in lengths]
    config: Any = model.config
    saved = config._attn_implementation
    try:
        with torch.no_grad():
            config._attn_implementation = NAME
            ids = torch.cat(seqs)[None]
            pos = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
            packed = _token_logprobs(model(input_ids=ids, position_ids=pos).logits[0], ids[0])
            config._attn_implementation = "sdpa"
            alone = _alone(model, seqs)
            # bf16 weights go to fp32 and back exactly: the floor costs no change to the model
            exact = _alone(model.float(), seqs) if dtype != torch.float32 else alone
            model.to(dtype)
    finally:
        config._attn_implementation = saved
    # the last token of each sequence predicts nothing of its own: leave those out of all three
    keep = torch.ones(sum(lengths), dtype=torch.bool, device=device)
    keep[torch.tensor(list(itertools.accumulate(lengths)), device=device) - 1] = False
    packed, alone, exact = packed[keep], alone[keep], exact[keep]
    return (
        float((packed - alone).abs().max()),
        float(alone.abs().max()),
        float((alone - exact).abs().max()),
    )


def _alone(model: nn.Module, seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([_token_logprobs(model(input_ids=s[None]).logits[0], s) for s in seqs])


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token (position t predicts ids[t + 1]; the last gets 0)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nxt = torch.roll(ids, -1)
    return logp.gather(-1, nxt[:, None])[:, 0]


def check(model_dir: str, device: str, dtype: str, lengths: list[int]) -> dict[str, Any]:
    """`packed_logprob_error` of the model in ``model_dir`` (loaded as verl's workers load it, with
    SDPA as the fallback implementation) and whether CUDA ran it through a varlen kernel. ``ok``:
    the packed logprobs are within twice the rounding floor of ``dtype`` of the per-sequence ones
    (in float32, 1e-4 of the largest logprob)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype, attn_implementation="sdpa"
    )
    model = model.to(device)
    vocab = int(model.config.vocab_size)
    err, scale, floor = packed_logprob_error(model.eval(), lengths, vocab)
    # packing may differ from per-sequence attention by rounding only: within twice what this
    # dtype's rounding alone moves the per-sequence logprobs (float32: 1e-4 of the largest)
    tol = max(2 * floor, 1e-4 * max(scale, 1.0))
    kernel = device.startswith("cuda") and varlen.varlen_kernel(torch.device(device)) is not None
    return {
        "ok": err <= tol,
        "max_abs_err": round(err, 6),
        "tolerance": round(tol, 6),
        "max_abs_logprob": round(scale, 4),
        "rounding_floor": round(floor, 6),
        "varlen_kernel": kernel,
        "lengths": lengths,
        "dtype": dtype,
        "device": device,
    }


register()

if __name__ == "__main__":
    import argparse
    import json

    p = argparse.ArgumentParser(description="packed logprobs through NAME vs per-sequence SDPA")
    p.add_argument("model_dir")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--lengths", default="150,1100,40,700,1", help="packed sequence lengths")
    a = p.parse_args()
    result = check(a.model_dir, a.device, a.dtype, [int(x) for x in a.lengths.split(",")])
    print(json.dumps(result, sort_keys=True))
    raise SystemExit(0 if result["ok"] else 1)
