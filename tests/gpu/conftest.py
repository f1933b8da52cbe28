"""Fixtures of the GPU tests that run the learner's Ray workers: the packages they need (the GPU
image lacks Ray, verl, ... unless their wheels were carried there) and a local Ray cluster with the
one GPU, shut down at the end of the module."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
NEEDED = ("ray", "verl", "tensordict", "structlog", "transformers", "codetiming", "omegaconf")


@pytest.fixture(scope="module")
def learner_packages() -> None:
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the learner needs {missing}, not installed here")


@pytest.fixture(scope="module")
def ray_one_gpu(learner_packages: None) -> Iterator[Any]:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    # As learner.workers.init_ray does, plus the GPU: actors import the project from the checkout.
    ray.init(
        num_cpus=4,
        num_gpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()
