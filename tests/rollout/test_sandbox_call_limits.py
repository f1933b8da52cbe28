"""Limits for a whole sandbox call, not per process: memory, processes and disk.

Real runs (real processes, cgroups and mounts). Per-call memory and process limits need a cgroup
hierarchy this process can write (root, or a delegated cgroup); the disk limit needs root (a tmpfs
in the run's mount namespace). Without them the tests skip and say why; the sandbox then warns that
per-call limits are not enforced.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable

import anyio
import psutil
import pytest
from scripted import fork_until_refused

from rollout_service.sandbox import SandboxLimits, SandboxResult, _live_pids_of_uid, run_python
from rollout_service.sandbox_cgroup import host_hierarchy

# serial: the memory bound is read as the machine's available memory, which another worker's vLLM moves
pytestmark = [pytest.mark.integration, pytest.mark.anyio, pytest.mark.serial]

MIB = 1024 * 1024
AS_ROOT = os.geteuid() == 0
needs_cgroup = pytest.mark.skipif(
    not AS_ROOT or host_hierarchy() is None,
    reason="per-call limits need root and a writable cgroup hierarchy with memory and pids",
)
needs_root = pytest.mark.skipif(not AS_ROOT, reason="the disk tmpfs needs a mount namespace (root)")


async def _sampled(
    code: str, limits: SandboxLimits, sample: Callable[[], float]
) -> tuple[SandboxResult, int]:
    """Run ``code``; return the result and the largest drop of ``sample()`` during the run."""
    before = int(sample())
    lowest = before
    result: list[SandboxResult] = []

    async def run() -> None:
        result.append(await run_python(code, limits=limits))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while not result:
            lowest = min(lowest, int(sample()))
            await anyio.sleep(0.005)
    return result[0], before - lowest


@needs_cgroup
async def test_memory_fork_bomb_is_bounded_by_the_call_limit() -> None:
    # 16 children touching 200 MB each: 3.2 GB under per-process limits alone (each is well under
    # memory_mb), at most call_memory_mb for the call.
    code = (
        "import os, time\n"
        "for _ in range(16):\n"
        "    if os.fork() == 0:\n"
        "        block = b'x' * (200 * 1024 * 1024)\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "while True:\n"
        "    os.wait()\n"
    )
    limits = SandboxLimits(timeout_s=15.0, call_memory_mb=256, memory_mb=512)
    start = time.monotonic()
    res, drop = await _sampled(code, limits, lambda: psutil.virtual_memory().available)
    print(
        f"available memory dropped by at most {drop / MIB:.0f} MiB in {time.monotonic() - start:.1f} s"
    )
    assert res.killed_reason == "memory", res
    assert "memory limit of 256 MiB (all its processes together)" in res.stderr
    assert res.cgroup is not None and not res.timed_out
    assert drop < (256 + 128) * MIB  # the limit plus a margin for the interpreters and noise


@needs_root
async def test_disk_fill_is_bounded_by_the_call_disk_limit() -> None:
    # Files of 8 MB, each under file_size_mb: without a per-call cap they would fill the host disk.
    code = (
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        with open(f'f{n}', 'wb') as f:\n"
        "            f.write(b'x' * (8 * 1024 * 1024))\n"
        "        n += 1\n"
        "finally:\n"
        "    print(n, flush=True)\n"
    )
    limits = SandboxLimits(timeout_s=15.0, disk_mb=32, file_size_mb=16)
    res, drop = await _sampled(code, limits, lambda: shutil.disk_usage(tempfile.gettempdir()).free)
    print(f"host temp dir's free space dropped by at most {drop / MIB:.1f} MiB; {res.stdout!r}")
    assert res.disk_limited, res.extras
    assert res.exit_code == 1 and "No space left on device" in res.stderr, res
    assert "disk limit of 32 MiB" in res.stderr
    assert 0 < int(res.stdout) * 8 <= 32  # the call wrote what fits, then got ENOSPC
    assert drop < 16 * MIB  # nothing of it on the host's disk (noise from other writers aside)


@needs_cgroup
async def test_process_bomb_stops_at_nproc_and_leaves_nothing() -> None:
    # main.py's end ends the run; the children live on until killed
    code = fork_until_refused(
        "os.closerange(0, 3)\ntime.sleep(60)\nos._exit(0)", "print(n, e, flush=True)"
    )
    limits = SandboxLimits(timeout_s=10.0, nproc=16)
    res = await run_python(code, limits=limits)
    assert res.ok, res  # main.py itself ends; its children are killed with the call
    count, error = res.stdout.split(" ", 1)
    assert 0 < int(count) < limits.nproc
    assert "Resource temporarily unavailable" in error
    assert res.uid is not None and _live_pids_of_uid(res.uid) == []
    hierarchy = host_hierarchy()
    assert hierarchy is not None and res.cgroup is not None
    for parent in hierarchy.parents():
        assert not (parent / res.cgroup).exists()
        assert not parent.exists() or res.cgroup not in os.listdir(parent)
