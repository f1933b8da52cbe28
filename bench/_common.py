"""Pieces the bench scripts share: progress lines, a log's tail, a guarded ratio, and the GPUs as
nvidia-smi sees them (their names and count, and a sampler of their peak memory).

Design: GPUs are read through nvidia-smi, never through torch: a CUDA context in the bench's own
process would hold GPU memory through every run it times. Every nvidia-smi failure (no such program
on a CPU machine, a hung driver) degrades to "no figure", never to a failed bench. stdlib only, so
a bench's ``--help`` stays instant.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

NVIDIA_SMI_TIMEOUT_S = 30.0


class Progress:
    """Progress lines on stderr, ``[tag  elapsed s] message``, the clock started at construction."""

    def __init__(self, tag: str) -> None:
        self.tag, self.t0 = tag, time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{self.tag} {time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a text file (read from its last 32 kB), "" when unreadable."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 32 * 1024))
            return "\n".join(f.read().decode("utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def ratio(a: Any, b: Any) -> float | None:
    """a / b rounded to 3 decimals; None unless both are numbers and b is not 0."""
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
    return round(float(a) / float(b), 3) if ok else None


def _nvidia_smi(*query: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", *query],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def gpu_names() -> list[str]:
    """One line per GPU ("index, name, memory.total"), or one line saying why there is none."""
    out = _nvidia_smi("--query-gpu=index,name,memory.total", "--format=csv,noheader")
    if out is None:
        return ["nvidia-smi failed or is missing"]
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_count() -> int | None:
    """How many GPUs this machine has (nvidia-smi's numbering, whatever CUDA_VISIBLE_DEVICES says);
    None when nvidia-smi cannot tell."""
    out = _nvidia_smi("--query-gpu=index", "--format=csv,noheader")
    return None if out is None else len([x for x in out.split() if x.strip()])


def parse_memory_used(text: str) -> dict[int, float]:
    """nvidia-smi's ``index, memory.used`` lines (csv, no header, no units) -> MiB per GPU index."""
    used: dict[int, float] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        index, value = (x.strip() for x in line.split(","))
        used[int(index)] = float(value)
    return used


class GpuMemory:
    """Peak GPU memory used while it runs (a context manager): nvidia-smi every ``interval`` s, the
    peak of the sum over the GPUs (``peak_mib``) and each GPU's own peak (``peak_per_gpu_mib``).
    Counts every process on the GPUs, as a user of the machine sees it."""

    QUERY = ("--query-gpu=index,memory.used", "--format=csv,noheader,nounits")

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.peak_mib, self.samples = interval, 0.0, 0
        self.peak_per_gpu_mib: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def add(self, used: dict[int, float]) -> None:
        """Take one sample (MiB per GPU index) into the peaks."""
        self.peak_mib = max(self.peak_mib, sum(used.values()))
        for gpu, mib in used.items():
            self.peak_per_gpu_mib[gpu] = max(self.peak_per_gpu_mib.get(gpu, 0.0), mib)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            out = _nvidia_smi(*self.QUERY)
            if out is None:
                return  # no nvidia-smi (a CPU machine): no memory figure
            try:
                self.add(parse_memory_used(out))
            except ValueError:
                return
            self._stop.wait(self.interval)

    def summary(self) -> dict[str, Any] | None:
        """The peaks in MiB (None without a single sample)."""
        if not self.samples:
            return None
        return {
            "peak_gpu_mib": round(self.peak_mib),
            "peak_per_gpu_mib": {
                str(g): round(m) for g, m in sorted(self.peak_per_gpu_mib.items())
            },
            "samples": self.samples,
        }

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=NVIDIA_SMI_TIMEOUT_S + 5)
