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
- files: in that mount namespace every shared writable directory (/tmp, /var/tmp, /dev/shm,
  /run/lock, /dev/mqueue) is covered by a small private tmpfs, and the home directories, this
  checkout, the venv and the server's working directory by an empty one; the run's directory and
  the interpreter are bind-mounted back at their own paths. So the code sees the system (/usr,
  /etc, ...) but no project or user file, and what it writes to a temp dir vanishes with the
  namespace. A private IPC namespace does the same for System V shared memory. All or nothing: if
  a mount fails, the view is undone and the run goes on without it (``fs_isolated`` false, one
  warning per process).
- resources: ``setrlimit`` for CPU seconds, address space, file size, processes, open files, core,
  per process; for the call as a whole a control group of its own (``sandbox_cgroup``: memory of
  all its processes, tmpfs pages included, and ``pids.max``), joined by the bootstrap before
  anything else. An OOM kill there ends the whole call (``killed_reason="memory"``, a note in
  stderr). Disk: in the mount namespace the code's working directory is a tmpfs of ``disk_mb``
  (its files copied in), so a call writes at most that plus the small temp-dir tmpfs; ENOSPC shows
  as a one-line note in stderr.
- wall clock: past the timeout the process group (and every process of the run's uid) is killed.
- output: stdout/stderr are read incrementally; past the byte cap the run is killed, so an output
  flood costs at most the cap in memory.

Afterwards the directory, and anything the run's uid left in world-writable temp dirs (none,
unless the private view failed), is removed, and so is the call's cgroup (after killing what is
left in it). Without root (and without user namespaces) only rlimits, the process group and the
timeout remain, and a warning says so; without a usable cgroup hierarchy or a mount namespace
another one says that per-call memory and disk limits are not enforced.
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

from common.logging import get_logger
from rollout_service.sandbox_cgroup import CallCgroup, host_hierarchy

__all__ = ["SandboxLimits", "SandboxResult", "run_python"]

# A range of uids that no account uses; a run draws one at random so that concurrent runs in this
# process (tracked in _UIDS_IN_USE) and, very likely, in other processes never share one.
UID_BASE = 1_500_000_000
UID_SPAN = 1_000_000
_UIDS_IN_USE: set[int] = set()

# World-writable places every process can write to. In the run's mount namespace each is covered by
# a private tmpfs that disappears with the run; without one, what the run's uid left there is removed.
_SHARED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
# Never covered, whatever the hidden paths are: what the interpreter and the code need.
_SYSTEM_DIRS = ("/bin", "/dev", "/etc", "/lib", "/lib64", "/proc", "/sbin", "/sys", "/usr")
_CHECKOUT = Path(__file__).resolve().parents[1]
_warned_unisolated = False
_warned_unlimited = False


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
    call_memory_mb: int = 1024  # all processes of the call together, tmpfs included (cgroup)
    disk_mb: int = 64  # the code's working directory (a tmpfs in the run's mount namespace)


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal (subprocess convention)
    timed_out: bool
    # timeout, output_limit, memory, cpu, file_size, signal:NAME, sandbox_error
    killed_reason: str | None
    wall_s: float
    network_isolated: bool
    uid: int | None = None  # the uid the code ran as, when it was dropped from root
    fs_isolated: bool = False  # shared temp dirs private to the run, checkout and homes hidden
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    extras: dict[str, str] = field(default_factory=dict)  # diagnostics (bootstrap notes)
    cgroup: str | None = None  # name of the call's cgroup (gone afterwards) when it was joined
    disk_limited: bool = False  # the working directory was a tmpfs of ``disk_mb``

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
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWNET = 0x20000, 0x8000000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
O_PATH = 0o10000000
status = {"network_isolated": False, "uid_dropped": False, "fs_isolated": False, "notes": [],
          "cgroup": bool(cfg["cgroup_procs"]), "disk_limited": False}
for procs in cfg["cgroup_procs"]:  # first: every process of the call starts inside
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        status["notes"].append("joining the call's cgroup failed: %s" % e)
        status["cgroup"] = False
