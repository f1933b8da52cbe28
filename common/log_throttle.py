"""Rate-limited logging of what peers get wrong: a flood of bad input costs a few lines, not megabytes.

``PeerErrorLog`` keeps one window per (peer, error code): the first ``burst`` events of a window
are logged in full, the rest only counted, and when the window ends one summary line says how many
were suppressed ("suppressed N ..."). Every event is counted for the metrics whether logged or not
(``counts``, per code). The clock is explicit and the class does no I/O besides calling the
logger, so it is cheap to test; the owner calls ``flush`` now and then (a timer) so a summary is
not held back until the next event. The number of tracked keys is bounded too (a peer can invent
identities): past ``max_keys`` the new ones share one "other peers" key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OTHER_PEERS = "(other peers)"


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0


class PeerErrorLog:
    """``log(peer, code, now, **fields)``: at most ``burst`` lines per (peer, code) per ``window_s``,
    then a summary line per window that suppressed any. ``emit(message, **fields)`` writes a line."""

    def __init__(
        self,
        emit: Callable[..., Any],
        *,
        what: str = "invalid messages",
        burst: int = 5,
        window_s: float = 60.0,
        max_keys: int = 1024,
    ) -> None:
        self.emit, self.what, self.burst, self.window_s, self.max_keys = (
            emit,
            what,
            burst,
            window_s,
            max_keys,
        )
        self._windows: dict[tuple[str, str], _Window] = {}
        self.counts: Counter[str] = Counter()  # code -> events, logged or not
        self.suppressed_total = 0

    def log(self, peer: str, code: str, now: float, message: str, **fields: Any) -> bool:
        """Count one event; True when it was logged in full."""
        self.counts[code] += 1
        key = (peer, code)
        if key not in self._windows and len(self._windows) >= self.max_keys:
            key = (OTHER_PEERS, code)
        w = self._windows.get(key)
        if w is not None and now - w.start >= self.window_s:
            self._summary(key, w)
            w = None
        if w is None:
            w = self._windows[key] = _Window(now)
        if w.logged < self.burst:
            w.logged += 1
            self.emit(message, peer=peer, code=code, **fields)
            return True
        w.suppressed += 1
        self.suppressed_total += 1
        return False

    def flush(self, now: float, *, all_windows: bool = False) -> None:
        """Write the summary of every window that has ended (``all_windows``: of every window, as
        at shutdown) and forget those windows."""
        for key, w in list(self._windows.items()):
            if all_windows or now - w.start >= self.window_s:
                self._summary(key, w)
                del self._windows[key]

    def _summary(self, key: tuple[str, str], w: _Window) -> None:
        if w.suppressed:
            self.emit(
                f"suppressed {w.suppressed} {self.what}",
                peer=key[0],
                code=key[1],
                suppressed=w.suppressed,
                logged=w.logged,
                window_s=self.window_s,
            )
