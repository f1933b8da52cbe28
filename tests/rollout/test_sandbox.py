"""Adversarial tests of the code sandbox: each test is code a misbehaving model could write."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import anyio
import pytest
from scripted import fork_until_refused

from rollout_service.sandbox import SandboxLimits, _live_pids_of_uid, run_python

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

AS_ROOT = os.geteuid() == 0
FAST = SandboxLimits(timeout_s=2.0, cpu_s=5)


async def test_runs_code_with_stdin_and_files() -> None:
    code = "import sys; print(sys.stdin.read().upper(), open('data/in.txt').read())"
    res = await run_python(code, limits=FAST, stdin="hello", files={"data/in.txt": "file"})
    assert res.ok, res
    assert res.stdout == "HELLO file\n"
    assert res.killed_reason is None and not res.timed_out


async def test_failing_code_reports_exit_code_and_traceback() -> None:
    res = await run_python("raise ValueError('boom')", limits=FAST)
    assert res.exit_code == 1 and not res.ok
    assert "ValueError: boom" in res.stderr
    assert res.killed_reason is None


async def test_file_names_may_not_escape_the_directory() -> None:
    with pytest.raises(ValueError, match="relative"):
        await run_python("pass", limits=FAST, files={"../x.txt": ""})


async def test_infinite_loop_is_killed_by_the_wall_clock() -> None:
    res = await run_python("while True: pass", limits=SandboxLimits(timeout_s=1.0, cpu_s=30))
    assert res.timed_out and res.killed_reason == "timeout"
    assert res.wall_s < 3.0
    assert res.exit_code is not None and res.exit_code < 0


async def test_sleeping_code_is_killed_by_the_wall_clock() -> None:
    # Burns no CPU, so only the wall clock can stop it.
    res = await run_python("import time; time.sleep(60)", limits=SandboxLimits(timeout_s=0.5))
    assert res.killed_reason == "timeout" and res.wall_s < 2.5


async def test_cpu_limit_kills_a_busy_loop() -> None:
    res = await run_python("while True: pass", limits=SandboxLimits(timeout_s=10.0, cpu_s=1))
    assert res.killed_reason == "cpu", res
    assert res.wall_s < 5.0


@pytest.mark.skipif(
    not AS_ROOT, reason="processes are only limited and tracked under a dropped uid"
)
async def test_fork_bomb_is_contained_and_every_process_killed() -> None:
    code = fork_until_refused(
        "while True:\n    time.sleep(1)", "pass", "print(n, flush=True)\ntime.sleep(60)"
    )
    limits = SandboxLimits(timeout_s=2.0, nproc=16)
    res = await run_python(code, limits=limits)
    assert res.killed_reason == "timeout"
    assert res.uid is not None
    assert 0 < int(res.stdout) < limits.nproc  # the uid's process count hit RLIMIT_NPROC
    assert _live_pids_of_uid(res.uid) == []


async def test_memory_hog_gets_memory_error_not_the_host() -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))\n"
    res = await run_python(code, limits=SandboxLimits(timeout_s=10.0, memory_mb=256))
    assert res.killed_reason == "memory", res
    assert "MemoryError" in res.stderr


async def test_huge_output_is_truncated_and_the_run_killed() -> None:
    limits = SandboxLimits(timeout_s=10.0, max_output_bytes=4096)
    res = await run_python("while True:\n    print('x' * 100)\n", limits=limits)
    assert res.killed_reason == "output_limit"
    assert res.stdout_truncated and len(res.stdout.encode()) == 4096
    assert res.wall_s < 5.0  # killed at the cap, not at the timeout


async def test_file_size_limit() -> None:
    code = "open('big', 'wb').write(b'x' * (3 * 1024 * 1024))"
    res = await run_python(code, limits=SandboxLimits(timeout_s=5.0, file_size_mb=1))
    # Python ignores SIGXFSZ, so the write fails with EFBIG instead of the process dying.
    assert res.exit_code != 0 and "File too large" in res.stderr


async def test_working_directory_is_private_and_removed() -> None:
    res = await run_python("import os; open('x', 'w').write('1'); print(os.getcwd())", limits=FAST)
    assert res.ok, res
    cwd = Path(res.stdout.strip())
    assert cwd.name == "work"
    assert not cwd.exists() and not cwd.parent.exists()


@pytest.mark.skipif(not AS_ROOT, reason="a dropped uid is what makes system files unwritable")
async def test_cannot_write_system_files_and_shared_tmp_is_cleaned() -> None:
    stray = Path("/tmp") / f"sandbox-escape-{uuid.uuid4().hex}"
    code = (
        "import os\n"
        "for path in ['/etc/sandbox-test', '/root/sandbox-test', '/work/sandbox-test']:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except PermissionError:\n"
        "        print('denied', path)\n"
        f"open({str(stray)!r}, 'w').write('x')\n"
        "print(os.getuid())\n"
    )
    res = await run_python(code, limits=FAST)
    assert res.ok, res
    assert "WROTE" not in res.stdout
    assert res.stdout.count("denied") == 3
    assert int(res.stdout.split()[-1]) == res.uid != 0
    assert not stray.exists()  # world-writable dirs are swept of what the run's uid created
    for path in ("/etc/sandbox-test", "/root/sandbox-test", "/work/sandbox-test"):
        assert not Path(path).exists()


async def test_network_is_isolated() -> None:
    code = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=2).close()\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
    )
    res = await run_python(code, limits=FAST)
    if AS_ROOT:
        assert res.network_isolated  # root can always unshare the network namespace here
    if not res.network_isolated:
        pytest.skip("no network namespace on this machine")
    assert res.stdout.startswith("refused"), res


async def test_isolation_can_be_turned_off() -> None:
    res = await run_python("pass", limits=SandboxLimits(isolate_network=False))
    assert res.ok and not res.network_isolated


async def test_cancelled_run_leaves_nothing_behind() -> None:
    token = uuid.uuid4().hex
    code = f"import time  # {token}\ntime.sleep(60)\n"
    with anyio.move_on_after(1.0) as scope:
        await run_python(code, limits=SandboxLimits(timeout_s=30.0))
    assert scope.cancelled_caught
    # The run's directory (holding main.py with the token) is gone; its cleanup, which kills the
    # run's processes first, ran although the caller was cancelled.
    assert [p for p in Path("/tmp").glob("sandbox-*/work/main.py") if token in p.read_text()] == []


async def test_concurrent_runs_get_distinct_uids() -> None:
    results = []

    async def one() -> None:
        results.append(await run_python("import os; print(os.getuid())", limits=FAST))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
    assert all(r.ok for r in results)
    if AS_ROOT:
        assert len({r.uid for r in results}) == 3


async def test_no_run_leaves_a_directory_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    # A temp dir of this test's own (traversable by the dropped uid, like /tmp) isolates it from
    # sandbox runs of other processes.
    base = Path(tempfile.mkdtemp(prefix="sandbox-test-", dir="/tmp"))
    base.chmod(0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    try:
        assert (await run_python("print(1)", limits=FAST)).ok
        with pytest.raises(ValueError):
            await run_python("pass", limits=FAST, files={"/etc/x": ""})
        res = await run_python("import os; os.mkdir('d'); open('d/f', 'w').write('x')", limits=FAST)
        assert res.ok, res
        assert list(base.iterdir()) == []
    finally:
        shutil.rmtree(base)
