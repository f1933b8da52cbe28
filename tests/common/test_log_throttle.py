"""common.log_throttle: at most ``burst`` lines per (peer, code) per window, then a summary line."""

from __future__ import annotations

from typing import Any

from common.log_throttle import OTHER_PEERS, PeerErrorLog


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, message: str, **fields: Any) -> None:
        self.lines.append((message, fields))


def test_a_flood_costs_burst_lines_and_one_summary_per_window() -> None:
    out = Lines()
    log = PeerErrorLog(out, burst=3, window_s=10.0)
    for i in range(1000):
        log.log("p", "MALFORMED", 0.001 * i, "invalid message")
    assert len(out.lines) == 3 and log.suppressed_total == 997 and log.counts["MALFORMED"] == 1000
    log.flush(5.0)
    assert len(out.lines) == 3  # the window has not ended
    log.flush(10.5)
    message, fields = out.lines[-1]
    assert (
        message == "suppressed 997 invalid messages"
        and fields["peer"] == "p"
        and fields["suppressed"] == 997
    )
    log.log("p", "MALFORMED", 11.0, "invalid message")
    assert len(out.lines) == 5  # a new window logs again


def test_windows_are_per_peer_and_code() -> None:
    out = Lines()
    log = PeerErrorLog(out, burst=1, window_s=10.0)
    for key in [("a", "X"), ("a", "Y"), ("b", "X"), ("a", "X")]:
        log.log(*key, 0.0, "m")
    assert [f["peer"] + f["code"] for _, f in out.lines] == ["aX", "aY", "bX"]
    log.log("a", "X", 20.0, "m")  # the expired window is summed up first
    assert out.lines[-2][0] == "suppressed 1 invalid messages" and out.lines[-1][0] == "m"


def test_invented_identities_share_one_key() -> None:
    out = Lines()
    log = PeerErrorLog(out, burst=1, window_s=10.0, max_keys=4)
    for i in range(100):
        log.log(f"peer-{i}", "X", 0.0, "m")
    assert len(out.lines) == 5 and len(log._windows) == 5
    log.flush(0.0, all_windows=True)
    assert out.lines[-1][1]["peer"] == OTHER_PEERS and out.lines[-1][1]["suppressed"] == 95
