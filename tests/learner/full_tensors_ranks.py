"""One rank of tests/learner/test_full_tensors.py (a module of its own: spawned ranks import it
by name)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

WORLD = 3
SHAPES = [(1, 4), (2,), (5, 3), (7, 2, 2), (16, 8), (3, 5)]


def run_rank(rank: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from learner.full_tensors import full_tensors

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        gen = torch.Generator().manual_seed(0)  # the same tensors on every rank
        whole = [torch.randn(s, generator=gen) for s in SHAPES]
        whole.append(torch.randn(6, 3, generator=gen).to(torch.bfloat16))
        sharded = [distribute_tensor(t, mesh, [Shard(0)]) for t in whole]
        sharded.append(distribute_tensor(torch.randn(4, 2, generator=gen), mesh, [Replicate()]))
        sharded.append(torch.arange(5.0))
        got = full_tensors(sharded)
        want = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in sharded]
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
        Path(out, f"ok{rank}").touch()
        # Every rank past its last collective before any tears gloo down: a rank whose peers
        # closed their sockets first has aborted ("terminate called without an active exception").
        # A rank that failed above skips this, and mp.spawn ends the others.
        dist.barrier()
    finally:
        dist.destroy_process_group()
