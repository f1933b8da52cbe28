"""`learner.full_tensors` against DTensor's own ``full_tensor``, on 3 real gloo ranks: shards of
every size torch.chunk makes (a tensor with fewer rows than ranks leaves a rank empty), two
dtypes packed apart, a replicated tensor gathered on its own, a plain tensor passed through."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from full_tensors_ranks import WORLD, run_rank

pytestmark = pytest.mark.integration


def test_one_collective_gathers_what_full_tensor_does(tmp_path: Path) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(run_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    assert sorted(p.name for p in tmp_path.glob("ok*")) == [f"ok{r}" for r in range(WORLD)]
