"""bench/verl_plugins/logprobs.py on the CPU: verl's workers get token logprobs equal to verl's own
fallback (values and gradients), from one vectorised call, wherever verl bound the name."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

torch = pytest.importorskip("torch")
verl_f = pytest.importorskip("verl.utils.torch_functional")

from bench.verl_plugins import logprobs as plugin  # noqa: E402


@pytest.fixture
def restore_verl():
    original = verl_f.logprobs_from_logits
    yield original
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("verl")
            and getattr(module, plugin.NAME, None) is plugin.vectorised_logprobs
        ):
            setattr(module, plugin.NAME, original)


def test_same_values_and_gradients_as_verls_fallback() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 301, generator=gen) * 4  # [tokens, vocab], as under padding removal
    labels = torch.randint(0, 301, (37,), generator=gen)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    theirs = verl_f.logprobs_from_logits_v2(a, labels)
    ours = plugin.vectorised_logprobs(b, labels, inplace_backward=True)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    weights = torch.randn(37, generator=gen)
    (theirs * weights).sum().backward()
    (ours * weights).sum().backward()
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=0)


def test_bf16_logits_reduce_in_float32_as_flash_attns_kernel() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, 4099, generator=gen) * 4).bfloat16()
    labels = torch.randint(0, 4099, (16,), generator=gen)
    exact = verl_f.logprobs_from_logits_v2(logits.float(), labels)
    ours = plugin.vectorised_logprobs(logits, labels)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, exact, atol=1e-5, rtol=0)


def test_install_patches_every_bound_name(restore_verl, monkeypatch) -> None:
    original = restore_verl
    # a verl module that bound the name at import (``from verl.utils.torch_functional import
    # logprobs_from_logits``), as verl's FSDP engine does; it needs peft, absent here
    engine = types.ModuleType("verl.workers.engine.fsdp.bound_at_import")
    setattr(engine, plugin.NAME, original)
    monkeypatch.setitem(sys.modules, engine.__name__, engine)
    other = types.ModuleType("not_verl")  # outside verl: left alone
    setattr(other, plugin.NAME, original)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    patched = plugin.install()
    assert {"verl.utils.torch_functional", engine.__name__} <= set(patched)
    assert verl_f.logprobs_from_logits is plugin.vectorised_logprobs
    assert getattr(engine, plugin.NAME) is plugin.vectorised_logprobs
    assert getattr(other, plugin.NAME) is original
    assert plugin.install() == []  # nothing left to patch


def test_the_log_says_which_workers_loaded_the_plugins() -> None:
    from bench import verl_side
    from bench.verl_plugins import workers

    assert workers.MARK == verl_side.WORKER_MARK
    log = (
        "(TaskRunner pid=1) hello\n"
        f"(WorkerDict pid=7) {workers.MARK} pid 7 attention torch_varlen, logprobs in "
        "verl.utils.torch_functional\n"
        f"(vLLMHttpServer pid=9) {workers.MARK} pid 9 attention torch_varlen, logprobs in -\n"
    )
    assert verl_side.plugin_report(log) == {"processes": 2, "logprobs_patched": False}
    assert verl_side.plugin_report(log.rsplit("(vLLM", 1)[0]) == {
        "processes": 1,
        "logprobs_patched": True,
    }
    assert verl_side.plugin_report("nothing") == {"processes": 0, "logprobs_patched": False}
