"""On the GPU machine: official vLLM 0.24 on CUDA is what the compatibility layer detects (no
weight-version spans there, so the engine runs "keep" updates as abort + resubmission) and
``dtype: auto`` means bfloat16."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_the_installed_cuda_build_is_detected() -> None:
    from rollout_service.engine.vllm_compat import SUPPORTED, resolve_dtype, vllm_info

    info = vllm_info()
    assert info.platform == "cuda"
    assert info.version.startswith(SUPPORTED["cuda"]) and info.supported, info
    assert not info.weight_version_spans
    assert resolve_dtype("auto") == "bfloat16"
