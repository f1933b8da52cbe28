"""Run untrusted Python (model-written code, code-reward tests) in a contained child process.

Design: the parent (async, anyio only, never blocking the event loop) makes a private directory,
writes the code there and starts a small trusted *bootstrap* interpreter in a new session. The
bootstrap, still privileged, isolates the run and then ``execve``s ``python -I -S main.py``:

- network: ``unshare(CLONE_NEWNET)`` (root) or ``CLONE_NEWUSER|CLONE_NEWNET`` (unprivileged user
  namespaces); the result reports whether it took effect.
- identity: when the server runs as root, the code runs under a uid/gid of its own, drawn at
  random from a range no account uses. Root ignores RLIMIT_NPROC and can write anywhere; a fresh
  uid makes the process limit per run (not shared between concurrent runs) and lets the parent find
  and kill every process the run made, even ones that left the process group with ``setsid``.
  The interpreter may live under a 0700 home (pyenv in /root), so a private mount namespace
  bind-mounts its install prefix read-only into the run's directory first.
- resources: ``setrlimit`` for CPU seconds, address space, file size, processes, open files, core.
- wall clock: past the timeout the process group (and every process of the run's uid) is killed.
- output: stdout/stderr are read incrementally; past the byte cap the run is killed, so an output
  flood costs at most the cap in memory.

Afterwards the directory, and anything the run's uid left in world-writable temp dirs, is removed.
Without root (and without user namespaces) only rlimits, the process group and the timeout remain.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread

__all__ = ["SandboxLimits", "SandboxResult", "run_python"]

# A range of uids that no account uses; a run draws one at random so that concurrent runs in this
# process (tracked in _UIDS_IN_USE) and, very likely, in other processes never share one.
UID_BASE = 1_500_000_000
UID_SPAN = 1_000_000
_UIDS_IN_USE: set[int] = set()

# World-writable places a dropped uid can still write to; what the run's uid leaves there is removed.
_SHARED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock; the whole run is killed past it
    memory_mb: int = 512  # address space (RLIMIT_AS) of each process
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL one second later
    file_size_mb: int = 16  # largest file a process may write (RLIMIT_FSIZE)
    nproc: int = 64  # processes of the run's uid (RLIMIT_NPROC; only enforced for a dropped uid)
    open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 64 * 1024  # per stream; past it the run is killed
    isolate_network: bool = True


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal (subprocess convention)
    timed_out: bool
    killed_reason: str | None  # timeout, output_limit, memory, cpu, file_size, signal:NAME, sandbox_error
    wall_s: float
    network_isolated: bool
    uid: int | None = None  # the uid the code ran as, when it was dropped from root
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    extras: dict[str, str] = field(default_factory=dict)  # diagnostics (bootstrap notes)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


# Runs as the sandbox's first process, still privileged; must only use the stdlib. Its config
# comes as one JSON argument. It writes a status file (into a directory the code cannot write),
# then execs the user's interpreter, so nothing of it stays in the run.
_BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x20000, 0x10000000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
status = {"network_isolated": False, "uid_dropped": False, "notes": []}
exe, uid = cfg["exe"], cfg["uid"]
if uid is not None:
    target = cfg["mount_at"].encode()
    if libc.unshare(CLONE_NEWNS) != 0:
        status["notes"].append("unshare(CLONE_NEWNS) failed: errno %d" % ctypes.get_errno())
        uid = None
    elif (libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0
          or libc.mount(cfg["prefix"].encode(), target, None, MS_BIND | MS_REC, None) != 0):
        status["notes"].append("bind mount of the interpreter failed: errno %d" % ctypes.get_errno())
        uid = None
    else:
        libc.mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, None)
        exe = cfg["mount_at"] + "/" + cfg["exe_rel"]
if cfg["isolate_net"]:
    if libc.unshare(CLONE_NEWNET) == 0:
        status["network_isolated"] = True
    elif os.geteuid() != 0 and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        status["network_isolated"] = True
    else:
        status["notes"].append("network namespace unavailable: errno %d" % ctypes.get_errno())
for name, value in cfg["rlimits"].items():
    soft, hard = value
    resource.setrlimit(getattr(resource, name), (soft, hard))
status["uid_dropped"] = uid is not None
with open(cfg["status"], "w") as f:  # before dropping: the code's uid cannot write there
    json.dump(status, f)
if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
os.execve(exe, [exe, "-I", "-S", "main.py"], cfg["env"])
"""


