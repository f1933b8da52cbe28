"""The learner link's peer logs: invalid messages, errors peers report, connections refused.

Design: what a peer does wrong must never cost the learner more than a few log lines, however
often it does it. Each kind has its own ``common.log_throttle.PeerErrorLog``: one window per
(peer, code), so a flood of bad frames costs a few lines and a summary, and a wrong-token client
reconnecting every 100 ms a few lines a minute. Everything is counted, logged or not: the counts
are the ``intake/violations*`` metrics and part of the link's stats. ``flush_every`` (a task of the
link) brings the summaries of suppressed lines out within a window's end.
"""

from __future__ import annotations

import time

import anyio
import structlog

from common.log_throttle import PeerErrorLog
from protocol.events import PeerError, ProtocolViolation

# What a refusal is logged as, by its code, where not a refused handshake.
_REFUSALS = {"TOO_LARGE": "connection cut: libzmq held more of it than its credits allow"}


class PeerLogs:
    def __init__(self, log: structlog.stdlib.BoundLogger, auth: str) -> None:
        """``log``: the link's logger; ``auth``: the run's auth mode (``transport.auth``), named
        with every refused connection."""
        self._auth = auth
        self.violations = PeerErrorLog(log.warning, what="invalid messages")
        self.errors = PeerErrorLog(log.warning, what="errors reported by peers")
        self.refusals = PeerErrorLog(log.warning, what="connections refused")
        self.counts = {"violations": 0, "refused_connections": 0}

    def on_violation(self, ev: ProtocolViolation) -> None:
        self.counts["violations"] += 1
        self.violations.log(
            ev.peer_id,
            ev.error.code.name,
            time.monotonic(),
            "invalid message",
            error=ev.error.message[:300],
            field=ev.error.field,
        )

    def on_error(self, ev: PeerError) -> None:
        self.errors.log(
            ev.peer_id,
            str(ev.error.code),
            time.monotonic(),
            "peer reported an error",
            error=ev.error.message[:300],
        )

    def refused(self, address: str, code: str, reason: str) -> None:
        """A peer failed ZeroMQ's handshake (wrong or missing token or key): nothing of it was
        buffered; or its connection was cut for what libzmq held of it (``TOO_LARGE``, SPEC §13).
        Counted, and logged per address through the limiter."""
        self.counts["refused_connections"] += 1
        self.refusals.log(
            address or "(unknown)",
            code,
            time.monotonic(),
            _REFUSALS.get(code, "connection refused at the handshake"),
            reason=reason[:100],
            auth=self._auth,
        )

    def flush(self, *, all_windows: bool = False) -> None:
        for log in (self.violations, self.errors, self.refusals):
            log.flush(time.monotonic(), all_windows=all_windows)

    async def flush_every(self, every_s: float = 10.0) -> None:
        """Summaries of suppressed peer errors come out within ``every_s`` of their window's end."""
        while True:
            await anyio.sleep(every_s)
            self.flush()

    def stats(self) -> dict[str, int]:
        """The counts for the link's stats: every invalid message, per code too."""
        return {
            "violations": self.counts["violations"],
            "refused_connections": self.counts["refused_connections"],
            **{f"violations_{c.lower()}": n for c, n in sorted(self.violations.counts.items())},
            "violations_log_suppressed": self.violations.suppressed_total,
        }

    def metrics(self) -> dict[str, float]:
        """``intake/violations/<CODE>``: invalid messages refused so far, per error code (every one,
        logged or not); ``intake/violations_log_suppressed``: those not logged in full."""
        out = {
            f"intake/violations/{c}": float(n) for c, n in sorted(self.violations.counts.items())
        }
        out["intake/violations"] = float(self.counts["violations"])
        out["intake/violations_log_suppressed"] = float(self.violations.suppressed_total)
        out["intake/refused_connections"] = float(self.counts["refused_connections"])
        return out