status_file = open(cfg["status"], "w")  # now: the path is hidden once /tmp is covered
exe, uid = cfg["exe"], cfg["uid"]

mounted = []  # by isolate_files, undone if it fails part-way

def mount(source, target, fstype, flags, data=None):
    if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                  data and data.encode()) != 0:
        raise OSError(ctypes.get_errno(), "mount %s on %s: %s" % (fstype or source, target,
                                                                   os.strerror(ctypes.get_errno())))
    if not flags & MS_REMOUNT:
        mounted.append(target)

def cover(paths, options):
    for path in paths:
        mount("sandbox", path, "tmpfs", MS_NOSUID | MS_NODEV, options)

def isolate_files():
    # Handles first: the run's directory and the interpreter may lie under what gets covered.
    work = os.open(cfg["work"], O_PATH | os.O_DIRECTORY)
    prefix = os.open(cfg["prefix"], O_PATH | os.O_DIRECTORY)
    cover(cfg["shared_dirs"], "mode=1777,size=%dk,nr_inodes=4096" % cfg["shared_kib"])
    cover(cfg["hidden_dirs"], "mode=0755,size=64k,nr_inodes=256")
    for fd, path in ((work, cfg["work"]), (prefix, cfg["mount_at"])):
        os.makedirs(path, exist_ok=True)
        mount("/proc/self/fd/%d" % fd, path, None, MS_BIND | MS_REC)
        os.close(fd)
    mount(None, cfg["mount_at"], None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)
    os.chdir(cfg["work"])

def work_on_tmpfs():
    # The code's files are small: read them, cover the directory with a tmpfs of the call's disk
    # size owned by the run's uid, write them back.
    top, saved = cfg["work"], []
    for where, dirs, names in os.walk(top):
        saved.append((os.path.relpath(where, top), None))
        for name in names:
            with open(os.path.join(where, name), "rb") as f:
                saved.append((os.path.relpath(os.path.join(where, name), top), f.read()))
    mount("sandbox", top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700,uid=%d,gid=%d,size=%dk,nr_inodes=%d"
          % (uid, uid, cfg["disk_kib"], max(4096, cfg["disk_kib"] // 16)))
    try:
        for rel, data in saved:
            path = os.path.normpath(os.path.join(top, rel))
            if data is None:
                os.makedirs(path, exist_ok=True)
            else:
                with open(path, "wb") as f:
                    f.write(data)
            os.chown(path, uid, uid)
    except OSError:
        libc.umount2(top.encode(), 2)
        raise
    os.chdir(top)

if uid is not None:
    if libc.unshare(CLONE_NEWNS) != 0:
        status["notes"].append("unshare(CLONE_NEWNS) failed: errno %d" % ctypes.get_errno())
        uid = None
    else:
        try:
            mount("none", "/", None, MS_REC | MS_PRIVATE)
            # The interpreter first, at its own path in the run's directory: what isolate_files
            # does is optional, running the code under the dropped uid is not.
            mount(cfg["prefix"], cfg["mount_at"], None, MS_BIND | MS_REC)
            mounted.clear()
            libc.mount(None, cfg["mount_at"].encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, None)
            exe = cfg["mount_at"] + "/" + cfg["exe_rel"]
        except OSError as e:
            status["notes"].append("bind mount of the interpreter failed: %s" % e)
            uid = None
    if uid is not None:
        try:
            isolate_files()
            status["fs_isolated"] = True
        except OSError as e:
            status["notes"].append("filesystem isolation failed: %s" % e)
            # All or nothing: a half-covered view could hide the interpreter or the code itself.
            for target in reversed(mounted):
                libc.umount2(target.encode(), 2)  # MNT_DETACH
        try:
            work_on_tmpfs()
            status["disk_limited"] = True
        except OSError as e:
            status["notes"].append("no tmpfs for the working directory: %s" % e)
            os.chdir(cfg["work"])
        if libc.unshare(CLONE_NEWIPC) != 0:  # System V shared memory outlives its creator
            status["notes"].append("unshare(CLONE_NEWIPC) failed: errno %d" % ctypes.get_errno())
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
json.dump(status, status_file)  # before dropping: the code's uid cannot write there
status_file.close()
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
    cgroup: CallCgroup | None = None  # the call's control group, when the host allows one
    cgroup_error: str | None = None  # why there is none


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
        raise ValueError(
            f"sandbox file name must be relative and stay inside the directory: {name!r}"
        )
    return path


def _prepare(code: str, files: dict[str, str], uid: int | None, limits: SandboxLimits) -> _Run:
    names = {_safe_relpath(name): content for name, content in files.items()}  # before mkdtemp
    root = Path(tempfile.mkdtemp(prefix="sandbox-"))
    try:
        run = _populate(root, code, names, uid)
        _make_cgroup(run, limits)
        return run
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def _make_cgroup(run: _Run, limits: SandboxLimits) -> None:
    hierarchy = host_hierarchy()
    if hierarchy is None:
        run.cgroup_error = "no writable cgroup hierarchy with the memory and pids controllers"
        return
    name = f"{os.getpid()}-{run.root.name}"
    try:
        run.cgroup = CallCgroup.create(hierarchy, name, limits.call_memory_mb, limits.nproc)
    except OSError as e:
        run.cgroup_error = f"cannot make the call's cgroup under {hierarchy.memory}: {e}"


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
    shared = _existing_dirs(_SHARED_TMP_DIRS)
    env = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(run.work),
        "TMPDIR": str(run.work),
    }
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
            "work": str(run.work),
            "shared_dirs": shared,
            "hidden_dirs": _hidden_dirs(shared),
            "shared_kib": limits.file_size_mb * 1024,
            "disk_kib": limits.disk_mb * 1024,
            "cgroup_procs": run.cgroup.procs_files if run.cgroup else [],
            "env": env,
        }
    )


