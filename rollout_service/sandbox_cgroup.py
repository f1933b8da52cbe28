"""A control group per sandbox call: memory and process limits for all of the call's processes.

Design: rlimits bound each process; a call's processes together are bound by a cgroup of its own.
``detect`` picks the hierarchy once per process: cgroup v2 where this process's cgroup offers the
``memory`` and ``pids`` controllers, else the v1 ``memory`` and ``pids`` hierarchies, else none
(the sandbox then warns that per-call limits are not enforced). Call cgroups are nested under the
server's own cgroup (``<own>/agentrl-sandbox/<call>``), so a limit over the server still covers its
sandboxes; the parent is removed again when the last call leaves it.

Per call, ``CallCgroup.create`` sets the memory limit (swap too, where it can be limited) and
``pids.max``; the sandbox's privileged bootstrap writes its own pid into ``procs_files`` before it
isolates anything or execs the code, so every process of the call starts inside (no race: nothing
of the user's runs before). On v2 ``memory.oom.group`` makes an OOM kill take the whole call; on v1
the sandbox polls ``oom_kills`` and kills the call itself. ``kill`` SIGKILLs whatever is left
(``cgroup.kill`` where the kernel has it), ``remove`` deletes the cgroup (also after a timeout or
an error). The pure parts (``parse_self_cgroup``, ``detect`` on any root, ``oom_kills``) take
their files as arguments so that they can be tested on a fake tree.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = ["PARENT", "CallCgroup", "Hierarchy", "detect", "oom_kills", "parse_self_cgroup"]

PARENT = "agentrl-sandbox"  # the directory under the server's own cgroup holding the calls' ones
_CONTROLLERS = ("memory", "pids")


@dataclass(frozen=True)
class Hierarchy:
    """Where this process's cgroup lies: one directory (v2) or one per controller (v1)."""

    version: int  # 1 or 2
    memory: Path  # this process's cgroup in the memory hierarchy (v2: the unified one)
    pids: Path  # the same directory on v2

    def parents(self) -> list[Path]:
        """The directories that hold the calls' cgroups."""
        return list(dict.fromkeys([self.memory / PARENT, self.pids / PARENT]))