@dataclass
class _Capture:
    """Keeps at most ``cap`` bytes of a stream; counts what it dropped."""

    cap: int
    buf: bytearray = field(default_factory=bytearray)
    truncated: bool = False

    def feed(self, data: bytes) -> bool:
        room = self.cap - len(self.buf)
        if len(data) > room:
            self.buf += data[: max(room, 0)]
            self.truncated = True
            return False
        self.buf += data
        return True

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


@dataclass
class _Run:
    """Paths and identity of one run."""

    root: Path  # root-owned, 0711: holds the status file and the mount point
    work: Path  # the code's working directory, owned by the run's uid
    status: Path
    mount_at: Path
    uid: int | None


def _base_interpreter() -> tuple[Path, Path]:
    """The real interpreter and its install prefix (a venv's python is a symlink into it)."""
    exe = Path(os.path.realpath(sys.executable))
    return exe, Path(sys.base_prefix).resolve()


def _allocate_uid() -> int | None:
    if os.geteuid() != 0:
        return None
    while True:
        uid = UID_BASE + random.randrange(UID_SPAN)
        if uid not in _UIDS_IN_USE:
            _UIDS_IN_USE.add(uid)
            return uid


def _safe_relpath(name: str) -> Path:
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"sandbox file name must be relative and stay inside the directory: {name!r}")
    return path


def _prepare(code: str, files: dict[str, str], uid: int | None) -> _Run:
    names = {_safe_relpath(name): content for name, content in files.items()}  # before mkdtemp
    root = Path(tempfile.mkdtemp(prefix="sandbox-"))
    try:
        return _populate(root, code, names, uid)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def _populate(root: Path, code: str, files: dict[Path, str], uid: int | None) -> _Run:
    root.chmod(0o711)  # the dropped uid may pass through (absolute paths to its cwd) but not list
    work, mount_at = root / "work", root / "py"
    work.mkdir(mode=0o700)
    mount_at.mkdir(mode=0o755)
    (work / "main.py").write_text(code, encoding="utf-8")
    for name, content in files.items():
        dest = work / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(content, encoding="utf-8")
    if uid is not None:
        for path in [work, *work.rglob("*")]:
            os.chown(path, uid, uid, follow_symlinks=False)
    return _Run(root=root, work=work, status=root / "status", mount_at=mount_at, uid=uid)


def _bootstrap_config(run: _Run, limits: SandboxLimits) -> str:
    exe, prefix = _base_interpreter()
    mib = 1024 * 1024
    rlimits = {
        "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),
        "RLIMIT_AS": (limits.memory_mb * mib, limits.memory_mb * mib),
        "RLIMIT_FSIZE": (limits.file_size_mb * mib, limits.file_size_mb * mib),
        "RLIMIT_NPROC": (limits.nproc, limits.nproc),
        "RLIMIT_NOFILE": (limits.open_files, limits.open_files),
        "RLIMIT_CORE": (0, 0),
    }
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(run.work), "TMPDIR": str(run.work)}
    return json.dumps(
        {
            "exe": str(exe),
            "exe_rel": str(exe.relative_to(prefix)) if exe.is_relative_to(prefix) else "",
            "prefix": str(prefix),
            "mount_at": str(run.mount_at),
            "uid": run.uid if exe.is_relative_to(prefix) else None,
            "isolate_net": limits.isolate_network,
            "rlimits": rlimits,
            "status": str(run.status),
            "env": env,
        }
    )


