"""tools/chaos/netproxy: the chaos run's network, on real loopback sockets: bytes carried in order,
held across a partition, delayed, and reset with an RST."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tools.chaos.netproxy import FaultProxy


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    """A proxy in front of an echo server."""
    listener = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=echo, daemon=True).start()
    p = FaultProxy(listener.getsockname()[1], seed=1).start()
    yield p
    p.stop()
    listener.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            return


def _client(p: FaultProxy) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    deadline = time.monotonic() + 5
    while not p.links() and time.monotonic() < deadline:
        time.sleep(0.01)
    return c


def _round_trip(c: socket.socket, payload: bytes) -> float:
    t0 = time.monotonic()
    c.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += c.recv(65536)
    assert got == payload
    return time.monotonic() - t0


def test_carries_bytes_in_order_both_ways(proxy: FaultProxy) -> None:
    with _client(proxy) as c:
        payload = bytes(range(256)) * 4096  # 1 MiB
        assert _round_trip(c, payload) < 2.0
        # the proxy counts a chunk after writing it on: the last one may reach the client first
        deadline = time.monotonic() + 5
        while proxy.links()[0].carried < 2 * len(payload) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.links()[0].carried >= 2 * len(payload)


def test_a_partition_holds_everything_until_it_ends(proxy: FaultProxy) -> None:
    with _client(proxy) as c:
        proxy.partition(proxy.links()[0], 1.0)
        assert _round_trip(c, b"x" * 1000) >= 0.9
        assert _round_trip(c, b"y") < 0.5  # healed


def test_a_delay_holds_each_way(proxy: FaultProxy) -> None:
    with _client(proxy) as c:
        proxy.impair(proxy.links()[0], 5.0, delay_s=0.2)
        assert 0.35 <= _round_trip(c, b"z" * 10) < 1.5


def test_loss_costs_retransmission_timeouts_in_order(proxy: FaultProxy) -> None:
    with _client(proxy) as c:
        proxy.impair(proxy.links()[0], 30.0, loss=1.0)  # every chunk "lost" once
        assert _round_trip(c, b"w" * 100) >= 0.4  # two timeouts of 0.2-1 s


def test_a_reset_ends_the_connection_with_an_rst(proxy: FaultProxy) -> None:
    with _client(proxy) as c:
        proxy.reset(proxy.links()[0])
        with pytest.raises(ConnectionResetError):
            for _ in range(50):
                c.sendall(b"after the reset")
                if not c.recv(100):
                    raise AssertionError("a FIN, not an RST")
                time.sleep(0.02)
