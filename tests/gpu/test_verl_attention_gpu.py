"""The attention implementation verl's workers load for bench/vs_verl.py, on CUDA in bf16, no fakes:
a packed row goes through the varlen kernel (the one our learner trains with) and its logprobs are
those of one SDPA forward per sequence, to bf16's tolerance. bench/vs_verl.py runs the same check
on its warmed model before timing verl. Skipped without a GPU (tests/conftest.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tools.make_tiny_model import TinyModelSpec, make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

pytestmark = [pytest.mark.gpu, pytest.mark.nightly]


def test_packed_rows_through_the_varlen_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from bench.verl_plugins import varlen_attention as plugin
    from learner import varlen

    if varlen.varlen_kernel(torch.device("cuda")) is None:
        pytest.skip("no varlen kernel on this GPU: packed rows take the per-sequence path")
    calls: list[int] = []
    real = varlen.varlen_kernel

    def counted(device: torch.device) -> varlen.VarlenKernel | None:
        kernel = real(device)
        assert kernel is not None
        calls.append(1)
        return kernel

    monkeypatch.setattr(varlen, "varlen_kernel", counted)
    spec = TinyModelSpec(num_heads=4, num_kv_heads=2, hidden_size=256, num_layers=3)
    path = make_tiny_model(tmp_path / "m", spec)
    result = plugin.check(str(path), "cuda", "bfloat16", [150, 1100, 40, 700, 1])
    assert result["ok"], result
    # every layer of the packed forward through the kernel, and check()'s own report of it
    assert result["varlen_kernel"] and len(calls) == spec.num_layers + 1
