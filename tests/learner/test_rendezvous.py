"""`learner.rendezvous`: ranks of one machine meet through a file store and keep gloo's and NCCL's
sockets on loopback; ranks across machines use the TCP store and the interface the user names.
(The listening sockets of a real 2-rank group are read in test_ray_loopback.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil

from learner import rendezvous


def test_one_machine_puts_gloo_and_nccl_on_loopback() -> None:
    method = rendezvous.init_method(one_machine=True)
    assert method.startswith("file://")
    shutil.rmtree(Path(method.removeprefix("file://")).parent)
    env: dict[str, str] = {}
    assert rendezvous.use_loopback(method, env) == env
    lo = rendezvous.loopback_interface()
    assert env == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    addrs = psutil.net_if_addrs()[lo]
    assert any(a.address == "127.0.0.1" for a in addrs)


def test_an_interface_the_user_named_is_kept() -> None:
    env = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": ""}
    rendezvous.use_loopback("file:///tmp/x/store", env)
    assert env == {
        "NCCL_SOCKET_IFNAME": "ib0",
        "GLOO_SOCKET_IFNAME": rendezvous.loopback_interface(),
    }


def test_ranks_on_several_machines_are_left_alone() -> None:
    env: dict[str, str] = {}
    method = rendezvous.init_method(one_machine=False)
    assert method.startswith("tcp://")
    assert rendezvous.use_loopback(method, env) == {} and env == {}
