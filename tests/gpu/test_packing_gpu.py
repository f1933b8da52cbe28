"""Shared-prefix micro-batches on CUDA, through the varlen kernel, no fakes.

On a GPU whose varlen kernel passed the checks (`learner.varlen.prefix_kernel`), a packed
micro-batch whose sequences share a prefix lays the prefix out once and runs every part's queries
against its own keys [prefix | part] in one kernel call. Its logprobs and gradients must be those
of the same samples packed without sharing, in bf16 (FSDP's compute dtype). Skipped
without a GPU (tests/conftest.py) or without the learner's packages (verl, ...: carried as wheels).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tools.make_tiny_model import TinyModelSpec, make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.nightly]


def test_shared_prefix_rows_through_the_varlen_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = [m for m in ("verl", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the learner needs {missing}, not installed here")
    import torch

    from learner import varlen
    from learner.model import PolicyHead, collate, load_causal_lm, policy_outputs
    from learner.samples import Sample
    from learner.varlen import prefix_kernel, varlen_kernel

    dev = torch.device("cuda")
    if varlen_kernel(dev) is None:
        pytest.skip("no varlen kernel here: shared rows take the per-sequence path (CPU tests)")
    assert prefix_kernel(dev) is not None, "the varlen kernel failed the shared-prefix check"

    path = make_tiny_model(
        tmp_path / "m", TinyModelSpec(num_heads=4, num_kv_heads=2, hidden_size=256)
    )
    lm = load_causal_lm(str(path), trust_remote_code=False, gradient_checkpointing=False)
    # bf16 parameters, as FSDP's mixed precision: with fp32 ones the queries are fp32 (RoPE's
    # tables follow the embeddings) and attention leaves the kernel for the per-sequence path
    policy = PolicyHead(lm).to(dev, dtype=torch.bfloat16).train()
    through_kernel: list[int] = []
    run_prefixed = varlen.run_prefixed
    monkeypatch.setattr(
        varlen,
        "run_prefixed",
        lambda *a: through_kernel.append(1) or run_prefixed(*a),
    )
    rng = np.random.default_rng(0)
    head = rng.integers(0, 500, 60)
    samples = []
    for _ in range(6):
        t, r = int(rng.integers(4, 30)), int(rng.integers(5, 40))
        ids = np.concatenate([head, rng.integers(0, 500, t + r)]).astype(np.int64)
        samples.append(Sample(ids, 60 + t, np.ones(r, np.float32)))

    def run(shared: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        b = collate(samples, dev, packed=True, share_prefix=shared)
        assert b.packing is not None and (b.packing.keys is not None) == shared
        policy.zero_grad(set_to_none=True)
        logp, _ = policy_outputs(policy, b)
        (logp * b.response_mask).sum().backward()
        grads = [p.grad.detach().clone() for p in policy.parameters() if p.grad is not None]
        return logp.detach().float(), grads, b.prefix

    plain, plain_grads, _ = run(False)
    assert not through_kernel
    shared, shared_grads, prefix = run(True)
    assert prefix >= 60
    assert len(through_kernel) == lm.config.num_hidden_layers, "not the kernel path"
    torch.testing.assert_close(shared, plain, atol=3e-2, rtol=0)
    assert len(shared_grads) == len(plain_grads)
    for a, b in zip(shared_grads, plain_grads, strict=True):
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
        assert err < 5e-2, err