def _live_pids_of_uid(uid: int) -> list[int]:
    """Processes of ``uid`` that still run; zombies are dead already and only wait to be reaped."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]  # comm may contain ")"
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            pids.append(int(entry.name))
    return pids


def _kill_uid(uid: int, deadline_s: float = 10.0) -> None:
    """SIGKILL every process of ``uid`` until none is left (a fork bomb keeps forking meanwhile;
    RLIMIT_NPROC bounds how many there are, and a process with SIGKILL pending cannot fork)."""
    end = time.monotonic() + deadline_s
    while pids := _live_pids_of_uid(uid):
        if time.monotonic() > end:
            raise RuntimeError(f"sandbox processes of uid {uid} survive SIGKILL: {pids[:10]}")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.002)  # let the killed processes be scheduled and exit


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # group already gone


def _cleanup(run: _Run) -> None:
    try:
        if run.uid is not None:
            _kill_uid(run.uid)
            for tmp in _SHARED_TMP_DIRS:
                _remove_owned_by(Path(tmp), run.uid)
    finally:
        shutil.rmtree(run.root, ignore_errors=True)


def _remove_owned_by(directory: Path, uid: int) -> None:
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid:
            continue
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            Path(entry.path).unlink(missing_ok=True)


def _read_status(run: _Run) -> dict[str, object]:
    try:
        return json.loads(run.status.read_text())
    except (OSError, ValueError):
        return {}


def _killed_reason(exit_code: int | None, stderr: str) -> str | None:
    if exit_code is None or exit_code == 0:
        return None
    if exit_code < 0:
        sig = -exit_code
        if sig == signal.SIGXCPU:
            return "cpu"
        if sig == signal.SIGXFSZ:
            return "file_size"
        try:
            return f"signal:{signal.Signals(sig).name}"
        except ValueError:
            return f"signal:{sig}"
    # Python turns a refused allocation (RLIMIT_AS) into MemoryError; the traceback ends with it.
    if "MemoryError" in stderr[-2000:]:
        return "memory"
    return None


class _Supervisor:
    """Feeds stdin, drains the pipes under the caps, and kills the run when asked to."""

    def __init__(self, proc: anyio.abc.Process, run: _Run, limits: SandboxLimits) -> None:
        self.proc = proc
        self.run = run
        self.out = _Capture(limits.max_output_bytes)
        self.err = _Capture(limits.max_output_bytes)
        self.output_limit_hit = False

    async def kill(self) -> None:
        _killpg(self.proc.pid)
        if self.run.uid is not None:
            await anyio.to_thread.run_sync(_kill_uid, self.run.uid)

    async def feed_stdin(self, data: bytes) -> None:
        stream = self.proc.stdin
        assert stream is not None
        try:
            if data:
                await stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the code exited without reading its input
        finally:
            await stream.aclose()

    async def drain(self, stream: anyio.abc.ByteReceiveStream | None, sink: _Capture) -> None:
        assert stream is not None
        while True:
            try:
                data = await stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            if not sink.feed(data):
                self.output_limit_hit = True
                await self.kill()
                return


async def run_python(
    code: str,
    *,
    limits: SandboxLimits | None = None,
    stdin: str = "",
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh private directory (``files`` are written next to it)."""
    limits = limits or SandboxLimits()
    uid = _allocate_uid()
    try:
        run = await anyio.to_thread.run_sync(_prepare, code, files or {}, uid)
        try:
            return await _execute(run, limits, stdin)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_cleanup, run)
    finally:
        if uid is not None:
            _UIDS_IN_USE.discard(uid)


async def _execute(run: _Run, limits: SandboxLimits, stdin: str) -> SandboxResult:
    start = anyio.current_time()
    exe, _ = _base_interpreter()
    proc = await anyio.open_process(
        [str(exe), "-I", "-S", "-c", _BOOTSTRAP, _bootstrap_config(run, limits)],
        cwd=run.work,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        start_new_session=True,  # its own process group, killed as a whole
    )
    sup = _Supervisor(proc, run, limits)
    timed_out = False
    try:
        with anyio.move_on_after(limits.timeout_s) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(sup.feed_stdin, stdin.encode("utf-8"))
                tg.start_soon(sup.drain, proc.stdout, sup.out)
                tg.start_soon(sup.drain, proc.stderr, sup.err)
            await proc.wait()
        timed_out = scope.cancelled_caught
    finally:
        with anyio.CancelScope(shield=True):
            await sup.kill()  # also reaps what the code left running in the background
            await proc.wait()
            await proc.aclose()
    return _result(run, sup, proc.returncode, timed_out, anyio.current_time() - start)


def _result(run: _Run, sup: _Supervisor, code: int | None, timed_out: bool, wall: float) -> SandboxResult:
    status = _read_status(run)
    stderr = sup.err.text()
    if timed_out:
        reason: str | None = "timeout"
    elif sup.output_limit_hit:
        reason = "output_limit"
    elif not status and code not in (0, None):
        reason = "sandbox_error"  # the bootstrap died before exec; its traceback is in stderr
    else:
        reason = _killed_reason(code, stderr)
    notes = status.get("notes") or []
    return SandboxResult(
        stdout=sup.out.text(),
        stderr=stderr,
        exit_code=code,
        timed_out=timed_out,
        killed_reason=reason,
        wall_s=wall,
        network_isolated=bool(status.get("network_isolated")),
        uid=run.uid if status.get("uid_dropped") else None,
        stdout_truncated=sup.out.truncated,
        stderr_truncated=sup.err.truncated,
        extras={"notes": "; ".join(map(str, notes))} if notes else {},
    )
