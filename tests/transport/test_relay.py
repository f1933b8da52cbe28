"""The weight relay tier (protocol 1.4) over real ZeroMQ on loopback, relays as real child processes
(``bin/weight-relay``), each standing for one host (``--host``); rollout servers are in-process
``RolloutClient``s that offer "weights_file" and check every byte of the file they are handed.

Covered: the learner sends a version once and it reaches every host down the chain with every
checksum verified; a relay SIGKILLed mid-transfer and the relay behind it still getting the
version; a late joiner and a restarted server getting the newest version at once; a server without
the capability still served with chunks straight from the learner; a LoRA adapter-only version
(SPEC §8) forwarded like any other and accepted by a server whose model serves adapters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from transport_testkit import ClientHandle, ZmqNet, client_running, learner_running

from common.safetensors_buffers import load_file
from protocol import codec
from protocol.adapters import adapter_name
from protocol.events import PeerTimedOut, PeerWeightsApplied, WeightsReceived
from protocol.messages import WEIGHTS_FILE_CAPABILITY, MsgType
from protocol.weights import ModelManifest, NamedBuffer, WeightAssembler, plan_transfer

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def net() -> Iterator[ZmqNet]:
    n = ZmqNet()
    yield n
    n.term()


def tensors(version: int, mb: float = 2.0) -> list[NamedBuffer]:
    rng = np.random.default_rng(version)
    n = int(mb * (1 << 20)) // 4
    arrays = {
        "model.embed.weight": rng.standard_normal(n // 2, dtype=np.float32),
        "model.layer.0.w": rng.standard_normal(n // 4, dtype=np.float32),
        "model.layer.0.b": rng.integers(0, 1 << 30, n // 4, dtype=np.int32),
        "model.norm": rng.standard_normal(7).astype(np.float16),
    }
    return [
        NamedBuffer(k, str(a.dtype), a.shape, memoryview(a).cast("B")) for k, a in arrays.items()
    ]


MODULES = {
    "model.layers.0.self_attn.q_proj": (4096, 1024),
    "model.layers.0.mlp.up_proj": (2048, 1024),
}
LORA_MODEL = ModelManifest(
    {f"{m}.weight": ("bfloat16", shape) for m, shape in MODULES.items()}, lora_max_rank=16
)


def adapter(version: int) -> list[NamedBuffer]:
    """A rank-8 LoRA adapter of ``MODULES``, named as peft saves one (what a LoRA learner sends)."""
    rng = np.random.default_rng(version)
    arrays = {}
    for module, (out, inp) in MODULES.items():
        arrays[adapter_name(module, "A")] = rng.standard_normal((8, inp), dtype=np.float32)
        arrays[adapter_name(module, "B")] = rng.standard_normal((out, 8), dtype=np.float32)
    return [
        NamedBuffer(k, str(a.dtype), a.shape, memoryview(a).cast("B")) for k, a in arrays.items()
    ]


def num_chunks(ts: list[NamedBuffer]) -> int:
    return plan_transfer(0, ts, chunk_bytes=CHUNK)[0].num_chunks


class CountingChannel:
    """The learner's channel, counting the WEIGHTS_CHUNK messages it sends to each peer."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.address = inner, inner.address
        self.chunks: Counter[bytes] = Counter()

    async def send(self, identity: bytes, frames: list[Any]) -> None:
        if codec.peek_type(frames) is MsgType.WEIGHTS_CHUNK:
            self.chunks[identity] += 1
        await self.inner.send(identity, frames)

    async def recv(self) -> tuple[bytes, list[Any]]:
        return await self.inner.recv()

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def relays(
    lh: Any, hosts: list[str], tmp: Path, **extra: list[str]
) -> AsyncIterator[dict[str, subprocess.Popen[str]]]:
    """One relay process per host, started in order, each once the one before it has joined: the
    chain is ``hosts`` in that order."""
    procs: dict[str, subprocess.Popen[str]] = {}
    before = len(relay_ids(lh))
    try:
        for i, h in enumerate(hosts):
            (tmp / h).mkdir(exist_ok=True)
            procs[h] = subprocess.Popen(
                [sys.executable, str(ROOT / "bin/weight-relay"), "--learner", lh.channel.address,
                 "--bind", "tcp://127.0.0.1:0", "--host", h, "--peer-id", f"relay-{h}",
                 "--weights-dir", str(tmp / h), *extra.get(h, [])],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=open(tmp / f"relay-{h}.log", "w"),
                text=True, start_new_session=True,
            )  # fmt: skip
            await lh.watch.until(lambda i=i: len(relay_ids(lh)) == before + i + 1, 30)
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if p.stdout is not None:
                p.stdout.close()


