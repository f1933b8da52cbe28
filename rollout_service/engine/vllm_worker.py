"""What runs inside vLLM's worker processes: a weight reload that also refreshes a tied output layer.

Design: `VllmEngine` names `ReloadExtension` as vLLM's ``worker_extension_cls``, so its methods are
mixed into every worker and reached by name through ``collective_rpc`` (no callable is pickled).
``reload_weights`` in place loads each layer whose weights the checkpoint names, re-runs that
layer's post-load processing and copies the result into the tensors the engine already uses. A
model with tied embeddings (``tie_word_embeddings``: Qwen2/2.5 0.5B, the tiny model) names no
``lm_head.weight``, so its output layer loads nothing: it shares the embedding's tensor, which the
reload did update, but its post-load processing is not re-run. On vLLM's CPU platform that
processing packs the weight for the GEMM kernel (``dispatch_cpu_unquantized_gemm``), so the
output layer would go on computing logits with the first weights' packed copy while the rest of
the model moved on. `refresh_tied_heads` re-runs it for every output layer that shares its weight
with an embedding. On the GPU that processing does nothing for an unquantized output layer, so the
refresh costs nothing there.

Prefetch: `stage_weights` starts a thread that copies a weights directory's tensors onto the
worker's device (on CUDA through a side stream) and returns at once, so the engine core goes on
stepping meanwhile; `reload_weights_tied` of that directory then loads from those device tensors,
and generation pauses only for device-to-device copies instead of reading the file and copying it
host to device. A thread, not an RPC that does the work: the engine core runs RPCs between its
steps, so one that copied a model would stall generation as long as the pause it saves. Staging
needs free device memory for one copy of the weights beyond what vLLM reserved; without it, or
when the thread failed, the reload reads the file as before.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.safetensors_buffers import load_dir

if TYPE_CHECKING:
    import torch
    from torch import nn

EXTENSION = f"{__name__}.ReloadExtension"
"""The qualified name vLLM's ``worker_extension_cls`` takes."""


def refresh_tied_heads(model: nn.Module) -> list[str]:
    """Re-run the post-load processing of each output layer tied to an embedding; their names."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    modules = dict(model.named_modules())
    embeddings = {
        _storage(m)
        for m in modules.values()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    }
    refreshed = []
    for name, m in modules.items():
        if isinstance(m, ParallelLMHead) and _storage(m) in embeddings:
            m.quant_method.process_weights_after_loading(m)
            refreshed.append(name)
    return refreshed


def _storage(module: nn.Module) -> int:
    weight: Any = module.weight  # a Parameter (typed as Tensor | Module by torch's stubs)
    return weight.data_ptr()


STAGE, STAGED, RELOAD = "stage_weights", "staged_weights_ready", "reload_weights_tied"
"""`ReloadExtension`'s methods, by the names ``collective_rpc`` takes."""

STAGING_HEADROOM_BYTES = 1 << 30
"""Device memory left free beyond a staged copy (the engine's own allocations go on meanwhile)."""


class Staging:
    """One weights directory's tensors, copied onto ``device`` by a thread of its own."""

    def __init__(self, path: str, device: torch.device) -> None:
        self.path = path
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.error = ""
        self.done = threading.Event()
        threading.Thread(
            target=self._copy, args=(device,), name="stage-weights", daemon=True
        ).start()

    def _copy(self, device: torch.device) -> None:
        import torch

        try:
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for buf in load_dir(self.path, writable=True):
                    self.tensors.append(
                        (buf.name, _on_device(buf.data, buf.dtype, buf.shape, device))
                    )
            if stream is not None:
                stream.synchronize()  # the reload's copies run on the engine's own stream
        except Exception as e:  # reported by staged_weights_ready; the reload reads the file
            self.error = f"{type(e).__name__}: {e}"
            self.tensors = []
        finally:
            self.done.set()


def _on_device(
    data: memoryview, dtype: str, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """A copy on ``device`` of one tensor's raw bytes (a view of the mapped file)."""
    import torch

    kind = getattr(torch, dtype)
    if data.nbytes == 0:
        return torch.empty(shape, dtype=kind, device=device)
    view = torch.frombuffer(data, dtype=kind).view(shape)  # a private mapping: writable
    return view.to(device, copy=True)  # torch lets the GIL go while it copies


def _plain_cuda(worker: Any, tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether staged ``tensors`` are on CUDA for a model without quantization."""
    config = getattr(worker.model_runner, "model_config", None)
    quantized = getattr(config, "quantization", None) is not None
    return bool(tensors) and tensors[0][1].is_cuda and not quantized


def staged_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


class ReloadExtension:
    """Mixed into vLLM's worker class (``self`` is a worker: ``reload_weights``, ``model_runner``)."""

    def stage_weights(self, weights_path: str) -> str:
        """Starts copying ``weights_path``'s tensors onto this worker's device (see the module
        docstring); "started", or why not (then the reload reads the file)."""
        import torch

        worker: Any = self
        worker._staging = None  # one at a time: an earlier one is dropped
        device = next(worker.model_runner.get_model().parameters()).device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            # blocks torch's allocator keeps for reuse (an earlier staging's among them) count too
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            need = staged_bytes(weights_path) + STAGING_HEADROOM_BYTES
            if free < need:
                return f"skipped: {free >> 20} MiB free on {device}, {need >> 20} MiB needed"
        worker._staging = Staging(weights_path, device)
        return "started"

    def staged_weights_ready(self, weights_path: str) -> str:
        """ "" while the copy of ``weights_path`` runs; "ok" when done; else why it failed."""
        staging: Staging | None = getattr(self, "_staging", None)
        if staging is None or staging.path != weights_path:
            return "not staged"
        if not staging.done.is_set():
            return ""
        return staging.error or "ok"

    def reload_weights_tied(self, weights_path: str, direct: bool = False) -> dict[str, Any]:
        """``reload_weights`` from ``weights_path`` (from its staged copy when `stage_weights`
        finished it without error), then `refresh_tied_heads`: ``{"staged": whether the staged
        copy was used, "heads": the heads refreshed}``. ``direct``: a staged copy on CUDA of an
        unquantized model goes through the model's ``load_weights`` alone (each weight loader
        copies into the tensor the engine uses), not through vLLM's layer-by-layer reload."""
        import torch

        worker: Any = self
        staging: Staging | None = getattr(worker, "_staging", None)
        worker._staging = None
        staged = (
            staging is not None
            and staging.path == weights_path
            and staging.done.is_set()
            and not staging.error
        )
        model = worker.model_runner.get_model()
        if staging is None or not staged:
            worker.reload_weights(weights_path=weights_path)
        else:
            tensors = staging.tensors
            if direct and _plain_cuda(worker, tensors):
                model.load_weights(iter(tensors))
            else:
                worker.reload_weights(weights_iterator=iter(tensors))
            if tensors and tensors[0][1].is_cuda:
                # the staged blocks go back to the side stream's pool: the copies finish first
                torch.cuda.current_stream().synchronize()
        return {"staged": staged, "heads": refresh_tied_heads(model)}
