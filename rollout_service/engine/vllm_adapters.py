"""The LoRA adapters a `VllmEngine` serves beside its base weights (adapter-only weight updates).

Design: each policy version that arrives as an adapter (`protocol.adapters`) becomes a directory in
peft's format (the tensors, plus an ``adapter_config.json`` written here from the tensors' shapes
and the configured ``lora_alpha``), registered with vLLM under its own id (``version + 1``: vLLM
wants ids above 0) with ``add_lora``, which loads and checks it before any request uses it. New
requests then sample with the newest adapter (``current``); requests already running keep the
adapter they started with, so every token of a submission is labelled with that adapter's version,
and generation never pauses for an update. An adapter that no running request uses any more is
removed from vLLM and its directory deleted at the next update (`release`); `close` deletes what is
left. vLLM is imported inside functions: importing this module is cheap.
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
        "max_cpu_loras": MAX_LORAS + 1,
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
        self.last_timings: dict[str, float] = {}  # the last update's stage_s, add_s, release_s

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
    ) -> LoRARequest:
        """Check the adapter of ``version`` (``specs``: name, shape, dtype of each tensor) against
        the served model, stage it (``write(dir)`` puts its tensors file there) and have vLLM load
        it; ``current`` is not changed. WeightUpdateError when it does not fit or vLLM refuses it."""
        import asyncio

        from vllm.lora.request import LoRARequest

        announced = [TensorSpec(n, d, list(shape), 0, 0) for n, shape, d in specs]
        if problems := manifest.problems(announced):
            raise WeightUpdateError(
                f"refused the adapter of version {version}: "
                + "; ".join(p for _, p in problems[:5])
            )
        folder = Path(tempfile.mkdtemp(prefix="vllm-lora-", dir=root))
        request = LoRARequest(f"policy-v{version}", version + 1, str(folder))
        try:
            start = time.perf_counter()
            await asyncio.to_thread(write, folder)
            config = adapter_config([(n, shape) for n, shape, _ in specs], self._alpha, self._base)
            (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
            staged = time.perf_counter()
            if not await self._llm.add_lora(request):
                raise WeightUpdateError(f"vLLM did not take the adapter of version {version}")
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

    async def release(self, in_use: Collection[int]) -> None:
        """Remove every adapter but the current one and those in ``in_use`` (ids of running
        submissions) from vLLM, and delete their directories."""
        start = time.perf_counter()
        keep = {*in_use, self.current.lora_int_id if self.current else 0}
        for lora_id in [i for i in self._dirs if i not in keep]:
            await self._llm.remove_lora(lora_id)
            shutil.rmtree(self._dirs.pop(lora_id), ignore_errors=True)
        self.last_timings["release_s"] = time.perf_counter() - start

    def close(self) -> None:
        """Delete every staged adapter directory (the engine is gone)."""
        for folder in self._dirs.values():
            shutil.rmtree(folder, ignore_errors=True)
        self._dirs.clear()
