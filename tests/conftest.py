"""Suite-wide fixtures and hooks.

``anyio_backend``: tests marked ``@pytest.mark.anyio`` run once under asyncio and once under trio;
a module that needs one backend (ZeroMQ tests use ``zmq.asyncio``) overrides the fixture.

``@pytest.mark.gpu`` tests are skipped, with the reason, where ``torch.cuda.is_available()`` is
false (CI, this CPU machine). The check goes through NVML (``PYTORCH_NVML_BASED_CUDA_CHECK``), so
the pytest process never initialises CUDA itself and vLLM can still fork its engine core; it runs
only when gpu tests were collected.

``tiny_model``: the tiny Qwen2 model and tokenizer (``tools.make_tiny_model``), made once per
session in a temporary directory; tests that change it work on a copy.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@functools.cache
def _no_cuda_reason() -> str | None:
    """None when a CUDA device is usable, else why not."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
    except Exception as e:
        return f"needs an NVIDIA GPU (torch does not import: {type(e).__name__})"
    try:
        available = torch.cuda.is_available()
    except Exception as e:
        return f"needs an NVIDIA GPU (CUDA check failed: {type(e).__name__}: {e})"
    if not available:
        return "needs an NVIDIA GPU: torch.cuda.is_available() is False"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _no_cuda_reason()
    if reason is not None:
        skip = pytest.mark.skip(reason=reason)
        for item in gpu_items:
            item.add_marker(skip)
