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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


class ReloadExtension:
    """Mixed into vLLM's worker class (``self`` is a worker: ``reload_weights``, ``model_runner``)."""

    def reload_weights_tied(self, weights_path: str) -> list[str]:
        """``reload_weights`` from ``weights_path``, then `refresh_tied_heads`; the heads refreshed."""
        worker: Any = self
        worker.reload_weights(weights_path=weights_path)
        return refresh_tied_heads(worker.model_runner.get_model())
