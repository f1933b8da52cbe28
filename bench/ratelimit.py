#!/usr/bin/env python3
"""Cost of the global rate limiter's lock + state machinery against a bare ``filelock.FileLock``.

Phase 1 (throughput): 1, 4 and 8 processes (spawned, started together at a barrier) take tokens of
one key for ``--seconds`` each, with a limit that never binds (per_minute=1e12, burst=1e9), so what
is measured is the critical section: lock, open + read + write the state record, unlock, plus the
Python around it. Three loops per process count, in the same run: ``acquire_blocking``, async
``acquire`` (asyncio through anyio), and the bound, a bare ``FileLock`` acquire/release loop on
another lock file that polls a busy lock exactly as the limiter does (non-blocking attempts, sleeps
growing from 0.5 ms to 20 ms). Reported: acquisitions/s over all processes and ratio = limiter /
bare (1.0: the state costs nothing on top of the lock), also per CPU second (acquisitions / CPU
seconds of the loop's processes), which holds up better on a shared machine. With fewer cores than
processes, the processes also compete for CPU (a holder preempted inside its critical section).

Phase 2 (state write): microseconds per update of the state record, one process, no lock: the
limiter's way (open, pread, one pwrite of the 28-byte record, close) against a temporary file
renamed over the state file (the other way to make a write atomic).

Prints a table and, as its last line, a JSON object with every figure.
Run: ``.venv/bin/python bench/ratelimit.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import Progress
from common.ratelimit import (
    _POLL_MAX_S,
    _POLL_MIN_S,
    RECORD_SIZE,
    Bucket,
    GlobalRateLimiter,
    encode_record,
)

KEY = "bench"
LOOPS = ("bare", "blocking", "async")


progress = Progress("bench/ratelimit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/ratelimit.py", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=3.0,
        help="duration of one measurement (default %(default)s)",
    )
    p.add_argument("--procs", default="1,4,8", help="process counts (default %(default)s)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds per figure, median taken (default %(default)s)",
    )
    p.add_argument(
        "--write-ops", type=int, default=20000, help="state updates per write variant (phase 2)"
    )
    return p.parse_args(argv)


# -- phase 1: loops run in child processes --------------------------------------------------------------
def _bare_loop(lock_path: Path, stop: float) -> int:
    import filelock

    lock, ops = filelock.FileLock(lock_path), 0
    while time.monotonic() < stop:
        poll = _POLL_MIN_S
        while True:  # the limiter's polling, without its state
            try:
                lock.acquire(blocking=False)
                break
            except filelock.Timeout:
                time.sleep(poll * (0.5 + random.random()))
                poll = min(2 * poll, _POLL_MAX_S)
        lock.release()
        ops += 1
    return ops


def _blocking_loop(state_dir: Path, stop: float) -> int:

    rl, ops = GlobalRateLimiter(state_dir, {KEY: Bucket(per_minute=1e12, burst=10**9)}), 0
    while time.monotonic() < stop:
        rl.acquire_blocking(KEY)
        ops += 1
    return ops


def _async_loop(state_dir: Path, stop: float) -> int:
    import anyio

    rl = GlobalRateLimiter(state_dir, {KEY: Bucket(per_minute=1e12, burst=10**9)})

    async def run() -> int:
        ops = 0
        while time.monotonic() < stop:
            await rl.acquire(KEY)
            ops += 1
        return ops

    return anyio.run(run)


def _child(loop: str, state_dir: str, seconds: float, barrier: Any, results: Any) -> None:
    import anyio  # noqa: F401  (imports before the barrier, outside the clock)
    import filelock  # noqa: F401

    barrier.wait()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    stop = time.monotonic() + seconds
    if loop == "bare":
        ops = _bare_loop(Path(state_dir) / "bare.lock", stop)
    elif loop == "blocking":
        ops = _blocking_loop(Path(state_dir), stop)
    else:
        ops = _async_loop(Path(state_dir), stop)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    results.put((ops, cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime))


def measure(loop: str, procs: int, seconds: float, state_dir: Path) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    children = [
        ctx.Process(target=_child, args=(loop, str(state_dir), seconds, barrier, results))
        for _ in range(procs)
    ]
    for c in children:
        c.start()
    out = [results.get(timeout=seconds + 120) for _ in children]
    for c in children:
        c.join(timeout=30)
        if c.exitcode != 0:
            raise RuntimeError(f"{loop} child exited with {c.exitcode}")
    ops = sum(o for o, _ in out)
    return {"per_s": ops / seconds, "ops": ops, "cpu_s": round(sum(c for _, c in out), 3)}


def throughput_phase(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for procs in (int(x) for x in args.procs.split(",")):
        rounds: dict[str, list[dict[str, float]]] = {loop: [] for loop in LOOPS}
        for r in range(args.repeat):
            for loop in LOOPS:  # alternate, so load changes on a shared machine hit all three
                state_dir = root / f"p{procs}-{loop}-{r}"
                state_dir.mkdir()
                rounds[loop].append(measure(loop, procs, args.seconds, state_dir))
                progress(
                    f"{procs} procs, {loop:8s}: {rounds[loop][-1]['per_s']:,.0f} acquisitions/s"
                )
        med = {loop: statistics.median(x["per_s"] for x in rounds[loop]) for loop in LOOPS}
        # Per CPU second too: on a shared machine a loop may get less CPU than the others.
        cpu = {
            loop: statistics.median(x["ops"] / x["cpu_s"] for x in rounds[loop]) for loop in LOOPS
        }
        figures[str(procs)] = {
            **{f"{loop}_per_s": round(med[loop], 1) for loop in LOOPS},
            "blocking_ratio": round(med["blocking"] / med["bare"], 3),
            "async_ratio": round(med["async"] / med["bare"], 3),
            **{f"{loop}_per_cpu_s": round(cpu[loop], 1) for loop in LOOPS},
            "blocking_ratio_per_cpu_s": round(cpu["blocking"] / cpu["bare"], 3),
            "async_ratio_per_cpu_s": round(cpu["async"] / cpu["bare"], 3),
            **{f"{loop}_cpu_s": [x["cpu_s"] for x in rounds[loop]] for loop in LOOPS},
        }
    return figures


# -- phase 2: ways to write the state record ----------------------------------------------------------------
def write_phase(ops: int, root: Path) -> dict[str, float]:

    record = encode_record(1.0, time.time())
    state, tmp = root / "w.state", root / ".w.state.tmp"

    def pwrite_once() -> None:  # what the limiter does
        fd = os.open(state, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pread(fd, 2 * RECORD_SIZE, 0)
            os.pwrite(fd, record, 0)
        finally:
            os.close(fd)

    def rename_once() -> None:
        try:
            state.read_bytes()
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, record)
        finally:
            os.close(fd)
        os.replace(tmp, state)

    out = {}
    for name, fn in (("pwrite", pwrite_once), ("rename", rename_once)):
        fn()
        t0 = time.perf_counter()
        for _ in range(ops):
            fn()
        out[f"{name}_us"] = round((time.perf_counter() - t0) / ops * 1e6, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    import filelock

    args = parse_args(argv)
    result: dict[str, Any] = {
        "bench": "ratelimit",
        "seconds": args.seconds,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "filelock": filelock.__version__,
        "python": sys.version.split()[0],
    }
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        progress(
            f"warning: load average {load:.1f} on {os.cpu_count()} CPUs before the start: other "
            "processes share the cores, figures will be noisy"
        )
    with tempfile.TemporaryDirectory(prefix="bench-ratelimit-") as tmp:
        result["throughput"] = throughput_phase(args, Path(tmp))
        result["state_write"] = write_phase(args.write_ops, Path(tmp))
    result["loadavg_1m"] = {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)}

    print(
        f"{'procs':>5} {'bare FileLock/s':>16} {'acquire_blocking/s':>19} {'ratio':>6} "
        f"{'async acquire/s':>16} {'ratio':>6} {'ratios per CPU s':>17}"
    )
    for procs, f in result["throughput"].items():
        print(
            f"{procs:>5} {f['bare_per_s']:>16,.0f} {f['blocking_per_s']:>19,.0f} {f['blocking_ratio']:>6.2f} "
            f"{f['async_per_s']:>16,.0f} {f['async_ratio']:>6.2f} "
            f"{f['blocking_ratio_per_cpu_s']:>8.2f} {f['async_ratio_per_cpu_s']:>8.2f}"
        )
    w = result["state_write"]
    print(
        f"state write: pwrite {w['pwrite_us']:.1f} us, tmp + rename {w['rename_us']:.1f} us "
        f"({w['rename_us'] / w['pwrite_us']:.1f}x)"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
