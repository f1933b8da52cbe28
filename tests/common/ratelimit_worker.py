"""A child process for tests/common/test_ratelimit.py: uses a GlobalRateLimiter on a shared state dir.

Modes:
- ``hammer``: prints ``ready``, reads ``START END`` (time.time() values) from stdin, waits until
  START, then takes tokens of ``--key`` as fast as the limiter admits them (``--api``: blocking,
  asyncio or trio) until END, appending each admission time (repr, one a line, flushed) to
  ``--out``. With ``--hold-at S`` it stops hammering S seconds after START, takes the key's lock
  file itself, prints ``held T`` (T: time.time() after taking it) and sleeps until killed.
- ``hold``: takes the key's lock file, prints ``held T`` and sleeps until killed.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import anyio
import filelock

from common.ratelimit import Bucket, GlobalRateLimiter, RateLimitTimeout


def hold_forever(limiter: GlobalRateLimiter, key: str) -> None:
    # A fresh FileLock (its own descriptor), kept referenced: a collected FileLock releases itself.
    lock = filelock.FileLock(limiter.lock_path(key))
    lock.acquire()
    print(f"held {time.time()!r}", flush=True)
    while lock.is_locked:
        time.sleep(3600)


def hammer_blocking(
    limiter: GlobalRateLimiter, key: str, end: float, hold_at: float | None, out: TextIO
) -> None:
    while (now := time.time()) < end:
        if hold_at is not None and now >= hold_at:
            hold_forever(limiter, key)
        until = end if hold_at is None else min(end, hold_at)
        try:
            t = limiter.acquire_blocking(key, timeout_s=until - now)
        except RateLimitTimeout:  # no token due before `until`
            time.sleep(max(0.0, until - time.time()))
            continue
        out.write(f"{t!r}\n")
        out.flush()


async def hammer_async(limiter: GlobalRateLimiter, key: str, end: float, out: TextIO) -> None:
    while (now := time.time()) < end:
        try:
            t = await limiter.acquire(key, timeout_s=end - now)
        except RateLimitTimeout:
            break
        out.write(f"{t!r}\n")
        out.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("hammer", "hold"))
    p.add_argument("--state-dir", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--per-minute", type=float, default=600.0)
    p.add_argument("--burst", type=int, default=5)
    p.add_argument("--api", choices=("blocking", "asyncio", "trio"), default="blocking")
    p.add_argument("--out", help="file the admission times are appended to (hammer)")
    p.add_argument("--hold-at", type=float, help="seconds after START to take the lock and keep it")
    args = p.parse_args()
    limiter = GlobalRateLimiter(args.state_dir, {args.key: Bucket(args.per_minute, args.burst)})
    if args.mode == "hold":
        hold_forever(limiter, args.key)
    print("ready", flush=True)
    start, end = (float(x) for x in sys.stdin.readline().split())
    time.sleep(max(0.0, start - time.time()))
    hold_at = None if args.hold_at is None else start + args.hold_at
    with open(args.out, "a") as out:
        if args.api == "blocking":
            hammer_blocking(limiter, args.key, end, hold_at, out)
        else:
            anyio.run(hammer_async, limiter, args.key, end, out, backend=args.api)
    return 0


if __name__ == "__main__":
    sys.exit(main())
