"""Suite-wide fixtures and hooks.

Tiers (tests/README.md): every test is ``unit``, ``integration``, ``e2e`` or ``nightly``, by marker
on the test or its module; a test marked with none is unit, and a ``gpu`` test is nightly. A unit
test may start no child process (so no Ray and no vLLM engine): ``_Guard`` refuses one while it
runs and fails the test. ``TIER_GUARD_REPORT=<file>`` writes the refusals as JSON at the end, to
find the tests to mark (an import of vLLM by a unit test is reported there, not refused).

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
import json
import multiprocessing.process
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TIERS = ("unit", "integration", "e2e", "nightly")


class UnitTierViolation(RuntimeError):
    """A unit-tier test started a child process or imported vLLM."""


class _Guard:
    """Refuses process creation while a unit-tier test runs (setup, call and teardown).

    The hooks wrap the primitives every child goes through: ``subprocess.Popen`` (asyncio's
    subprocesses and ``ray.init`` too), ``os.fork``/``posix_spawn`` and ``multiprocessing`` (vLLM's
    engine core, FSDP workers). Each refusal is also recorded on the test, so a test whose code
    swallows the exception still fails at teardown.
    """

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.seen: list[str] = []
        self.report: dict[str, list[str]] = {}

    def refuse(self, what: str) -> None:
        if self.item is None:
            return
        self.seen.append(what)
        self.report.setdefault(self.item.nodeid, []).append(what)
        raise UnitTierViolation(
            f"a unit-tier test started {what}: unit tests start no child process, Ray or vLLM; "
            "mark the test (or its module) integration or e2e (tests/README.md)"
        )

    def wrap(self, owner: Any, name: str, what: str) -> None:
        original: Callable[..., Any] | None = getattr(owner, name, None)
        if original is None:
            return
        guard = self

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            guard.refuse(what)
            return original(*args, **kwargs)

        setattr(owner, name, guarded)


_guard = _Guard()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # pytest-xdist's workers start with SIGINT ignored, and an ignored signal stays ignored
        # across exec: every child would then shrug off the Ctrl-C the signal tests send it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _guard.wrap(subprocess.Popen, "_execute_child", "a subprocess")
    _guard.wrap(multiprocessing.process.BaseProcess, "start", "a multiprocessing process")
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        _guard.wrap(os, name, f"a child process (os.{name})")


def _tier(item: pytest.Item) -> str:
    found = [t for t in TIERS if item.get_closest_marker(t) is not None]
    return found[-1] if found else "unit"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    unit = _tier(item) == "unit"
    had_vllm = "vllm" in sys.modules
    _guard.item, _guard.seen = (item if unit else None), []
    try:
        return (yield)
    finally:
        _guard.item = None
        if unit and not had_vllm and "vllm" in sys.modules:
            _guard.report.setdefault(item.nodeid, []).append("a vLLM import")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    if _guard.item is item and _guard.seen:
        raise UnitTierViolation(f"this unit-tier test started {', '.join(_guard.seen)}")
    return result


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("TIER_GUARD_REPORT")
    if path:
        Path(path).write_text(json.dumps(_guard.report, indent=1))


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


def pytest_itemcollected(item: pytest.Item) -> None:
    if getattr(getattr(item, "module", None), "OWN_RAY_CLUSTER", False):
        item.add_marker(pytest.mark.serial)


def _check_ray_groups(items: list[pytest.Item]) -> None:
    """A test that uses ``ray_cluster`` lives in a file that says ``OWN_RAY_CLUSTER = True``: such
    files are marked ``serial``, and `bin/test` runs them in one process after the others (two
    Ray clusters held at once by two xdist workers, the session's ``ray_cluster`` of one and a
    ``ray start`` head of the other, killed a worker in two runs of four)."""
    for item in items:
        module = getattr(item, "module", None)
        if "ray_cluster" in getattr(item, "fixturenames", ()) and not getattr(
            module, "OWN_RAY_CLUSTER", False
        ):
            raise pytest.UsageError(
                f"{item.nodeid} uses ray_cluster: set OWN_RAY_CLUSTER = True in its module "
                "(tests/conftest.py: it runs in the serial pass)"
            )


@pytest.fixture
def own_ray_cluster() -> Iterator[None]:
    """For a test that runs a Ray cluster of its own: this process may have joined the session's
    (tests/learner's ``ray_cluster``); it is left for the test and joined again after it, so the
    tests after this one still find it."""
    import ray

    joined = ray.is_initialized()
    if joined:
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()
    if joined:
        from learner.workers import init_ray

        init_ray(None, 2, log_to_driver=False)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every test has one tier: a test marked with none is a unit test, and a GPU test is nightly.
    # Before the -m selection (tryfirst), so that `-m unit` and `-m "not nightly"` see them.
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} has tiers {tiers}: mark each test with one")
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.nightly)
        elif not tiers:
            item.add_marker(pytest.mark.unit)
    _check_ray_groups(items)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _no_cuda_reason()
    if reason is not None:
        skip = pytest.mark.skip(reason=reason)
        for item in gpu_items:
            item.add_marker(skip)
