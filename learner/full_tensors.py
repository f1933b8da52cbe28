"""Many FSDP2-sharded tensors gathered whole with one collective per dtype.

Design: FSDP2 shards each parameter on dim 0 across a 1-D mesh as ``torch.chunk`` splits it (each
rank holds ``ceil(rows / world)`` rows, the last ones fewer or none). Gathering tensor by tensor
(``DTensor.full_tensor``) costs a collective and its Python dispatch for each, and a LoRA adapter
has hundreds of small tensors. Here every rank pads its shard of each tensor to the common row
count and packs them into one flat buffer; one ``all_gather_into_tensor`` brings every rank's
buffer, and each tensor is its ranks' rows in rank order with the padding dropped. On a mesh of one
rank the local shard is the whole tensor and nothing is sent. A tensor that is not sharded this
way (another placement, a 2-D mesh) is gathered on its own with ``full_tensor``, and a plain
tensor is returned as it is. Every rank must pass the same tensors in the same order (collective).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _rows_sharded(t: DTensor) -> bool:
    """Sharded on dim 0 over a 1-D mesh, with this rank's shard where ``torch.chunk`` puts it."""
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),) or t.dim() == 0:
        return False
    world, rank = t.device_mesh.size(), t.device_mesh.get_local_rank()
    rows = math.ceil(t.shape[0] / world)
    mine = max(0, min(rows, t.shape[0] - rank * rows))
    return t.to_local().shape[0] == mine


def full_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Collective: each of ``tensors`` whole, where the shards lie (see the module docstring)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    packed: dict[tuple[torch.dtype, int], list[tuple[int, DTensor]]] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, DTensor):
            out[i] = t
        elif _rows_sharded(t):
            packed.setdefault((t.dtype, id(t.device_mesh)), []).append((i, t))
        else:
            out[i] = t.full_tensor()
    for group in packed.values():
        wholes = _gather_packed([t for _, t in group])
        for (i, _), whole in zip(group, wholes, strict=True):
            out[i] = whole
    assert all(t is not None for t in out)
    return [t for t in out if t is not None]


def _gather_packed(tensors: list[DTensor]) -> list[torch.Tensor]:
    """Row-sharded DTensors of one dtype and mesh, whole, through one all-gather."""
    locals_ = [t.to_local() for t in tensors]
    mesh = tensors[0].device_mesh
    world = mesh.size()
    if world == 1:
        return locals_
    rows = [math.ceil(t.shape[0] / world) for t in tensors]
    sizes = [r * math.prod(t.shape[1:]) for r, t in zip(rows, tensors, strict=True)]
    total = sum(sizes)
    flat = torch.zeros(total, dtype=tensors[0].dtype, device=locals_[0].device)
    offset = 0
    for local, size in zip(locals_, sizes, strict=True):
        flat[offset : offset + local.numel()] = local.reshape(-1)
        offset += size
    gathered = torch.empty(world * total, dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(gathered, flat, group=mesh.get_group())
    by_rank = gathered.view(world, total)
    out, offset = [], 0
    for t, r, size in zip(tensors, rows, sizes, strict=True):
        block = by_rank[:, offset : offset + size].reshape(world * r, *t.shape[1:])
        out.append(block[: t.shape[0]])
        offset += size
    return out
