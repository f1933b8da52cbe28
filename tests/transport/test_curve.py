"""CURVE on the ZeroMQ channels: allowed keys get in, everyone else never sees a WELCOME.

Keys are made with ``tools.curve_keys`` (what ``bin/make-curve-keys`` runs). Refusal happens below
the protocol (ZAP denies the CURVE handshake), so a refused client just never hears back: the
tests wait a short while for a WELCOME that must not come and check the learner saw no PeerJoined.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest
import zmq
from transport_testkit import ZmqNet, client_running, learner_running, make_batch, submit_all

from protocol import zmq_auth
from protocol.zmq_auth import CurveClientKeys, CurveServerKeys
from protocol.zmq_transport import ZmqClientChannel, client_factory
from tools.curve_keys import make_keys

pytestmark = pytest.mark.anyio

REFUSAL_WAIT_S = 1.5


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    made = {
        name: make_keys(tmp_path / "keys", name)
        for name in ("learner", "rollout", "intruder", "impostor")
    }
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(made["rollout"][0], allowed)  # only the rollout server's public key is allowed
    made["allowed"] = (allowed, allowed)
    return made


@pytest.fixture
def net() -> ZmqNet:
    return ZmqNet()


def _server_keys(keys: dict[str, tuple[Path, Path]]) -> CurveServerKeys:
    return CurveServerKeys(secret_key_file=keys["learner"][1], allowed_keys_dir=keys["allowed"][0])


def _client_keys(
    keys: dict[str, tuple[Path, Path]], who: str, server: str = "learner"
) -> CurveClientKeys:
    return CurveClientKeys(secret_key_file=keys[who][1], server_public_key_file=keys[server][0])


async def test_allowed_client_handshakes_and_delivers(keys: dict, net: ZmqNet) -> None:
    server = net.server("tcp://127.0.0.1:0", curve=_server_keys(keys))
    connect = client_factory(server.address, curve=_client_keys(keys, "rollout"))
    async with learner_running(server) as lh, client_running(connect) as ch:
        seqs = await submit_all(ch.client, [make_batch(3, tag="curve")])
        await ch.watch.until(lambda: ch.acked() == set(seqs), timeout=10)
        assert ch.connected() == 1 and lh.joined() == 1
        assert len(lh.received) == 3
    assert server.sock.closed
    net.term()


async def test_unknown_key_wrong_server_key_and_plain_clients_are_refused(
    keys: dict, net: ZmqNet
) -> None:
    server = net.server("tcp://127.0.0.1:0", curve=_server_keys(keys))
    refused = {
        # not allowed
        "intruder": client_factory(server.address, curve=_client_keys(keys, "intruder")),
        # an allowed key that trusts the wrong learner key: the client refuses the server
        "impostor": client_factory(
            server.address, curve=_client_keys(keys, "rollout", server="impostor")
        ),
        "plain": client_factory(server.address),  # no CURVE at all
    }
    async with learner_running(server) as lh:
        async with (
            client_running(refused["intruder"], peer_id="intruder") as c1,
            client_running(refused["impostor"], peer_id="impostor") as c2,
            client_running(refused["plain"], peer_id="plain") as c3,
        ):
            await submit_all(c1.client, [make_batch(1)])
            await anyio.sleep(REFUSAL_WAIT_S)  # waiting for something that must not happen
            for c in (c1, c2, c3):
                assert c.connected() == 0, "a refused client got a WELCOME"
        assert lh.joined() == 0 and not lh.received and not lh.proto.peers
        # ...while an allowed client still gets in through the same socket.
        async with client_running(
            client_factory(server.address, curve=_client_keys(keys, "rollout"))
        ) as ok:
            await ok.watch.until(lambda: ok.connected() == 1, timeout=10)
        assert lh.joined() == 1
    net.term()


async def test_two_curve_learners_in_one_context_keep_their_own_allow_lists(
    keys: dict, net: ZmqNet, tmp_path: Path
) -> None:
    """libzmq has one ZAP handler per context; each server channel still gets its own allow-list."""
    other_allowed = tmp_path / "other-allowed"
    other_allowed.mkdir()
    shutil.copy(keys["intruder"][0], other_allowed)
    first = net.server("tcp://127.0.0.1:0", curve=_server_keys(keys))
    second = net.server(
        "tcp://127.0.0.1:0", curve=CurveServerKeys(keys["learner"][1], other_allowed)
    )
    async with learner_running(first) as l1, learner_running(second) as l2:
        async with (
            client_running(client_factory(first.address, curve=_client_keys(keys, "rollout"))) as a,
            client_running(
                client_factory(second.address, curve=_client_keys(keys, "intruder"))
            ) as b,
            client_running(
                client_factory(first.address, curve=_client_keys(keys, "intruder")), peer_id="cross"
            ) as cross,
        ):
            await a.watch.until(lambda: a.connected() == 1, timeout=10)
            await b.watch.until(lambda: b.connected() == 1, timeout=10)
            with anyio.move_on_after(0.5):
                await cross.watch.until(lambda: cross.connected() > 0)
            assert cross.connected() == 0, "the second learner's allow-list leaked into the first's"
        assert l1.joined() == 1 and l2.joined() == 1
    assert not zmq_auth._zap, "the shared authenticator outlived its last channel"
    net.term()


@pytest.mark.filterwarnings("error::ResourceWarning")
async def test_bad_keys_fail_early_and_leave_nothing_behind(
    keys: dict, net: ZmqNet, tmp_path: Path
) -> None:
    public_only = CurveServerKeys(
        secret_key_file=keys["learner"][0], allowed_keys_dir=keys["allowed"][0]
    )
    with pytest.raises(ValueError, match="no secret key"):
        net.server("tcp://127.0.0.1:0", curve=public_only)
    with pytest.raises(FileNotFoundError, match="allowed keys directory"):
        net.server(
            "tcp://127.0.0.1:0", curve=CurveServerKeys(keys["learner"][1], tmp_path / "missing")
        )
    with pytest.raises(FileNotFoundError, match="key file not found"):
        net.server(
            "tcp://127.0.0.1:0", curve=CurveServerKeys(tmp_path / "nope", keys["allowed"][0])
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no public keys"):
        net.server(
            "tcp://127.0.0.1:0", curve=CurveServerKeys(keys["learner"][1], tmp_path / "empty")
        )
    with pytest.raises(FileNotFoundError, match="key file not found"):
        ZmqClientChannel(
            "tcp://127.0.0.1:1",
            context=net.ctx,
            curve=CurveClientKeys(keys["rollout"][1], tmp_path / "no-server-key"),
        )
    # A failed bind (address in use) leaves no socket and no allow-list behind either.
    first = net.server("tcp://127.0.0.1:0", curve=_server_keys(keys))
    with pytest.raises(zmq.ZMQError):
        net.server(first.address, curve=_server_keys(keys))
    assert len(zmq_auth._zap[id(net.ctx)][2]) == 1
    await first.aclose()
    assert not zmq_auth._zap
    net.term()
