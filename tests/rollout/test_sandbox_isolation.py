"""The sandbox's filesystem view: shared writable directories stay clean, host files stay hidden.

Real runs of the sandbox (real processes, real mounts). As root the sandbox must give every run a
private mount namespace (tmpfs over /tmp, /var/tmp, /dev/shm, /run/lock; empty tmpfs over the
checkout and home directories) and a private IPC namespace; without root there is none, which these
tests check as the fallback (a warning, ``fs_isolated`` false) rather than pretend otherwise.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from rollout_service import sandbox
from rollout_service.sandbox import SandboxLimits, run_python

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

AS_ROOT = os.geteuid() == 0
CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout these tests run from
FAST = SandboxLimits(timeout_s=10.0)
SHARED = ("/run/lock", "/dev/shm", "/tmp", "/var/tmp")
needs_root = pytest.mark.skipif(not AS_ROOT, reason="a private mount namespace needs root here")


@needs_root
async def test_checkout_and_home_are_unreadable() -> None:
    targets = [
        CHECKOUT / "README.md",
        CHECKOUT / "pyproject.toml",
        Path(__file__),
        Path.home() / ".bashrc",
    ]
    code = (
        "import os, sys\n"
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        open(path).read(1)\n"
        "        print('LEAKED', path)\n"
        "    except OSError as e:\n"
        "        print('hidden', path, e.errno)\n"
        # a checkout under a covered temp dir (/tmp/clone) is not there at all: nothing to list
        "def ls(p):\n"
        "    return sorted(os.listdir(p)) if os.path.isdir(p) else []\n"
        f"print('LIST', ls({str(CHECKOUT)!r}), ls({str(Path.home())!r}))\n"
        "print(open('/etc/hostname').read(1) != '')\n"  # system files stay readable
    )
    res = await run_python(code, limits=FAST)
    assert res.ok, res
    assert res.fs_isolated, res.extras
    assert "LEAKED" not in res.stdout, res.stdout
    assert res.stdout.count("hidden") == len(targets)
    # The checkout and the home directory are empty directories to the code (an empty tmpfs), or
    # absent where they lie under a covered shared directory.
    assert "LIST [] []" in res.stdout
    assert CHECKOUT.joinpath("README.md").exists()  # hidden from the run only


@needs_root
async def test_nothing_is_left_in_shared_directories() -> None:
    token = f"sandbox-leak-{uuid.uuid4().hex}"
    code = (
        "import ctypes, os, subprocess, sys\n"
        f"for d in {SHARED!r}:\n"
        f"    open(os.path.join(d, {token!r}), 'w').write('x')\n"
        f"    os.mkdir(os.path.join(d, {token!r} + '-dir'))\n"
        # A background process that outlives main.py and keeps writing.
        "subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True:\\n"
        f'    open("/run/lock/{token}-bg", "w").write("x"); time.sleep(0.01)\'],\n'
        "                 start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        # A System V shared memory segment outlives its creator unless the IPC namespace goes.
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('shm', libc.shmget(0x5A4DB0C5, 4096, 0o1666))\n"
        "import time; time.sleep(0.2)\n"
        f"print(sorted(n for d in {SHARED!r} for n in os.listdir(d) if n.startswith({token!r})))\n"
    )
    res = await run_python(code, limits=FAST)
    assert res.ok, res
    assert res.fs_isolated, res.extras
    assert res.stdout.count(token) >= 2 * len(SHARED)  # the code did write there, in its own view
    for d in SHARED:
        assert [n for n in os.listdir(d) if n.startswith(token)] == [], d
    shm_keys = [line.split()[0] for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    assert str(0x5A4DB0C5) not in shm_keys


@needs_root
async def test_code_still_has_a_writable_home_and_temp_dir() -> None:
    code = (
        "import os, tempfile\n"
        "with tempfile.NamedTemporaryFile('w', delete=False) as f: f.write('t')\n"
        "open('/tmp/own', 'w').write('x')\n"
        "open(os.path.expanduser('~/notes'), 'w').write('n')\n"
        "print(open(f.name).read(), open('/tmp/own').read(), open('notes').read(), os.getcwd())\n"
    )
    res = await run_python(code, limits=FAST)
    assert res.ok, res
    words = res.stdout.split()
    assert words[:3] == ["t", "x", "n"]
    assert not Path(words[3]).exists()  # the working directory is removed afterwards


@needs_root
async def test_fallback_without_a_private_view_warns_and_still_sweeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A directory to hide that cannot be mounted on (it does not exist under the new /tmp) makes
    # the filesystem isolation fail part-way: the run goes on under its dropped uid, as it would on
    # a machine that refuses tmpfs mounts, and says so.
    monkeypatch.setattr(
        sandbox, "_hidden_dirs", lambda covered: [f"/tmp/absent-{uuid.uuid4().hex}"]
    )
    monkeypatch.setattr(sandbox, "_warned_unisolated", False)
    stray = Path("/run/lock") / f"sandbox-fallback-{uuid.uuid4().hex}"
    with capture_logs() as logs:
        res = await run_python(f"open({str(stray)!r}, 'w').write('x')", limits=FAST)
    assert res.ok, res
    assert not res.fs_isolated and res.uid is not None
    assert "filesystem isolation failed" in res.extras.get("notes", "")
    assert [e["log_level"] for e in logs if "no private filesystem view" in e["event"]] == [
        "warning"
    ]
    assert not stray.exists()  # swept by uid instead


@pytest.mark.skipif(AS_ROOT, reason="checks the fallback of a sandbox without root")
async def test_without_root_the_result_says_files_are_not_isolated() -> None:
    res = await run_python("print(1)", limits=FAST)
    assert res.ok and not res.fs_isolated
