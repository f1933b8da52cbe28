"""Rank 0 writes the full policy into a safetensors file on /dev/shm: the weights file hand-over.

Design: a file's layout (header and offsets) depends only on tensor names, dtypes and shapes, which
never change during a run, so the learner keeps a few slot files and rewrites one in place per
version (``learner.weights_files`` picks it). The file is memory-mapped once per slot: its pages
are faulted in once and, on CUDA, registered with the driver (cudaHostRegister) once, so each later
update is one device-to-host copy per tensor straight into the file at pinned-memory speed, with no
staging buffer and no socket. Tensors are laid out by element size, largest first, so each starts
aligned for its dtype (the byte views need that; safetensors allows any order but no holes).
The gather is FSDP2's full state dict kept on the device, LoRA adapters merged in
(`learner.checkpoint_io.policy_state_dict`; every rank takes part, rank 0 writes). An adapter-only
update writes the adapter tensors alone the same way (`write_adapter`), gathered on the device:
no per-tensor host copy and no trip through Ray.
"""

from __future__ import annotations

import itertools
import mmap
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.safetensors_buffers import header_bytes
from learner.checkpoint_io import TORCH_TO_WIRE, policy_state_dict, select
from learner.worker_api import WeightsFileResult


@dataclass
class _Mapped:
    path: str
    inode: int
    header: bytes
    mm: mmap.mmap
    view: torch.Tensor  # uint8 over the whole file
    registered: bool

    def close(self) -> None:
        if self.registered:
            _cudart().cudaHostUnregister(self.view.data_ptr())
        del self.view
        self.mm.close()


def _cudart() -> Any:
    """The CUDA runtime bindings (typed as optional: None only where torch was built without CUDA,
    and nothing registers memory there)."""
    rt = torch.cuda.cudart()
    if rt is None:
        raise RuntimeError("torch has no CUDA runtime")
    return rt


def _layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[bytes, list[int], int]:
    """The file's header (length prefix included), each tensor's data offset, and the data size."""
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    head = header_bytes(
        [
            (n, TORCH_TO_WIRE[t.dtype], tuple(t.shape), size)
            for (n, t), size in zip(tensors, sizes, strict=True)
        ]
    )
    offsets = list(itertools.accumulate(sizes, initial=0))[:-1]
    return head, offsets, sum(sizes)


class WeightsFileWriter:
    """Per worker process: the mapped slot files (only rank 0 maps any)."""

    def __init__(self) -> None:
        self._slots: dict[int, _Mapped] = {}

    def write(
        self,
        lm: torch.nn.Module,
        names: Sequence[str],
        rank: int,
        dtypes: Mapping[str, str] | None,
        slot: int,
        path: str,
    ) -> WeightsFileResult | None:
        """Collective. Rank 0 writes every tensor in ``names`` (cast to ``dtypes[name]``) into
        ``path`` and returns timings; other ranks return None."""
        t0 = time.perf_counter()
        sd = policy_state_dict(lm, rank, cpu_offload=False)
        if sd is None:
            return None
        result = self._write(t0, select(sd, names, dtypes), slot, path)
        del sd
        return result

    def write_adapter(
        self, lm: torch.nn.Module, rank: int, dtype: torch.dtype, slot: int, path: str
    ) -> WeightsFileResult | None:
        """Collective. Rank 0 writes the LoRA adapter alone (`learner.lora.gather_adapter`'s
        names, cast to ``dtype`` on the device) into ``path``; other ranks return None."""
        # lazy: learner.lora imports peft (and with it transformers)
        from learner.lora import gather_adapter

        t0 = time.perf_counter()
        adapter = gather_adapter(lm, rank, to_cpu=False)
        if adapter is None:
            return None
        return self._write(t0, [(n, t.to(dtype)) for n, t in adapter.items()], slot, path)

    def _write(
        self, t0: float, named: list[tuple[str, torch.Tensor]], slot: int, path: str
    ) -> WeightsFileResult:
        """``named`` (gathered since ``t0``) into the slot file: one copy per tensor straight into
        the mapped (and, on CUDA, pinned) file, one synchronisation at the end."""
        tensors = [(n, t.contiguous()) for n, t in named]
        tensors.sort(key=lambda nt: (-nt[1].element_size(), nt[0]))
        cuda = tensors[0][1].is_cuda
        if cuda:
            torch.cuda.synchronize()
        gathered = time.perf_counter()
        header, offsets, total = _layout(tensors)
        m = self._mapping(slot, path, header, total, cuda)
        base = len(header)
        for (_, t), off in zip(tensors, offsets, strict=True):
            n = t.numel() * t.element_size()
            m.view[base + off : base + off + n].view(t.dtype).view(t.shape).copy_(
                t, non_blocking=m.registered
            )
        if cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        return WeightsFileResult(
            gather_s=gathered - t0, copy_s=end - gathered, bytes=total, pinned=m.registered
        )

    def _mapping(self, slot: int, path: str, header: bytes, total: int, cuda: bool) -> _Mapped:
        m = self._slots.get(slot)
        if m is not None:
            try:
                same = os.stat(path).st_ino == m.inode and m.header == header
            except FileNotFoundError:
                same = False
            if same:
                return m
            m.close()
            del self._slots[slot]
        size = len(header) + total
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
            inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        mm[: len(header)] = header
        view = torch.frombuffer(mm, dtype=torch.uint8)
        registered = False
        if cuda and os.environ.get("AGENTRL_WEIGHTS_PIN", "1") != "0":
            # Pinning lets the copies run at full speed; a refusal only costs speed.
            try:
                registered = int(_cudart().cudaHostRegister(view.data_ptr(), size, 0)) == 0
            except (RuntimeError, TypeError, ValueError):
                registered = False
        m = self._slots[slot] = _Mapped(path, inode, header, mm, view, registered)
        return m

    def close(self) -> None:
        for m in self._slots.values():
            m.close()
        self._slots.clear()
