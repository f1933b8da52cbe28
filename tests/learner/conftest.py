"""Makes ``process_testkit`` (starting, stopping and reading real learner processes) importable
from these tests under any pytest import mode; ``ray_cluster``: one local Ray cluster for every
in-process FSDP test of this package run by one pytest process (worker)."""

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster of 2 CPUs, started once per pytest process for the package's in-process
    FSDP tests (each start takes seconds on 2 cores) and shut down at its end. Session-scoped in
    name as in fact: without an ``__init__.py`` this directory is no package, and a "package"
    fixture lived for the session anyway. A test that joins a cluster of its own
    (`tests/launcher/test_ray_placement.py`) leaves this one and joins it again. Worker actors
    still come and go with each test's ``WorkerGroup``; learner processes the tests start make
    their own cluster (``init_ray`` uses address "local")."""
    import ray

    from learner.workers import init_ray

    init_ray(None, 2, log_to_driver=False)
    yield ray
    ray.shutdown()
