"""Fixtures of the rollout-service tests: the tiny model's tokenizer and chat renderer (made once
per session; the model itself comes from tests/conftest.py). Also makes ``scripted`` (scripted engine and tools for unit tests) importable under
any pytest import mode."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="session")
def renderer(tokenizer: Any) -> Any:
    """The tiny model's chat template as the agents render it."""
    from rollout_service.agents.rendering import ChatRenderer

    return ChatRenderer(tokenizer)


@pytest.fixture
def echo_tool() -> Any:
    from scripted import EchoTool

    from rollout_service.tools.base import TOOLS

    if "echo" not in TOOLS:
        TOOLS.register("echo")(lambda **_: EchoTool(text="42"))
    return TOOLS.get("echo")
