"""Connections stalled in ZeroMQ's handshake hold little of a real bin/learner (issue 37, SPEC §13).

libzmq allocates each incoming frame at its announced size (up to MAXMSGSIZE) and keeps what
arrives, also before authentication. The learner's frame bound is ``MAX_FRAME_BYTES`` (peers split
larger frames, SPEC §2) and its ``HandshakeGuard`` caps connections in the handshake per source and
in all, so 1,000 raw TCP connections that each send a CURVE greeting and then all but the last byte
of the largest frame the learner accepts, and stall, hold a bounded amount: measured here as the
learner's RSS growth, while a peer holding the token is served.
"""

from __future__ import annotations

import os
import resource
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostile_testkit import LearnerProcess, MiB, RssWatch, serves_a_valid_peer

from protocol.limits import MAX_FRAME_BYTES
from protocol.zmq_transport import ENVELOPE_BYTES

pytestmark = pytest.mark.integration
CONNECTIONS = 1000
SOURCES = 25  # attacker addresses 127.0.1.1-25, 40 each: the total cap binds, not the per-source
RSS_BOUND = 100 * 1000 * 1000  # the bound: 100 MB

# ZMTP 3.0 greeting of a CURVE client (signature, version 3.0, mechanism, as-server 0, filler).
GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes((3, 0)) + b"CURVE".ljust(20, b"\0") + bytes(32)
# A long command frame (flags 0x06) announcing the largest size the learner accepts, all but its
# last byte sent: libzmq allocates the frame and keeps what arrived until the handshake deadline.
FRAME = MAX_FRAME_BYTES + ENVELOPE_BYTES  # the learner's MAXMSGSIZE
STALLED_FRAME = b"\x06" + struct.pack(">Q", FRAME) + bytes(FRAME - 1)


@pytest.fixture(scope="module")
def learner(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LearnerProcess]:
    tmp = tmp_path_factory.mktemp("stalled")
    lp = LearnerProcess(tiny_model, tmp / "run")
    try:
        yield lp
    finally:
        lp.stop()


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _stall(address: str, source: str) -> socket.socket | None:
    """A connection from ``source`` that sent the greeting and most of a frame; None when the
    learner shut it before it was sent (over its caps)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = socket.socket()
    s.settimeout(5.0)
    try:
        s.bind((source, 0))
        s.connect((host, int(port)))
        s.sendall(GREETING + STALLED_FRAME)
    except OSError:
        s.close()
        return None
    return s


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_thousand_stalled_handshakes_hold_under_100_mb(learner: LearnerProcess) -> None:
    _raise_fd_limit(CONNECTIONS + 256)
    serves_a_valid_peer(learner, "before")  # the learner's own growth at its first connection
    time.sleep(0.5)
    watch = RssWatch(learner)
    held: list[socket.socket] = []
    files0, files = _open_files(learner.proc.pid), 0
    t0 = time.monotonic()
    try:
        for i in range(CONNECTIONS):
            s = _stall(learner.address, f"127.0.1.{1 + i % SOURCES}")
            if s is not None:
                held.append(s)
            if i % 50 == 0:
                watch.sample()
                files = max(files, _open_files(learner.proc.pid) - files0)
        opened_s = time.monotonic() - t0
        watch.sample_for(0.5)
        # a peer holding the token is served while the stalled connections are held
        files = max(files, _open_files(learner.proc.pid) - files0)
        serves_a_valid_peer(learner, "during")
        watch.sample_for(0.5)
        print(
            f"\n{CONNECTIONS} stalled handshakes ({MAX_FRAME_BYTES >> 10} KiB frames) opened in "
            f"{opened_s:.1f} s, at most {files} held by the learner at once: learner RSS +{watch.growth / MiB:.1f} MiB (peak)"
        )
        assert watch.growth < RSS_BOUND, f"RSS grew by {watch.growth / MiB:.0f} MiB"
        # the bound held with the connections in place, not because they were refused at once
        assert files >= CONNECTIONS // 2, f"the learner held at most {files} connections at once"
    finally:
        for s in held:
            s.close()
    serves_a_valid_peer(learner, "after")
