"""The weight prefetch inside a vLLM worker (`rollout_service.engine.vllm_worker`), on the CPU.

`ReloadExtension` is mixed into a worker here that records what vLLM's ``reload_weights`` was
given, so each way through it is seen: a finished staging is loaded from its tensors (bit for bit
the file's, bf16 included), a staging of another file or one that failed leaves the reload to read
the file, and a reload consumes the staging. The real engine's path (a vLLM worker loading a
prefetched update, its logprobs checked against the new weights) is in ``test_vllm_engine.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from rollout_service.engine.vllm_worker import ReloadExtension

# refresh_tied_heads imports vLLM, whose import starts a child process of its own
pytestmark = pytest.mark.integration


class _Runner:
    def __init__(self) -> None:
        self.model = nn.Linear(4, 3)

    def get_model(self) -> nn.Module:
        return self.model


class _Worker(ReloadExtension):
    """What the extension needs of a vLLM worker: its model runner and ``reload_weights``."""

    def __init__(self) -> None:
        self.model_runner = _Runner()
        self.calls: list[dict[str, Any]] = []

    def reload_weights(self, **kwargs: Any) -> None:
        if "weights_iterator" in kwargs:
            kwargs["weights_iterator"] = dict(kwargs["weights_iterator"])
        self.calls.append(kwargs)


def _weights(folder: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "a.weight": torch.randn(3, 4, generator=g),
        "b.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 2),
    }
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def _ready(worker: _Worker, path: str) -> str:
    deadline = time.monotonic() + 30
    while not (state := worker.staged_weights_ready(path)):
        assert time.monotonic() < deadline, "the staging thread did not finish"
        time.sleep(0.01)
    return state


def test_a_finished_staging_is_what_the_reload_loads(tmp_path: Path) -> None:
    tensors = _weights(tmp_path / "v1", seed=1)
    worker, path = _Worker(), str(tmp_path / "v1")
    assert worker.staged_weights_ready(path) == "not staged"
    assert worker.stage_weights(path) == "started"
    assert _ready(worker, path) == "ok"
    assert worker.reload_weights_tied(path) == {"staged": True, "heads": []}
    (call,) = worker.calls
    loaded = call["weights_iterator"]
    assert loaded.keys() == tensors.keys()
    for name, want in tensors.items():
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want)
    # the staging was used up: the next reload of the same folder reads the file
    assert worker.reload_weights_tied(path) == {"staged": False, "heads": []}
    assert worker.calls[-1] == {"weights_path": path}


def test_a_staging_of_another_folder_leaves_the_reload_to_the_file(tmp_path: Path) -> None:
    _weights(tmp_path / "v1", seed=1)
    _weights(tmp_path / "v2", seed=2)
    worker = _Worker()
    worker.stage_weights(str(tmp_path / "v1"))
    _ready(worker, str(tmp_path / "v1"))
    assert worker.staged_weights_ready(str(tmp_path / "v2")) == "not staged"
    assert worker.reload_weights_tied(str(tmp_path / "v2"))["staged"] is False
    assert worker.calls == [{"weights_path": str(tmp_path / "v2")}]


def test_a_failed_staging_says_why_and_the_reload_reads_the_file(tmp_path: Path) -> None:
    _weights(tmp_path / "v1", seed=1)
    file = tmp_path / "v1" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-40])  # the last tensor's bytes are cut off
    worker, path = _Worker(), str(tmp_path / "v1")
    assert worker.stage_weights(path) == "started"
    state = _ready(worker, path)
    assert state not in ("", "ok"), state
    assert worker.reload_weights_tied(path)["staged"] is False
    assert worker.calls == [{"weights_path": path}]
