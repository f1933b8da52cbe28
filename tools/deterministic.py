"""Backward passes on deterministic kernels, for a warm-up that lands where its seed says.

Design: torch's ``use_deterministic_algorithms(True, warn_only=True)`` does not make attention's
backward deterministic. Flash, memory-efficient and cuDNN attention read that flag and, in
warn-only mode, only warn and keep their atomic accumulation. So two warm-ups of one seed on one
GPU type part after a few hundred steps and stop at different steps. In strict mode
(``warn_only=False``) they run their deterministic algorithm, and an op without one raises
instead.

Which attention kernel SDPA runs is chosen in the forward, and cuDNN attention is left out of the
choice only in strict mode, while torch runs its backward non-deterministically in any mode: a
caller whose forward runs warn-only switches cuDNN attention off
(``torch.backends.cuda.enable_cudnn_sdp(False)``, as tools/warmup.py does).

``StrictBackward.run`` runs each backward in strict mode and the forward and everything else in
warn-only mode: a forward op without a deterministic kernel cannot stop the run. A backward that
raises for want of a deterministic kernel is not fatal either. The step's gradients are dropped,
its forward runs again, and its backward runs in warn-only mode, as does every later one. The
reason is kept for the warm-up's summary, which then no longer claims to be deterministic. The
flag is process-wide, so this suits a process of its own (the warm-up is one wherever it runs on
a GPU). ``strict=False`` (the CPU, whose kernels are deterministic) runs the plain backward and
never touches the flag.

``repeat_check`` says whether one step repeats: it runs a forward and a backward twice from the same
weights on the same batch and names the parameters whose gradients differ bit for bit, once with
the default attention kernels and once with attention as plain matmuls (torch's math backend), so
that a warm-up that does not repeat says whether attention is why. The warm-up runs it on its
first batch on CUDA and keeps the answer in its summary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"
"""What torch's error says when an op has no deterministic kernel."""


@dataclass
class StrictBackward:
    """One warm-up's backward passes; ``fallback`` is why they left strict mode, if they did."""

    torch: Any  # the torch module: imported by the caller (the CLI's --help stays instant)
    strict: bool
    fallback: str | None = None

    @property
    def mode(self) -> str:
        if self.fallback is not None:
            return f"warn_only: {self.fallback}"
        return "strict" if self.strict else "off"

    def run(self, forward: Callable[[], Any], zero_grad: Callable[[], None]) -> Any:
        """``forward()`` returns a loss (or a tuple whose last item is the loss to back-propagate),
        computed afresh on each call; its result, after the backward."""
        out = forward()
        if self.strict:
            self.torch.use_deterministic_algorithms(True, warn_only=False)
            try:
                _loss(out).backward()
                return out
            except RuntimeError as e:
                if NO_DETERMINISTIC_KERNEL not in str(e):
                    raise
                self.strict = False
                self.fallback = str(e).split(",")[0][:200]
            finally:
                self.torch.use_deterministic_algorithms(True, warn_only=True)
            # the failed backward may have written some gradients and freed the graph: start over
            zero_grad()
            out = forward()
        _loss(out).backward()
        return out


def _loss(out: Any) -> Any:
    return out[-1] if isinstance(out, tuple) else out


def repeat_check(
    torch: Any, params: list[tuple[str, Any]], run: Callable[[], Any], zero_grad: Callable[[], None]
) -> dict[str, Any]:
    """Run ``run()`` (a forward and its backward, returning the loss) twice from the same weights,
    under the default attention kernels and under the math backend; the loss's and the named
    ``params``' gradients compared bit for bit. Leaves the gradients zeroed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def twice() -> dict[str, Any]:
        seen = []
        for _ in range(2):
            zero_grad()
            loss = _loss(run())
            grads = {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
            seen.append((loss.detach().clone(), grads))
        (l0, g0), (l1, g1) = seen
        differ = [n for n in g0 if n not in g1 or not torch.equal(g0[n], g1[n])]
        return {
            "loss_equal": bool(torch.equal(l0, l1)),
            "grads_differ": differ[:8],
            "n": len(differ),
        }

    default = twice()
    with sdpa_kernel(SDPBackend.MATH):
        math = twice()
    zero_grad()
    return {"default": default, "math_attention": math, "params": len(params)}