def _existing_dirs(paths: list[str] | tuple[str, ...]) -> list[str]:
    """Real paths of the directories that exist, without duplicates (/var/lock is /run/lock)."""
    found = [os.path.realpath(p) for p in paths]
    return list(dict.fromkeys(p for p in found if os.path.isdir(p)))


def _hidden_dirs(covered: list[str]) -> list[str]:
    """Directories hidden from the code by an empty tmpfs: homes, this checkout (and the venv, the
    server's working directory). A path holding a system directory is never hidden (a working
    directory of ``/``), and one under a directory already covered needs nothing more."""
    wanted = _existing_dirs(
        ["/root", "/home", str(Path.home()), str(_CHECKOUT), sys.prefix, os.getcwd()]
    )
    hidden: list[str] = []
    for path in sorted(wanted, key=len):  # parents first
        p = Path(path)
        if any(Path(s).is_relative_to(p) or p.is_relative_to(s) for s in _SYSTEM_DIRS):
            continue
        if any(p.is_relative_to(c) for c in [*covered, *hidden]):
            continue
        hidden.append(path)
    return hidden


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
        if run.cgroup is not None:
            run.cgroup.kill()
        if run.uid is not None:
            _kill_uid(run.uid)
            for tmp in _SHARED_TMP_DIRS:
                _remove_owned_by(Path(tmp), run.uid)
    finally:
        try:
            if run.cgroup is not None:
                run.cgroup.remove()
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
        self.memory_limit_hit = False

    async def kill(self) -> None:
        _killpg(self.proc.pid)
        if self.run.cgroup is not None:
            await anyio.to_thread.run_sync(self.run.cgroup.kill)
        if self.run.uid is not None:
            await anyio.to_thread.run_sync(_kill_uid, self.run.uid)

    async def watch_memory(self, cgroup: CallCgroup) -> None:
        """An OOM kill in the call's cgroup ends the whole call (v2 does so itself with
        ``memory.oom.group``; on v1 only the largest process would die)."""
        while not cgroup.oom_killed():
            await anyio.sleep(0.02)
        self.memory_limit_hit = True
        await self.kill()

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
        run = await anyio.to_thread.run_sync(_prepare, code, files or {}, uid, limits)
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
            async with anyio.create_task_group() as watch:
                if run.cgroup is not None:
                    watch.start_soon(sup.watch_memory, run.cgroup)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sup.feed_stdin, stdin.encode("utf-8"))
                    tg.start_soon(sup.drain, proc.stdout, sup.out)
                    tg.start_soon(sup.drain, proc.stderr, sup.err)
                await proc.wait()
                watch.cancel_scope.cancel()
        timed_out = scope.cancelled_caught
    finally:
        with anyio.CancelScope(shield=True):
            await sup.kill()  # also reaps what the code left running in the background
            await proc.wait()
            await proc.aclose()
    oom = sup.memory_limit_hit or (run.cgroup is not None and run.cgroup.oom_killed())
    wall = anyio.current_time() - start
    return _result(run, limits, sup, proc.returncode, timed_out, oom, wall)


