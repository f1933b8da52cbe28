"""Global token-bucket rate limits, shared by every process (and host) that uses one state directory.

Design:
- One token bucket per key (a tool name or an external API). Its state, (tokens, time of the last
  update), is a 28-byte record in ``<state_dir>/<name>.state``, guarded by ``<name>.lock`` through
  ``filelock.FileLock`` (``<name>``: the key's file-safe characters plus a short hash of it). filelock because on Unix it is ``flock``: a kernel lock that needs no
  server or daemon, works between unrelated processes (rollout servers, tool servers, threads of a
  synchronous reward function: each thread locks through its own descriptor), and is released by
  the kernel when its holder dies, SIGKILL included, so a dead process never blocks the others.
- The critical section is short and never waits: try the lock without blocking, read the record,
  refill, take a token if there is one, write the record, release. The admission time returned is
  the clock value read inside the section, so admitted times obey the bucket exactly: any window
  [a, b] holds at most ``burst + rate * (b - a)`` admissions, across all processes.
- The lock is never held while waiting. A caller without a token computes when the next one is
  due, releases the lock, sleeps (``anyio.sleep`` or ``time.sleep``) until then plus a random delay
  (so the fastest sleeper does not always win; see `_attempts`) and tries again; a caller that
  finds the lock busy polls it with short, growing, jittered sleeps (0.5 ms to 20 ms). So the async
  path awaits only outside the critical section: a cancelled acquire never leaves the lock held,
  and the event loop is blocked for one critical section at most (~80 microseconds on a local
  disk). Both paths share one sans-IO generator (`_attempts`) that yields the delays to sleep.
- Wall clock (``time.time()``), not a monotonic one: processes and hosts share no monotonic clock.
  The stored time never moves back, so a clock stepped back adds no tokens; a host whose clock lags
  the others sees tokens late. Clock skew makes a limit stricter, never looser.
- A process killed while writing cannot leave a half-written record: the record is written by one
  ``os.pwrite`` of 28 bytes at offset 0 (within one page, so the kernel applies it whole or not at
  all) and carries a CRC32; a missing, short or corrupt record reads as a full bucket (the only
  cost: at most ``burst`` extra tokens once). pwrite rather than temporary file + rename: it is a
  data write to an existing inode, while a rename is a directory operation (journal entry, and on
  NFS a server round trip). bench/ratelimit.py measures both (figures in docs/performance.md); most
  of a critical section is filelock's own acquire/release.
- Across hosts: put ``state_dir`` on a shared filesystem whose flock works between hosts (NFSv4,
  CephFS, Lustre mounted with ``flock``). Each attempt then costs network round trips (lock, open,
  read, write, close, unlock; the state file is opened per attempt so NFS close-to-open consistency
  hands every holder the last write). Without a shared filesystem, give each of N hosts
  ``per_minute / N``: no coordination cost, but an idle host's share cannot be borrowed by a busy one.
  All processes sharing a state directory must configure a key with the same bucket.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import struct
import time
import zlib
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import anyio
import filelock

if TYPE_CHECKING:
    from common.config.agents import RateLimitsConfig

__all__ = ["Bucket", "GlobalRateLimiter", "RateLimitTimeout", "set_shared", "shared"]

_BODY = struct.Struct("<4sdd")  # magic, tokens, time of the last update (time.time())
_MAGIC = b"RLB1"
RECORD_SIZE = _BODY.size + 4  # + CRC32 of the body
_POLL_MIN_S = 0.0005  # first wait when another process holds the lock (its sections last ~80 us)
_POLL_MAX_S = 0.02
_JITTER_MAX_S = (
    0.05  # widest random delay added to a waiter's wake-up: >> an event loop's wake-up lag
)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class RateLimitTimeout(TimeoutError):
    """No token within the timeout; message names the key, its rate/burst, the timeout and the state dir."""


@dataclass(frozen=True)
class Bucket:
    """A token bucket: ``burst`` calls at once after a quiet period, ``per_minute`` sustained."""

    per_minute: float
    """Sustained rate (tokens added per minute), > 0."""
    burst: int
    """Bucket capacity, >= 1."""

    def __post_init__(self) -> None:
        if not (
            isinstance(self.per_minute, int | float)
            and math.isfinite(self.per_minute)
            and self.per_minute > 0
        ):
            raise ValueError(f"per_minute must be a finite number > 0 (got {self.per_minute!r})")
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise ValueError(f"burst must be an integer >= 1 (got {self.burst!r})")

    @property
    def per_second(self) -> float:
        return self.per_minute / 60.0


def encode_record(tokens: float, stamp: float) -> bytes:
    body = _BODY.pack(_MAGIC, tokens, stamp)
    return body + zlib.crc32(body).to_bytes(4, "little")


def decode_record(data: bytes) -> tuple[float, float] | None:
    """(tokens, stamp), or None for anything that is not one intact record."""
    if len(data) != RECORD_SIZE or zlib.crc32(data[:-4]).to_bytes(4, "little") != data[-4:]:
        return None
    magic, tokens, stamp = _BODY.unpack(data[:-4])
    if magic != _MAGIC or not (math.isfinite(tokens) and math.isfinite(stamp)):
        return None
    return tokens, stamp


def file_stem(key: str) -> str:
    """A safe, unique file name for a key: its safe characters (at most 48) plus a short hash."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"{_UNSAFE.sub('_', key)[:48]}-{digest}"


