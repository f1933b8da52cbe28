"""Tests of tools/deterministic.py on the CPU, with real torch ops: a strict backward gives the
plain one's gradients; a backward through an op that has no deterministic kernel (``Tensor.put``,
whose backward calls ``put_`` without accumulation, refused in strict mode on every device) falls
back to warn-only with the same gradients and says why; other errors pass through; the flag is
left in warn-only mode either way. The CUDA attention kernels this is for run on the GPU only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tools.deterministic import StrictBackward, repeat_check


@pytest.fixture(autouse=True)
def restore_flags() -> Iterator[None]:
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _through_put(model: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(8.0).reshape(2, 4)
    y = model(x).flatten()
    # backward of put w.r.t. its input: put_ with accumulate=False, no deterministic kernel
    z = y.put(torch.tensor([0, 2]), torch.zeros(2))
    loss = (z**2).sum()
    return loss.detach(), loss


def test_a_strict_backward_gives_the_plain_gradients() -> None:
    plain, strict = _model(), _model()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    (plain(x) ** 2).sum().backward()

    run = StrictBackward(torch, strict=True)
    out = run.run(lambda: (strict(x) ** 2).sum(), lambda: strict.zero_grad())

    assert out.item() == pytest.approx((plain(x) ** 2).sum().item())
    assert all(torch.equal(a, b) for a, b in zip(_grads(plain), _grads(strict), strict=True))
    assert run.mode == "strict" and run.strict
    assert torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.filterwarnings("ignore:put_ does not have a deterministic implementation")
def test_an_op_without_a_deterministic_kernel_falls_back_to_warn_only() -> None:
    reference = _model()
    _through_put(reference)[1].backward()

    model = _model()
    forwards = []

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        forwards.append(1)
        return _through_put(model)

    run = StrictBackward(torch, strict=True)
    value, _loss = run.run(forward, lambda: model.zero_grad(set_to_none=True))

    assert len(forwards) == 2  # the failed backward's graph is gone: the forward ran again
    assert value.item() == pytest.approx(_through_put(reference)[0].item())
    assert all(torch.equal(a, b) for a, b in zip(_grads(reference), _grads(model), strict=True))
    assert not run.strict
    assert run.mode.startswith("warn_only: put_ does not have a deterministic implementation")
    assert torch.is_deterministic_algorithms_warn_only_enabled()

    # every later backward runs in warn-only mode, and once
    forwards.clear()
    run.run(forward, lambda: model.zero_grad(set_to_none=True))
    assert len(forwards) == 1


def test_other_errors_pass_through_and_leave_warn_only_mode() -> None:
    def bad() -> torch.Tensor:
        x = torch.ones(2, requires_grad=True)
        return x * 2  # not a scalar: backward needs a gradient

    run = StrictBackward(torch, strict=True)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar"):
        run.run(bad, lambda: None)
    assert run.strict and run.fallback is None
    assert torch.is_deterministic_algorithms_warn_only_enabled()


def test_off_never_touches_the_flag() -> None:
    torch.use_deterministic_algorithms(False)
    model = _model()
    run = StrictBackward(torch, strict=False)
    run.run(lambda: _through_put(model)[1], lambda: None)  # would raise in strict mode
    assert run.mode == "off"
    assert not torch.are_deterministic_algorithms_enabled()


def _attention_model() -> torch.nn.Module:
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)
            self.out = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, jitter: float = 0.0) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            # jitter stands in for a kernel whose reduction order changes from run to run
            return self.out(a * (1 + jitter * torch.rand(())))

    return Tiny()


def test_repeat_check_finds_a_step_that_repeats() -> None:
    model = _attention_model()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))

    def run() -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss

    got = repeat_check(torch, list(model.named_parameters()), run, model.zero_grad)
    assert got["params"] == 4
    for backend in ("default", "math_attention"):
        assert got[backend] == {"loss_equal": True, "grads_differ": [], "n": 0}
    assert all(p.grad is None for p in model.parameters())


def test_repeat_check_names_the_gradients_that_do_not_repeat() -> None:
    model = _attention_model()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))

    def run() -> torch.Tensor:
        loss = model(x, jitter=1e-3).square().mean()
        loss.backward()
        return loss

    got = repeat_check(torch, list(model.named_parameters()), run, model.zero_grad)
    for backend in ("default", "math_attention"):
        assert got[backend]["loss_equal"] is False
        assert got[backend]["n"] == 4
        assert set(got[backend]["grads_differ"]) == {
            "qkv.weight",
            "qkv.bias",
            "out.weight",
            "out.bias",
        }
