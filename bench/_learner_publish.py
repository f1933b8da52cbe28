"""bench/learner.py's phase 2: publishing weights to rollout servers against memcpy.

Design: a ``LearnerServer`` process publishes the model's weights (or ``--publish-mb`` of
synthetic float32) with ``publish_weights`` to N ``RolloutClient`` processes over ZeroMQ on TCP
loopback, each in its own spawned process so that no GIL is shared. Timed on the machine-wide
monotonic clock, from the call (the learner holds the weights as numpy arrays) to the last
receiver's ``WeightsReceived`` (chunks assembled, every xxh3 checksum verified), and until the
learner holds every WEIGHTS_APPLIED. The bound is measured in the learner process of the same
run: the same bytes copied N times with numpy into preallocated buffers, one per receiver,
alternating with the publishes. Version 1 is the warm-up, and each receiver byte-compares it with
an independent copy outside the clock.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from bench._common import Progress
from common.safetensors_buffers import load_dir
from protocol.driver import LearnerServer, RolloutClient
from protocol.events import PeerClosed, PeerJoined, PeerWeightsApplied, WeightsReceived
from protocol.messages import Identity
from protocol.receiver import LearnerProtocol
from protocol.sender import RolloutConnection
from protocol.weights import NamedBuffer
from protocol.zmq_transport import ZmqServerChannel, client_factory

progress = Progress("bench/learner publish")


def synthetic_tensor(i: int, n: int) -> Any:
    import numpy as np

    return np.random.default_rng(i).random(n, dtype=np.float32)


def synthetic_sizes(mb: float) -> list[int]:
    total, step = int(mb * 1e6) // 4, 4 << 20  # 16 MB tensors, like a model's large matrices
    return [min(step, total - start) for start in range(0, total, step)]


def publish_arrays(model: Path | None, mb: float) -> list[tuple[str, Any]]:
    """The weights to publish as numpy arrays in memory (as the workers' ``full_weights`` hands
    them over): the model's, or ``mb`` MB of deterministic synthetic float32."""
    if mb > 0:
        return [
            (f"synthetic.{i:05d}", synthetic_tensor(i, n))
            for i, n in enumerate(synthetic_sizes(mb))
        ]
    from safetensors.numpy import load_file

    assert model is not None
    return sorted(load_file(str(model / "model.safetensors")).items())


def expected_bytes(model: Path | None, mb: float) -> Any:
    """(name, bytes) of what ``publish_arrays`` holds, one tensor at a time (a receiver checks its
    copy without holding a second one): the model file memory-mapped, or regenerated."""
    if mb > 0:
        for i, n in enumerate(synthetic_sizes(mb)):
            yield f"synthetic.{i:05d}", memoryview(synthetic_tensor(i, n)).cast("B")
        return

    assert model is not None
    for t in load_dir(model):
        yield t.name, t.data


def publish_learner(
    model: Path | None, mb: float, n: int, rounds: int, chunk: int, pipe: Any
) -> None:
    import anyio
    import numpy as np

    arrays = publish_arrays(model, mb)
    buffers = [NamedBuffer(k, str(a.dtype), a.shape, memoryview(a).cast("B")) for k, a in arrays]
    nbytes = sum(a.nbytes for _, a in arrays)
    # The bound's destination: one preallocated buffer per receiver, touched once so that page
    # faults are not timed.
    dests = [np.ones(nbytes, np.uint8) for _ in range(n)]

    def memcpy() -> float:
        t = time.perf_counter()
        for d in dests:
            off = 0
            for _, a in arrays:
                flat = a.reshape(-1).view(np.uint8)
                np.copyto(d[off : off + flat.size], flat)
                off += flat.size
        return time.perf_counter() - t

    async def main() -> None:
        channel = ZmqServerChannel("tcp://127.0.0.1:0")
        # Heartbeats must survive a peer busy verifying gigabytes on a crowded machine.
        proto = LearnerProtocol(tokenizer=Identity("bench", "", 512), heartbeat_timeout_s=120.0)
        server = LearnerServer(proto, channel)
        pipe.send(channel.address)
        joined, closed = anyio.Event(), anyio.Event()
        done = {v: anyio.Event() for v in range(1, rounds + 1)}
        applied = dict.fromkeys(done, 0)
        starts: dict[int, float] = {}
        calls: dict[int, float] = {}
        acked: dict[int, float] = {}
        bound: list[float] = []

        async def watch() -> None:
            peers = gone = 0
            async for ev in server.events:
                if isinstance(ev, PeerJoined):
                    peers += 1
                    if peers == n:
                        joined.set()
                elif isinstance(ev, PeerWeightsApplied):
                    v = ev.applied.version
                    if not ev.applied.ok:
                        raise RuntimeError(f"{ev.peer_id} refused version {v}: {ev.applied.error}")
                    applied[v] += 1
                    if applied[v] == n:
                        acked[v] = time.monotonic()
                        done[v].set()
                elif isinstance(ev, PeerClosed):
                    gone += 1
                    if gone == n:
                        closed.set()

        try:
            async with anyio.create_task_group() as tg:
                await tg.start(server.run)
                tg.start_soon(watch)
                await joined.wait()  # readiness barrier: every receiver has its session
                for v in range(1, rounds + 1):
                    if v % 2:  # alternate which of the two goes first
                        bound.append(memcpy())
                    starts[v] = time.monotonic()
                    server.publish_weights(v, buffers, chunk_bytes=chunk)
                    # checksums + encoding, on the event loop
                    calls[v] = time.monotonic() - starts[v]
                    await done[v].wait()
                    if not v % 2:
                        bound.append(memcpy())
                await closed.wait()  # every receiver said BYE
                server.close("bench done")
                tg.cancel_scope.cancel()
        finally:
            await channel.aclose()
        pipe.send(
            {
                "starts": starts,
                "calls": calls,
                "acked": acked,
                "bound_s": bound,
                "bytes": nbytes,
                "tensors": len(buffers),
            }
        )

    anyio.run(main)