@asynccontextmanager
async def server(
    net: ZmqNet,
    address: str,
    host: str,
    tmp: Path,
    *,
    peer_id: str = "",
    files: bool = True,
    mb: float = 2.0,
    token: str | None = None,
    roots: list[str] | None = None,
    want: Callable[[int], list[NamedBuffer]] | None = None,
    manifest: ModelManifest | None = None,
) -> AsyncIterator[tuple[ClientHandle, dict[int, str]]]:
    """A rollout server on ``host`` that applies what it receives once every byte is checked
    against ``want(version)`` (default ``tensors(version, mb)``), announces checked against
    ``manifest`` when given; yields it and {version: the file it came in ("" chunks)}."""
    applied: dict[int, str] = {}
    expected = want or (lambda v: tensors(v, mb))
    conn_kw = {
        "capabilities": [WEIGHTS_FILE_CAPABILITY] if files else [],
        "host": host,
        "weights": WeightAssembler(
            manifest=manifest, file_roots=[str(tmp / host)] if roots is None else roots
        ),
    }
    async with client_running(
        net.connector(address, token=token), peer_id=peer_id or f"server-{host}", request_weights=True,
        conn_kw=conn_kw,
    ) as ch:  # fmt: skip

        async def apply() -> None:
            done = 0
            while True:
                await ch.watch.until(lambda d=done: len(ch.watch.of(WeightsReceived)) > d, 1e9)
                for ev in ch.watch.of(WeightsReceived)[done:]:
                    w = ev.weights
                    if w.file:
                        got = {t.name: bytes(t.data) for t in load_file(Path(w.file))}
                    else:
                        got = {s.name: bytes(b) for s, b in w.tensors}
                    wanted = {t.name: bytes(t.data) for t in expected(w.version)}
                    assert got == wanted, f"version {w.version} differs"
                    applied[w.version] = w.file
                    ch.client.weights_applied(w.version, w.transfer_id, ok=True)
                    ch.watch.notify()
                done = len(ch.watch.of(WeightsReceived))

        async with anyio.create_task_group() as tg:
            tg.start_soon(apply)
            yield ch, applied
            tg.cancel_scope.cancel()


def relay_ids(lh: Any) -> dict[str, bytes]:
    return {r.peer_id: ident for ident, r in lh.proto.relays.relays.items()}


async def test_chain_forwards_each_version_once_with_checksums(net: ZmqNet, tmp_path: Path) -> None:
    ch = CountingChannel(net.server("tcp://127.0.0.1:0"))
    hosts = ["hostA", "hostB", "hostC"]
    async with learner_running(ch, host="learner-host") as lh:
        async with relays(lh, hosts, tmp_path):
            chain = list(lh.proto.relays.relays.values())
            assert [r.upstream for r in chain] == ["", chain[0].address, chain[1].address]
            async with (
                server(net, ch.address, "hostA", tmp_path) as (_, a),
                server(net, ch.address, "hostB", tmp_path) as (_, b),
                server(net, ch.address, "hostC", tmp_path) as (sc, c),
            ):
                for v in (1, 2):
                    before = sum(ch.chunks.values())
                    lh.server.publish_weights(v, tensors(v), chunk_bytes=CHUNK)
                    await lh.watch.until(lambda v=v: all(v in x for x in (a, b, c)), 30)
                    n = num_chunks(tensors(v))
                    # sent once, to the head of the chain; every host got it as a verified file
                    assert sum(ch.chunks.values()) - before == n
                    for host, got in zip(hosts, (a, b, c), strict=True):
                        assert f"/{host}/agentrl-weights-" in got[v]
                assert set(ch.chunks) == {relay_ids(lh)["relay-hostA"]}
                await sc.watch.until(lambda: sc.client.conn.policy_version == 2)
                # a relay that joins late gets the newest version from the relay before it (kept
                # in that relay's verified file), and so does its host's server
                async with (
                    relays(lh, ["hostD"], tmp_path),
                    server(net, ch.address, "hostD", tmp_path) as (_, d),
                ):
                    await lh.watch.until(lambda: 2 in d, 30)
                    assert "/hostD/agentrl-weights-" in d[2] and 1 not in d
                assert set(ch.chunks) == {relay_ids(lh)["relay-hostA"]}


async def test_an_adapter_goes_down_the_chain_as_full_weights_do(
    net: ZmqNet, tmp_path: Path
) -> None:
    """LoRA's adapter-only versions: the relays never read names; the last host's server checks
    each against a model that serves adapters and gets it as its relay's verified file."""
    ch = CountingChannel(net.server("tcp://127.0.0.1:0"))
    async with learner_running(ch, host="learner-host") as lh:
        async with (
            relays(lh, ["hostA", "hostB"], tmp_path),
            server(net, ch.address, "hostB", tmp_path, want=adapter, manifest=LORA_MODEL) as (
                _,
                got,
            ),
        ):
            for v in (1, 2):
                lh.server.publish_weights(v, adapter(v), chunk_bytes=CHUNK)
                await lh.watch.until(lambda v=v: v in got, 30)
                assert "/hostB/agentrl-weights-" in got[v]
            n = num_chunks(adapter(1))
            assert n > 1 and ch.chunks == Counter({relay_ids(lh)["relay-hostA"]: 2 * n})


