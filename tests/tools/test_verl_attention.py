"""bench/verl_plugins/varlen_attention.py on the CPU: the attention implementation verl's workers load
gives a packed row (verl's padding removal: one row, no mask, per-sequence position ids) the
logprobs of one SDPA forward per sequence, reads sequence starts as transformers does, and leaves
padded batches to SDPA. The device check (bf16, the varlen kernel) is tests/gpu's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench.verl_plugins import varlen_attention as plugin  # noqa: E402


def test_sequence_bounds_follow_the_position_ids() -> None:
    # three sequences; the second resumes at 5 (a continuation), the third restarts at 0
    pos = torch.tensor([[0, 1, 2, 5, 6, 0, 1, 2, 3]])
    bounds, cu = plugin.sequence_bounds(pos)
    assert bounds == (0, 3, 5, 9)
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32
    # one forward's layers share the tensor: the bounds are worked out once
    assert plugin.sequence_bounds(pos)[1] is cu
    assert plugin.sequence_bounds(torch.arange(4)[None])[0] == (0, 4)


def test_packed_row_gives_per_sequence_logprobs(tiny_model: Path) -> None:
    result = plugin.check(str(tiny_model), "cpu", "float32", [37, 5, 120, 1, 64])
    assert result["ok"], result
    assert result["max_abs_err"] < 1e-4 and result["max_abs_logprob"] > 1.0


def test_attention_without_packing_breaks_the_check(tiny_model: Path) -> None:
    """The check can fail: plain causal attention over the whole row lets each sequence see the
    ones before it, and its logprobs move far past the tolerance."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), attn_implementation="sdpa")
    vocab = int(model.config.vocab_size)
    real = plugin.packed_attention
    try:
        plugin.packed_attention = lambda m, q, k, v, mask, d, s, **kw: real(m, q, k, v, None, d, s)
        err, scale, _ = plugin.packed_logprob_error(model.eval(), [30, 40], vocab)
    finally:
        plugin.packed_attention = real
    assert err > 1e-2 * scale


def test_padded_batch_takes_sdpa(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), attn_implementation="sdpa")
    ids = torch.randint(0, int(model.config.vocab_size), (2, 9), generator=torch.Generator())
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        model.config._attn_implementation = plugin.NAME
        got = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-5)
