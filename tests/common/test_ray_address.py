"""Which Ray addresses `common.ray_auth.join` treats as a cluster on loopback (one that
`start_local` made): those it must join on loopback, as Ray would otherwise turn 127.0.0.1 into
this machine's routable address."""

from __future__ import annotations

import pytest

from common.ray_auth import _on_loopback


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:6379", True),
        ("localhost:6379", True),
        ("[::1]:6379", True),
        ("127.0.1.1:40000", True),
        ("10.0.0.5:6379", False),
        ("head-node:6379", False),
        ("192.0.2.2:39703", False),
    ],
)
def test_loopback_addresses(address: str, loopback: bool) -> None:
    assert _on_loopback(address) is loopback