async def test_relay_killed_mid_transfer_downstream_still_gets_version(
    net: ZmqNet, tmp_path: Path
) -> None:
    ch = CountingChannel(net.server("tcp://127.0.0.1:0"))
    extra = {"hostA": ["--stall-after-chunks", "40"]}
    async with learner_running(ch, host="learner-host") as lh:
        async with relays(lh, ["hostA", "hostB"], tmp_path, **extra) as procs:
            async with (
                server(net, ch.address, "hostA", tmp_path, mb=8.0) as (_, a),
                server(net, ch.address, "hostB", tmp_path, mb=8.0) as (_, b),
            ):
                lh.server.publish_weights(1, tensors(1, mb=8.0), chunk_bytes=CHUNK)
                out = procs["hostA"].stdout
                assert out is not None
                with anyio.fail_after(30):  # the head forwarded 40 chunks and stopped there
                    while "stalled" not in await anyio.to_thread.run_sync(out.readline):
                        pass
                ids = relay_ids(lh)
                assert ch.chunks[ids["relay-hostB"]] == 0 and 1 not in b
                os.killpg(procs["hostA"].pid, signal.SIGKILL)
                await lh.watch.until(lambda: bool(lh.watch.of(PeerTimedOut)), 30)
                # hostB's relay is the head now: re-attached to the learner, it completes the
                # version (the 40 chunks it had are skipped) and hands it to its server
                await lh.watch.until(lambda: 1 in b, 30)
                assert ch.chunks[ids["relay-hostB"]] == num_chunks(tensors(1, mb=8.0))
                assert "/hostB/agentrl-weights-" in b[1]
                # hostA has no relay any more: its server gets the version as chunks, directly
                await lh.watch.until(lambda: 1 in a, 30)
                assert a[1] == ""


async def test_late_joiner_and_restarted_server_get_newest_at_once(
    net: ZmqNet, tmp_path: Path
) -> None:
    ch = CountingChannel(net.server("tcp://127.0.0.1:0"))
    async with learner_running(ch, host="learner-host") as lh:
        async with relays(lh, ["hostA"], tmp_path):
            for v in (1, 2):
                lh.server.publish_weights(v, tensors(v), chunk_bytes=CHUNK)

            def relay_has(v: int) -> bool:
                return any(
                    isinstance(e, PeerWeightsApplied) and e.applied.version == v and e.applied.file
                    for e in lh.watch.events
                )

            await lh.watch.until(lambda: relay_has(2), 30)
            for attempt in range(2):  # a late joiner, then the same server restarted
                with anyio.fail_after(5):
                    async with server(net, ch.address, "hostA", tmp_path) as (s, got):
                        await s.watch.until(lambda: 2 in got, 5)
                        assert list(got) == [2], attempt  # the newest, and only it
                        await s.close()
            assert set(ch.chunks) == {relay_ids(lh)["relay-hostA"]}  # no chunks to any server


