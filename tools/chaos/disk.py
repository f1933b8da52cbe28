"""A run directory on a disk that can be filled: a small tmpfs mounted for the chaos run.

Design: with the `disk-full` fault the run directory is a tmpfs of ``--disk-mib`` (mounting one
needs root; without it the kind is refused before anything starts). The fault fills it with a
ballast file to the last byte, holds it full for a few seconds while the job writes its journal,
metrics, recordings and checkpoints, then frees it. At the end the run directory is copied out
(``RUN.saved``, where the report points) and the tmpfs unmounted, so the run leaves no mount.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

BALLAST = ".chaos-ballast"


class DiskError(RuntimeError):
    pass


class SmallDisk:
    def __init__(self, path: Path, mib: int) -> None:
        self.path, self.mib = path, mib

    def mount(self) -> None:
        if os.geteuid() != 0:
            raise DiskError("the disk-full fault mounts a tmpfs as the run directory: run as root")
        self.path.mkdir(parents=True, exist_ok=True)
        if any(self.path.iterdir()):
            raise DiskError(f"{self.path} is not empty: a tmpfs mounted over it would hide it")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.mib}m", "chaos-run", str(self.path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise DiskError(f"mount tmpfs on {self.path}: {done.stderr.strip()}")

    def free_mib(self) -> float:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize / 2**20

    def fill(self) -> int:
        """Write the ballast until the disk refuses (ENOSPC); its size in bytes."""
        block = b"\0" * (1 << 20)
        written = 0
        with open(self.path / BALLAST, "wb", buffering=0) as f:
            try:
                while True:
                    written += f.write(block) or 0
            except OSError:  # ENOSPC: full; write what still fits in smaller pieces
                for size in (1 << 16, 1 << 12, 1 << 9):
                    with contextlib.suppress(OSError):
                        while True:
                            written += f.write(block[:size]) or 0
        return written

    def empty(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / BALLAST).unlink()

    def unmount(self, keep: Path) -> None:
        """Copy the run directory to ``keep`` (the ballast left out), then unmount."""
        self.empty()
        if keep.exists():
            shutil.rmtree(keep)
        shutil.copytree(self.path, keep, symlinks=True)
        subprocess.run(["umount", "-l", str(self.path)], check=False)