def publish_receiver(
    model: Path | None, mb: float, address: str, idx: int, rounds: int, pipe: Any
) -> None:
    import anyio

    async def main() -> None:
        conn = RolloutConnection(
            peer_id=f"bench-receiver-{idx}",
            epoch=uuid.uuid4().hex,
            model=Identity("bench", "0" * 64, 512),
            tokenizer=Identity("bench", "", 512),
            heartbeat_timeout_s=120.0,
        )
        client = RolloutClient(conn, client_factory(address))
        received: dict[int, float] = {}
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            async for ev in client.events:
                if not isinstance(ev, WeightsReceived):
                    continue
                w = ev.weights
                received[w.version] = time.monotonic()  # assembled, every checksum verified
                if w.version == 1:  # once, outside the clock: byte-compare with an independent copy
                    got = {spec.name: buf for spec, buf in w.tensors}
                    names = set()
                    for name, want in expected_bytes(model, mb):
                        assert got[name] == want, f"tensor {name} differs"
                        names.add(name)
                    assert names == set(got), sorted(names ^ set(got))
                client.weights_applied(w.version, w.transfer_id, ok=True)
                if len(received) == rounds:
                    await client.close("bench done")
        pipe.send(received)

    anyio.run(main)


def publish_round(model: Path | None, mb: float, n: int, rounds: int, chunk: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    lp, lc = ctx.Pipe()
    learner = ctx.Process(
        target=publish_learner, args=(model, mb, n, rounds, chunk, lc), daemon=True
    )
    learner.start()
    procs, pipes = [], []
    try:
        address = lp.recv()
        for i in range(n):
            rp, rc = ctx.Pipe()
            procs.append(
                ctx.Process(
                    target=publish_receiver, args=(model, mb, address, i, rounds, rc), daemon=True
                )
            )
            procs[-1].start()
            pipes.append(rp)
        got = [p.recv() for p in pipes]
        res = lp.recv()
    finally:
        for p in [*procs, learner]:
            p.join(15)
            if p.is_alive():
                p.kill()
    # Version 1 is the warm-up (connections, first-touch allocations, byte-compare).
    versions = range(2, rounds + 1)
    publish = [max(g[v] for g in got) - res["starts"][v] for v in versions]
    acked = [res["acked"][v] - res["starts"][v] for v in versions]
    bound = res["bound_s"][1:]
    b = res["bytes"]
    pub_s, bound_s = statistics.median(publish), statistics.median(bound)
    return {
        "bytes": b,
        "tensors": res["tensors"],
        "publish_s": round(pub_s, 6),
        # bytes of one copy / time to reach every receiver
        "publish_gb_s": round(b / pub_s / 1e9, 3),
        # until the learner has every WEIGHTS_APPLIED
        "acked_s": round(statistics.median(acked), 6),
        # plan + checksums
        "publish_call_s": round(statistics.median(res["calls"][v] for v in versions), 6),
        "delivered_gb_s": round(n * b / pub_s / 1e9, 3),  # all N copies
        "bound_s": round(bound_s, 6),
        "bound_gb_s": round(n * b / bound_s / 1e9, 3),  # memcpy bandwidth (all N copies)
        "ratio": round(statistics.median(bb / p for bb, p in zip(bound, publish, strict=True)), 4),
        "publish_s_rounds": [round(x, 6) for x in publish],
        "bound_s_rounds": [round(x, 6) for x in bound],
    }


def publish_phase(args: argparse.Namespace, model: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    chunk = int(args.chunk_mb * (1 << 20))
    for n in [int(x) for x in args.receivers.split(",") if x.strip()]:
        r = publish_round(model, args.publish_mb, n, args.publish_repeat + 1, chunk)
        out[str(n)] = r
        progress(
            f"publish to {n} receiver(s): {r['bytes'] / 1e6:,.1f} MB in {r['publish_s'] * 1e3:,.1f} ms "
            f"({r['publish_gb_s']:.2f} GB/s per receiver), all acked {r['acked_s'] * 1e3:,.1f} ms; "
            f"memcpy x{n} {r['bound_s'] * 1e3:,.1f} ms ({r['bound_gb_s']:.2f} GB/s); ratio {r['ratio']:.3f}"
        )
    return out