async def test_relays_present_the_learners_token_and_serve_only_its_holders(
    net: ZmqNet, tmp_path: Path
) -> None:
    """With the token, every link is token CURVE: relay to learner, and relay to relay (hostB
    pulls from hostA). A peer at hostA's relay address without the token, or with another one,
    never completes the handshake, so it can neither take the weights nor pose as an upstream."""
    import zmq

    from protocol.messages import WEIGHT_RELAY_CAPABILITY, Hello, Identity
    from protocol.version import PROTOCOL_VERSION
    from protocol.zmq_auth import use_token

    (tmp_path / "learner.token").write_text("s3cret-token\n")
    ch = net.server("tcp://127.0.0.1:0", token="s3cret-token")
    async with learner_running(ch, host="learner-host") as lh:
        tok = ["--token-file", str(tmp_path / "learner.token")]
        async with relays(lh, ["hostA", "hostB"], tmp_path, hostA=tok, hostB=tok) as procs:
            async with (
                server(net, ch.address, "hostA", tmp_path, token="s3cret-token") as (_, a),
                server(net, ch.address, "hostB", tmp_path, token="s3cret-token") as (_, b),
            ):
                lh.server.publish_weights(1, tensors(1), chunk_bytes=CHUNK)
                await lh.watch.until(lambda: 1 in a and 1 in b, 30)
                assert a[1] and b[1]  # through each relay's file, hostB's through hostA
            first = next(r for r in lh.proto.relays.relays.values() if r.peer_id == "relay-hostA")
            hello = codec.encode(
                Hello(
                    protocol_version=list(PROTOCOL_VERSION),
                    peer_id="thief",
                    role="rollout-server",
                    epoch="e",
                    model=Identity("weight-relay", ""),
                    tokenizer=Identity("weight-relay", ""),
                    capabilities=[WEIGHT_RELAY_CAPABILITY],
                    relay_address="tcp://127.0.0.1:9",
                )
            )
            # the last: the token's holder is sent version 1 (the refusals above are for the keys)
            for token in (None, "another-token", "s3cret-token"):
                dealer = zmq.Context.instance().socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                if token is not None:
                    use_token(dealer, token)
                dealer.connect(first.address)
                try:
                    dealer.send_multipart(hello)
                    got = dealer.poll(1500)
                finally:
                    dealer.close(0)
                assert bool(got) == (token == "s3cret-token"), f"token {token!r}: answered {got}"
            # A token holder's one message of 64 MiB in frames under the bound: the relay cuts
            # the connection once libzmq holds 4 MiB of it (SPEC §13), instead of holding it all.
            rss0 = _rss(procs["hostA"].pid)
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            use_token(dealer, "s3cret-token")
            dealer.connect(first.address)
            piece = bytes(64 << 10)
            try:
                dealer.send_multipart([hello[0], *[piece] * 1024], copy=False)
                peak = rss0
                for _ in range(100):
                    await anyio.sleep(0.02)
                    peak = max(peak, _rss(procs["hostA"].pid))
            finally:
                dealer.close(0)
            assert procs["hostA"].poll() is None
            assert peak - rss0 < 32 << 20, f"relay RSS +{(peak - rss0) >> 20} MiB"


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def test_server_that_cannot_use_the_file_gets_chunks(net: ZmqNet, tmp_path: Path) -> None:
    """Its /dev/shm is not the relay's (here: the file lies outside its allowed roots): it refuses
    the relay's file (WEIGHTS_APPLIED ok=false) and is sent the version as chunks."""
    ch = CountingChannel(net.server("tcp://127.0.0.1:0"))
    async with learner_running(ch, host="learner-host") as lh:
        async with (
            relays(lh, ["hostA"], tmp_path),
            server(net, ch.address, "hostA", tmp_path, roots=[str(tmp_path / "elsewhere")]) as (
                _,
                a,
            ),
        ):
            lh.server.publish_weights(1, tensors(1), chunk_bytes=CHUNK)
            await lh.watch.until(lambda: 1 in a, 30)
            assert a[1] == ""
            refused = [e for e in lh.watch.of(PeerWeightsApplied) if not e.applied.ok]
            assert [e.peer_id for e in refused] == ["server-hostA"]


async def test_server_without_capability_gets_chunks_directly(net: ZmqNet, tmp_path: Path) -> None:
    ch = CountingChannel(net.server("tcp://127.0.0.1:0"))
    async with learner_running(ch, host="learner-host") as lh:
        async with relays(lh, ["hostA"], tmp_path):
            async with (
                server(net, ch.address, "hostA", tmp_path, peer_id="old", files=False) as (o, old),
                server(net, ch.address, "hostA", tmp_path, peer_id="new") as (_, new),
            ):
                lh.server.publish_weights(1, tensors(1), chunk_bytes=CHUNK)
                await lh.watch.until(lambda: 1 in old and 1 in new, 30)
                # chunks to the old peer, the relay's file to the new
                assert old[1] == "" and new[1]
                n = num_chunks(tensors(1))
                by_peer = {p.name: p.identity for p in lh.proto.peers.values()}
                assert ch.chunks[by_peer["old"]] == n and by_peer["new"] not in ch.chunks
                await o.close()


def test_relay_with_a_learner_without_relays_exits_saying_so(tmp_path: Path) -> None:
    """A 1.3 learner (WELCOME without "weight_relay"): the relay stops with a message, exit 2."""
    import zmq

    from protocol.messages import Hello, Limits, Welcome

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "bin/weight-relay"), "--learner", f"tcp://127.0.0.1:{port}",
         "--bind", "tcp://127.0.0.1:0", "--weights-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert sock.poll(30_000), "no HELLO from the relay"
        ident, *frames = sock.recv_multipart()
        hello = codec.decode(frames)
        assert isinstance(hello, Hello) and hello.relay_address.startswith("tcp://127.0.0.1:")
        old = Welcome([1, 3], "old-learner", "s", 0, 0, 1, 1.0, 10.0, Limits(1 << 20, 8, 8))
        sock.send_multipart([ident, *(bytes(codec.view(f)) for f in codec.encode(old))])
        _, err = p.communicate(timeout=30)
        assert p.returncode == 2 and "does not run weight relays" in err, err
        assert not list(tmp_path.iterdir())  # its slot directory is gone
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        sock.close(linger=0)
        ctx.term()
