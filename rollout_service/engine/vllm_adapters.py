"""The LoRA adapters a `VllmEngine` serves beside its base weights (adapter-only weight updates).

Design: each policy version that arrives as an adapter (`protocol.adapters`) becomes a directory in
peft's format (the tensors, plus an ``adapter_config.json`` written here from the tensors' shapes
and the configured ``lora_alpha``), named to vLLM by a ``LoRARequest`` with its own id
(``version + 1``: vLLM wants ids above 0). New requests then sample with the newest adapter
(``current``); requests already running keep the adapter they started with, so every token of a
submission is labelled with that adapter's version, and generation never pauses for an update.

vLLM's worker loads an adapter it has not seen when a request first names it, between two engine
steps, and keeps the loaded ones in a least-recently-used cache (``max_cpu_loras``). So an update
only writes files: no call to the engine core is awaited, since on a busy engine such a call waits
for its turn between steps and its answer behind the outputs of every running request. The first
adapter of each shape is loaded with ``add_lora`` at its update, which checks it before any request
uses it; later versions have the same tensors' names, shapes and dtypes. An adapter's directory
is deleted at the next update once neither ``current`` nor a running request uses it (no request
names it again). vLLM is imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.adapters import ADAPTER_CONFIG, adapter_parts
from protocol.messages import TensorSpec
from protocol.weights import DTYPE_SIZES
from rollout_service.engine.base import WeightUpdateError

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    from protocol.weights import ModelManifest

SERVED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (its ``MaxLoRARanks``)."""
MAX_LORAS = 3
"""Adapters one vLLM batch may mix: the newest, and older ones that running requests still use."""


def served_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    for r in SERVED_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above the largest vLLM serves ({SERVED_RANKS[-1]})")


def engine_args(rank: int) -> dict[str, Any]:
    """vLLM's engine arguments for serving adapters up to ``rank`` (none with ``rank`` 0)."""
    if rank <= 0:
        return {}
    return {
        "enable_lora": True,
        "max_lora_rank": served_rank(rank),
        "max_loras": MAX_LORAS,
        "max_cpu_loras": MAX_LORAS + 2,  # past this, vLLM evicts its least recently used
    }


def adapter_config(
    names_and_shapes: Sequence[tuple[str, Sequence[int]]], alpha: int, base_model: str
) -> dict[str, Any]:
    """peft's ``adapter_config.json`` for the adapter tensors given (name, shape): the rank from
    the A matrices, the targeted modules by their last name."""
    rank, targets = 0, set()
    for name, shape in names_and_shapes:
        parts = adapter_parts(name)
        if parts is None:
            continue
        module, which = parts
        targets.add(module.rsplit(".", 1)[-1])
        if which == "A":
            rank = max(rank, int(shape[0]))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "bias": "none",
        "base_model_name_or_path": base_model,
    }


class AdapterSlots:
    def __init__(self, llm: AsyncLLM, alpha: int, base_model: str) -> None:
        self._llm, self._alpha, self._base = llm, alpha, base_model
        self.current: LoRARequest | None = None  # what new submissions sample with
        self._dirs: dict[int, Path] = {}  # vLLM's adapter id -> its directory
        self.last_timings: dict[str, float] = {}  # the last update's stage_s, add_s
        self._loaded: tuple[tuple[str, tuple[int, ...], str], ...] | None = None  # vLLM took these

    @staticmethod
    def nbytes(specs: Sequence[tuple[str, tuple[int, ...], str]]) -> int:
        return sum(math.prod(shape) * DTYPE_SIZES[dtype] for _, shape, dtype in specs)

    async def add(
        self,
        version: int,
        specs: Sequence[tuple[str, tuple[int, ...], str]],
        write: Callable[[Path], object],
        root: str | None,
        manifest: ModelManifest,
        in_use: Collection[int],
    ) -> LoRARequest:
        """Check the adapter of ``version`` (``specs``: name, shape, dtype of each tensor) against
        the served model and stage it (``write(dir)`` puts its tensors file there); vLLM loads it
        now if no adapter of these specs was loaded yet, else at its first request. ``current`` is
        not changed. The directories of adapters that neither ``current`` nor a running submission
        (``in_use``: their ids) uses are deleted. WeightUpdateError when the adapter does not fit
        or vLLM refuses it."""
        import asyncio

        from vllm.lora.request import LoRARequest

        announced = [TensorSpec(n, d, list(shape), 0, 0) for n, shape, d in specs]
        if problems := manifest.problems(announced):
            raise WeightUpdateError(
                f"refused the adapter of version {version}: "
                + "; ".join(p for _, p in problems[:5])
            )
        self._release(in_use)
        folder = Path(tempfile.mkdtemp(prefix="vllm-lora-", dir=root))
        request = LoRARequest(f"policy-v{version}", version + 1, str(folder))
        signature = tuple(sorted((n, tuple(shape), d) for n, shape, d in specs))
        try:
            start = time.perf_counter()
            await asyncio.to_thread(write, folder)
            config = adapter_config([(n, shape) for n, shape, _ in specs], self._alpha, self._base)
            (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
            staged = time.perf_counter()
            if signature != self._loaded:
                if not await self._llm.add_lora(request):
                    raise WeightUpdateError(f"vLLM did not take the adapter of version {version}")
                self._loaded = signature
            self.last_timings = {"stage_s": staged - start, "add_s": time.perf_counter() - staged}
        except WeightUpdateError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        except Exception as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise WeightUpdateError(
                f"vLLM could not load the adapter of version {version}: {type(e).__name__}: {e}"
            ) from e
        self._dirs[request.lora_int_id] = folder
        return request

    def _release(self, in_use: Collection[int]) -> None:
        """Delete the directories of every adapter but the current one and those in ``in_use``
        (ids of running submissions): no request will name them again. vLLM's copies go from its
        least-recently-used cache as newer ones come (``max_cpu_loras``)."""
        keep = {*in_use, self.current.lora_int_id if self.current else 0}
        for lora_id in [i for i in self._dirs if i not in keep]:
            shutil.rmtree(self._dirs.pop(lora_id), ignore_errors=True)

    @property
    def staged(self) -> set[int]:
        """vLLM ids of the adapters whose directories are kept (current, in use, and the newest)."""
        return set(self._dirs)

    def close(self) -> None:
        """Delete every staged adapter directory (the engine is gone)."""
        for folder in self._dirs.values():
            shutil.rmtree(folder, ignore_errors=True)
        self._dirs.clear()
