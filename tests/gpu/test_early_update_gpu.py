"""A step's first mini-batch held in the learner's wait (`learner.early_update`) on CUDA: one FSDP2
rank over NCCL, bf16 compute. The held step (its forward and backward in the wait, the optimizer
step deferred, the gathered parameters resharded before the update continues) must train the step
the plain one trains, and an update that does not continue it must drop its gradients; the same
check as tests/learner/test_early_update_step.py on gloo, here where FSDP2 keeps its parameters on
the device. bf16 rounding apart: the held group's reference forward runs on its samples alone.
Skipped without a GPU or without the learner's packages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.nightly]

REPO = Path(__file__).resolve().parents[2]
CUDA = ("trainer.device=cuda", "trainer.n_gpus_per_node=1")


def test_held_first_mini_batch_on_cuda(
    tiny_model: Path, ray_one_gpu: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tests" / "learner"))
    from test_early_update_step import one_step

    runs = {
        mode: anyio.run(lambda m=mode: one_step(tiny_model, tmp_path / m, m, CUDA))
        for mode in ("plain", "held", "dropped")
    }
    (m_plain, w_plain), (m_held, w_held), (m_drop, w_drop) = runs.values()
    assert m_held.keys() == m_plain.keys() == m_drop.keys()
    assert m_plain["actor/kl_loss"] != 0.0, "the reference took part"
    for m in (m_held, m_drop):
        for k in m_plain:
            assert m[k] == pytest.approx(m_plain[k], abs=1e-3, rel=2e-2), k
    from safetensors.numpy import load_file

    before = load_file(str(tiny_model / "model.safetensors"))
    moved = max(float(np.abs(w_plain[n] - before[n]).max()) for n in w_plain)
    assert moved > 1e-4, "it trained"
    # A held step that kept stale gathered parameters, or trained the first mini-batch twice, moves
    # the weights by about as much as the step itself; bf16 rounding moves them by far less.
    for w in (w_held, w_drop):
        apart = max(float(np.abs(w[n] - w_plain[n]).max()) for n in w_plain)
        assert apart < 0.1 * moved, (apart, moved)