def _result(
    run: _Run,
    limits: SandboxLimits,
    sup: _Supervisor,
    code: int | None,
    timed_out: bool,
    oom: bool,
    wall: float,
) -> SandboxResult:
    status = _read_status(run)
    stderr = sup.err.text()
    joined = bool(status.get("cgroup")) and run.cgroup is not None
    disk_limited = bool(status.get("disk_limited"))
    if timed_out:
        reason: str | None = "timeout"
    elif sup.output_limit_hit:
        reason = "output_limit"
    elif oom and joined:
        reason = "memory"
        stderr += (
            f"\nsandbox: the call exceeded its memory limit of {limits.call_memory_mb} MiB "
            "(all its processes together) and was killed\n"
        )
    elif not status and code not in (0, None):
        reason = "sandbox_error"  # the bootstrap died before exec; its traceback is in stderr
    else:
        reason = _killed_reason(code, stderr)
    found = status.get("notes")
    notes: list[object] = list(found) if isinstance(found, list) else []
    if disk_limited and ("[Errno 28]" in stderr or "No space left on device" in stderr):
        stderr += (
            f"\nsandbox: the call ran out of disk space: its working directory has a disk limit of "
            f"{limits.disk_mb} MiB (temp dirs such as /tmp {limits.file_size_mb} MiB each)\n"
        )
    if status and not status.get("fs_isolated"):
        _warn_unisolated(notes)
    if status and not (joined and disk_limited):
        _warn_unlimited(run, joined, disk_limited)
    return SandboxResult(
        stdout=sup.out.text(),
        stderr=stderr,
        exit_code=code,
        timed_out=timed_out,
        killed_reason=reason,
        wall_s=wall,
        network_isolated=bool(status.get("network_isolated")),
        uid=run.uid if status.get("uid_dropped") else None,
        fs_isolated=bool(status.get("fs_isolated")),
        stdout_truncated=sup.out.truncated,
        stderr_truncated=sup.err.truncated,
        extras={"notes": "; ".join(map(str, notes))} if notes else {},
        cgroup=run.cgroup.name if joined and run.cgroup is not None else None,
        disk_limited=disk_limited,
    )


def _warn_unlimited(run: _Run, joined: bool, disk_limited: bool) -> None:
    """Once per process: without a cgroup or a mount namespace, limits are per process only."""
    global _warned_unlimited
    if _warned_unlimited:
        return
    _warned_unlimited = True
    get_logger(__name__).warning(
        "sandbox: per-call memory and disk limits are not enforced; only per-process rlimits bound "
        "a call, so one call may use nproc times memory_mb and write to the host's disk",
        memory_limited=joined,
        disk_limited=disk_limited,
        cgroup_error=run.cgroup_error,
        euid=os.geteuid(),
    )


def _warn_unisolated(notes: list[object]) -> None:
    """Once per process: the operator should know what the sandbox does not enforce here."""
    global _warned_unisolated
    if _warned_unisolated:
        return
    _warned_unisolated = True

    get_logger(__name__).warning(
        "sandbox: no private filesystem view (needs root and mount namespaces); sandboxed code can "
        "read world-readable host files such as the checkout, and what it writes to shared temp "
        "dirs is only swept afterwards when it ran under its own uid",
        euid=os.geteuid(),
        notes="; ".join(map(str, notes)) or None,
    )