class _Slot:
    """Per key: the bucket, its files and its lock (thread-local context: one descriptor per thread)."""

    def __init__(self, state_dir: Path, key: str, bucket: Bucket) -> None:
        stem = file_stem(key)
        self.key = key
        self.bucket = bucket
        self.rate = bucket.per_second
        self.lock_path = state_dir / f"{stem}.lock"
        self.state_path = state_dir / f"{stem}.state"
        self.lock = filelock.FileLock(self.lock_path)


class _Outcome(NamedTuple):
    admitted_at: float | None
    """time.time() read inside the critical section, when a token was taken."""
    wait_s: float | None
    """No token: seconds until the next one is due; None: another process held the lock."""


def _try_take(slot: _Slot) -> _Outcome:
    """One critical section; never waits for the lock."""
    try:
        slot.lock.acquire(blocking=False)
    except filelock.Timeout:
        return _Outcome(None, None)
    try:
        # Opened per attempt (not kept open): NFS close-to-open consistency then hands each holder
        # the previous holder's write, and a state dir removed under a running job is recreated.
        fd = os.open(slot.state_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            data = os.pread(fd, 2 * RECORD_SIZE, 0)
            now = time.time()
            burst = float(slot.bucket.burst)
            state = decode_record(data)
            if state is None:  # new, or corrupt: a full bucket
                tokens, stamp = burst, now
            else:
                tokens, stamp = state
                # A clock that lags the stored time (stepped back, or another host's clock is ahead)
                # refills nothing, and the stored time is kept, so no interval is counted twice.
                tokens = (
                    min(burst, tokens + (now - stamp) * slot.rate)
                    if now > stamp
                    else min(burst, tokens)
                )
                stamp = max(stamp, now)
            if tokens < 1.0:
                return _Outcome(None, (1.0 - tokens) / slot.rate)
            os.pwrite(fd, encode_record(tokens - 1.0, stamp), 0)
            if len(data) != RECORD_SIZE:
                os.ftruncate(fd, RECORD_SIZE)  # a longer corrupt file: drop its tail
            return _Outcome(now, None)
        finally:
            os.close(fd)
    finally:
        slot.lock.release()


class GlobalRateLimiter:
    """Token buckets per key whose state lives in ``state_dir``; see the module docstring."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        limits: Mapping[str, Bucket],
        *,
        acquire_timeout_s: float = 300.0,
    ) -> None:
        if not acquire_timeout_s > 0:
            raise ValueError(f"acquire_timeout_s must be > 0 (got {acquire_timeout_s!r})")
        self.state_dir = Path(state_dir)
        self.acquire_timeout_s = float(acquire_timeout_s)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._slots = {key: _Slot(self.state_dir, key, bucket) for key, bucket in limits.items()}

    @classmethod
    def from_config(cls, cfg: RateLimitsConfig, run_dir: Path) -> GlobalRateLimiter:
        """The limiter of a `tools.rate_limits` section; state in ``cfg.state_dir`` or ``<run_dir>/ratelimit``."""
        state_dir = Path(cfg.state_dir) if cfg.state_dir else Path(run_dir) / "ratelimit"
        limits = {
            key: Bucket(per_minute=float(lim.per_minute), burst=lim.burst)
            for key, lim in cfg.limits.items()
        }
        return cls(state_dir, limits, acquire_timeout_s=cfg.acquire_timeout_s)

    @property
    def limits(self) -> dict[str, Bucket]:
        return {key: slot.bucket for key, slot in self._slots.items()}

    def limits_key(self, key: str) -> bool:
        """Whether `key` has a limit (acquiring any other key returns at once)."""
        return key in self._slots

    __contains__ = limits_key

    def lock_path(self, key: str) -> Path:
        return self._slots[key].lock_path

    def state_path(self, key: str) -> Path:
        return self._slots[key].state_path

    async def acquire(self, key: str, *, timeout_s: float | None = None) -> float:
        """Take one token of `key`; returns the admission time (time.time() value used inside the
        critical section). A key with no configured limit returns at once. Raises RateLimitTimeout."""
        slot = self._slots.get(key)
        if slot is None:
            return time.time()
        steps = self._attempts(slot, timeout_s)
        try:
            while True:
                await anyio.sleep(next(steps))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            steps.close()  # cancelled while sleeping: the generator holds nothing, close it now

    def acquire_blocking(self, key: str, *, timeout_s: float | None = None) -> float:
        """The same for synchronous code (threads, synchronous reward functions)."""
        slot = self._slots.get(key)
        if slot is None:
            return time.time()
        steps = self._attempts(slot, timeout_s)
        try:
            while True:
                time.sleep(next(steps))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def _attempts(self, slot: _Slot, timeout_s: float | None) -> Generator[float, None, float]:
        """Sans-IO acquire: yields the seconds to sleep between attempts (the lock is never held at a
        yield), returns the admission time, raises RateLimitTimeout."""
        timeout = self.acquire_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        poll, losses = _POLL_MIN_S, 0
        # The random delay added after a token is due (see below). While a due token waits, the
        # bucket absorbs burst - 1 more tokens, so up to (burst - 1) / rate of delay loses nothing;
        # with burst 1, a tenth of a token interval (a lone caller then gets >= 95% of the rate).
        jitter = min(_JITTER_MAX_S, max(slot.bucket.burst - 1, 0.1) / slot.rate)
        while True:
            outcome = _try_take(slot)
            if outcome.admitted_at is not None:
                return outcome.admitted_at
            remaining = deadline - time.monotonic()
            if outcome.wait_s is None:  # lock busy: poll, backing off, jittered against lockstep
                delay = poll * (0.5 + random.random())
                poll = min(2 * poll, _POLL_MAX_S)
                if remaining <= 0:
                    raise self._timeout(slot, timeout, f"the lock {slot.lock_path} stayed busy")
                yield min(delay, remaining)
                continue
            # No token: none can be due before wait_s, so fail now if that is past the deadline.
            if outcome.wait_s > remaining:
                raise self._timeout(
                    slot, timeout, f"the next token is due in {outcome.wait_s:.3g} s"
                )
            # Every waiter computed the same due time; whoever wakes first wins, and without jitter
            # that is always the caller with the least wake-up latency (time.sleep beats an event
            # loop's millisecond timers), so others would starve. A random delay makes the winner
            # random, and a window narrowed by each loss favours long waiters (roughly first come,
            # first served, with no queue).
            delay = outcome.wait_s + random.random() * jitter / (1 + losses)
            poll, losses = _POLL_MIN_S, losses + 1
            yield min(delay, remaining)

    def _timeout(self, slot: _Slot, timeout: float, why: str) -> RateLimitTimeout:
        return RateLimitTimeout(
            f"rate limit {slot.key!r} ({slot.bucket.per_minute:g}/min, burst {slot.bucket.burst}): no "
            f"token within the timeout of {timeout:g} s ({why}); state dir {self.state_dir}, shared by "
            f"every process using this limit (raise tools.rate_limits.acquire_timeout_s or the limit)"
        )

    def __repr__(self) -> str:
        return f"GlobalRateLimiter({str(self.state_dir)!r}, {self.limits!r})"


_shared: GlobalRateLimiter | None = None


def set_shared(limiter: GlobalRateLimiter | None) -> None:
    """Install (or, with None, remove) the process-wide limiter returned by `shared`."""
    global _shared
    _shared = limiter


def shared() -> GlobalRateLimiter | None:
    """The process-wide limiter the rollout server configured (for reward functions that call external APIs)."""
    return _shared