def parse_self_cgroup(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as controller -> path; the v2 entry (``0::/path``) under ``""``."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            paths.setdefault(name, path)
    return paths


def _below(mount: Path, path: str) -> Path:
    return mount / path.lstrip("/")


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def detect(root: Path = Path("/sys/fs/cgroup"), self_cgroup: str | None = None) -> Hierarchy | None:
    """The hierarchy per-call cgroups can be made in: v2 with memory and pids, else v1, else None."""
    if self_cgroup is None:
        try:
            self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    paths = parse_self_cgroup(self_cgroup)
    if "" in paths:  # v2 mounted at the root (unified) or beside v1 (hybrid: .../unified)
        for mount in (root, root / "unified"):
            own = _below(mount, paths[""])
            try:
                offered = (own / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if all(c in offered for c in _CONTROLLERS) and _writable(own):
                return Hierarchy(2, own, own)
    if all(c in paths for c in _CONTROLLERS):
        memory = _below(root / "memory", paths["memory"])
        pids = _below(root / "pids", paths["pids"])
        if (
            (root / "memory" / "memory.limit_in_bytes").exists()
            and (root / "pids" / "cgroup.procs").exists()
            and _writable(memory)
            and _writable(pids)
        ):
            return Hierarchy(1, memory, pids)
    return None


@cache
def host_hierarchy() -> Hierarchy | None:
    """This host's hierarchy, looked up once per process."""
    return detect()


def oom_kills(version: int, memory_dir: Path) -> int:
    """Processes of the cgroup killed for running out of its memory (v2 ``memory.events``; v1
    ``memory.oom_control``, or ``memory.failcnt`` on kernels without its ``oom_kill`` line)."""
    name = "memory.events" if version == 2 else "memory.oom_control"
    try:
        text = (memory_dir / name).read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    if version == 1:
        with contextlib.suppress(OSError, ValueError):
            return int((memory_dir / "memory.failcnt").read_text())
    return 0


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _enable_controllers(directory: Path) -> None:
    """v2: let ``directory``'s children have the memory and pids controllers."""
    control = directory / "cgroup.subtree_control"
    enabled = control.read_text().split()
    missing = [c for c in _CONTROLLERS if c not in enabled]
    if missing:
        _write(control, " ".join(f"+{c}" for c in missing))


@dataclass
class CallCgroup:
    """One call's cgroup (one directory on v2, a memory and a pids one on v1)."""

    hierarchy: Hierarchy
    name: str

    @property
    def dirs(self) -> list[Path]:
        return [parent / self.name for parent in self.hierarchy.parents()]

    @property
    def memory_dir(self) -> Path:
        return self.hierarchy.memory / PARENT / self.name

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    @classmethod
    def create(cls, hierarchy: Hierarchy, name: str, memory_mb: int, nproc: int) -> CallCgroup:
        """Make the cgroup and set its limits; raises OSError (and leaves nothing) if it cannot."""
        cg = cls(hierarchy, name)
        limit = str(memory_mb * 1024 * 1024)
        try:
            for _ in range(20):  # a concurrent call may remove an empty parent meanwhile
                try:
                    cg._make_dirs()
                    break
                except FileNotFoundError:
                    continue
            if hierarchy.version == 2:
                _write(cg.memory_dir / "memory.max", limit)
                if (cg.memory_dir / "memory.swap.max").exists():
                    _write(cg.memory_dir / "memory.swap.max", "0")
                _write(cg.memory_dir / "memory.oom.group", "1")
            else:
                _write(cg.memory_dir / "memory.limit_in_bytes", limit)
                if (cg.memory_dir / "memory.memsw.limit_in_bytes").exists():
                    _write(cg.memory_dir / "memory.memsw.limit_in_bytes", limit)  # no swap
            _write(hierarchy.pids / PARENT / name / "pids.max", str(nproc))
        except OSError:
            cg.remove()
            raise
        return cg

    def _make_dirs(self) -> None:
        if self.hierarchy.version == 2:
            _enable_controllers(self.hierarchy.memory)
        for parent in self.hierarchy.parents():
            parent.mkdir(exist_ok=True)
            if self.hierarchy.version == 2:
                _enable_controllers(parent)
            (parent / self.name).mkdir()

    def oom_killed(self) -> bool:
        return oom_kills(self.hierarchy.version, self.memory_dir) > 0

    def pids(self) -> list[int]:
        found: set[int] = set()
        for procs in self.procs_files:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in Path(procs).read_text().split())
        return sorted(found)

    def kill(self, deadline_s: float = 10.0) -> None:
        """SIGKILL every process in the cgroup until none is left (``pids.max`` bounds a fork
        bomb meanwhile, and a process with SIGKILL pending cannot fork)."""
        kill_file = self.memory_dir / "cgroup.kill"
        end = time.monotonic() + deadline_s
        while pids := self.pids():
            if time.monotonic() > end:
                raise RuntimeError(f"sandbox cgroup {self.name}: processes survive SIGKILL: {pids}")
            if self.hierarchy.version == 2 and kill_file.exists():
                with contextlib.suppress(OSError):
                    _write(kill_file, "1")
            else:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.002)

    def remove(self, deadline_s: float = 5.0) -> None:
        """Kill what is left, delete the call's cgroup and the parent once no call uses it."""
        with contextlib.suppress(OSError):
            self.kill()
        end = time.monotonic() + deadline_s
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:  # EBUSY: an exiting process has not left yet
                    if e.errno != errno.EBUSY or time.monotonic() > end:
                        raise
                    time.sleep(0.005)
        for parent in self.hierarchy.parents():
            with contextlib.suppress(OSError):  # another call's cgroup is still there
                parent.rmdir()
