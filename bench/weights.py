#!/usr/bin/env python3
"""Weight fan-out across emulated hosts: direct fan-out against the relay tier, with raw ZeroMQ over
one link as the bound, all in one run.

Hosts: every endpoint (the learner, receiver i) runs in its own network namespace, joined to a
bridge (itself in a namespace of its own, so the host's firewall and bridge settings stay out of
it) by a veth pair shaped with ``tc tbf`` to ``--rate`` in each direction: each host has a full
duplex NIC of that rate. The bench creates all of it and removes it on every way out (needs root).
On plain loopback the topologies could not differ: every one of them moves the same bytes through
the same CPUs.

Per receiver count K (``--receivers``), a fresh learner process (``LearnerServer``, as the real
learner) publishes ``--mb`` of synthetic float32 ``--rounds`` times, in ``--chunk-mb`` chunks:
- direct: K ``RolloutClient`` receivers, each sent its own copy (protocol 1.3, what a learner does
  without relays); done when all K answered WEIGHTS_APPLIED (assembled, every checksum verified);
- relay: K ``bin/weight-relay`` processes, one per host, chained (protocol 1.4); done when all K
  reported their verified slot file (WEIGHTS_APPLIED ``file``), i.e. what the host's servers load.
The bound: the same bytes, in the same chunk messages, DEALER -> ROUTER over one such link (the
learner's host to receiver 1's), timed until the receiver's one-byte answer. Times are learner-side
medians over the rounds. Ratios: ``fanout_ratio`` = time(K=max) / time(K=1) of the relay tier
(target <= 1.3) and ``link_ratio`` = raw time / time(K=1) of the relay tier (target >= 0.8); the
same for direct fan-out beside them.

The rate: 2 cores emulate up to 9 hosts, and every emulated host's bytes cost CPU (TCP both ways,
the copy into the slot file, the checksums: ~0.12 CPU s per relay per 64 MB here). At 2 Gbit/s
8 relays need more CPU per second than 2 shared cores have, so the run measures the CPU, not
the topology; the default 500 Mbit/s keeps every host's CPU need below its share. ``relay_cpu_s``
and ``direct_cpu_s`` (CPU seconds of all processes of a configuration per round) show which bound
a run hit: near ``cores x time`` it was CPU-bound.

Progress goes to stderr; the last line of stdout is one JSON object with every figure.
Run (root): ``.venv/bin/python bench/weights.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from protocol.driver import (  # noqa: E402
    LearnerServer,
    RolloutClient,
)
from protocol.events import (  # noqa: E402
    PeerJoined,
    PeerWeightsApplied,
    WeightsReceived,
)
from protocol.messages import Identity  # noqa: E402
from protocol.receiver import LearnerProtocol  # noqa: E402
from protocol.sender import RolloutConnection  # noqa: E402
from protocol.weights import NamedBuffer  # noqa: E402
from protocol.zmq_transport import (  # noqa: E402
    ZmqServerChannel,
    client_factory,
)

PORT = 5700
RAW_PORT = 5701


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


# -- the emulated hosts --------------------------------------------------------------------------
class Hosts:
    """Namespaces ``<tag>-sw`` (the bridge) and ``<tag>-h<i>`` (host i at 10.77.<net>.<i+1>; host 0
    is the learner's), each behind a veth pair shaped to ``rate`` both ways."""

    def __init__(self, n: int, rate: str) -> None:
        self.tag = f"wb{os.getpid() % 100000}"
        self.net = os.getpid() % 200 + 20
        self.n, self.rate = n, rate
        self.made: list[str] = []

    def ns(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    def ip(self, i: int) -> str:
        return f"10.77.{self.net}.{i + 1}"

    def _run(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def create(self) -> None:
        sw = f"{self.tag}-sw"
        self._run("ip", "netns", "add", sw)
        self.made.append(sw)
        self._run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        self._run("ip", "-n", sw, "link", "set", "br0", "up")
        self._run("ip", "-n", sw, "link", "set", "lo", "up")
        # rate/HZ is the least burst that reaches the rate; 64 KiB TSO segments must fit too
        burst = "2mb"
        for i in range(self.n):
            ns, a, b = self.ns(i), f"{self.tag}a{i}", f"{self.tag}b{i}"
            self._run("ip", "netns", "add", ns)
            self.made.append(ns)
            self._run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            self._run("ip", "link", "set", a, "netns", ns)
            self._run("ip", "link", "set", b, "netns", sw)
            self._run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", a)
            self._run("ip", "-n", ns, "link", "set", a, "up")
            self._run("ip", "-n", ns, "link", "set", "lo", "up")
            self._run("ip", "-n", sw, "link", "set", b, "master", "br0")
            self._run("ip", "-n", sw, "link", "set", b, "up")
            for where, dev in ((ns, a), (sw, b)):  # upload, download
                self._run(
                    "ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                    "tbf", "rate", self.rate, "burst", burst, "latency", "50ms",
                )  # fmt: skip

    def remove(self) -> None:
        for ns in reversed(self.made):  # a namespace takes its veth ends (and their pairs) along
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()

    def cmd(self, i: int, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i), *argv]


# -- roles (each in its own process, in its host's namespace) -------------------------------------
def payload(mb: float) -> Any:
    import numpy as np

    n = int(mb * (1 << 20)) // 4
    rng = np.random.default_rng(0)
    # 8 tensors
    return [(f"w.{i}", rng.standard_normal(n // 8, dtype=np.float32)) for i in range(8)]


def role_learner(a: argparse.Namespace) -> None:
    import anyio

    arrays = payload(a.mb)
    buffers = [NamedBuffer(k, "float32", x.shape, memoryview(x).cast("B")) for k, x in arrays]

    async def main() -> None:
        channel = ZmqServerChannel(f"tcp://{a.ip}:{PORT}")
        proto = LearnerProtocol(
            tokenizer=Identity("bench", "", 512), heartbeat_timeout_s=120.0, host="bench-learner"
        )
        server = LearnerServer(proto, channel)
        joined = anyio.Event()
        done: dict[int, anyio.Event] = {v: anyio.Event() for v in range(1, a.rounds + 1)}
        count = dict.fromkeys(done, 0)
        times: list[float] = []

        async def watch() -> None:
            peers = 0
            async for ev in server.events:
                if isinstance(ev, PeerJoined):
                    peers += 1
                    if peers == a.k:
                        joined.set()
                elif isinstance(ev, PeerWeightsApplied):
                    w = ev.applied
                    if not w.ok:
                        raise RuntimeError(f"{ev.peer_id}: version {w.version}: {w.error}")
                    if a.mode == "relay" and not w.file:
                        continue
                    count[w.version] += 1
                    if count[w.version] == a.k:
                        done[w.version].set()

        try:
            async with anyio.create_task_group() as tg:
                await tg.start(server.run)
                tg.start_soon(watch)
                print(json.dumps({"ready": channel.address}), flush=True)
                with anyio.fail_after(120):
                    await joined.wait()
                print(json.dumps({"joined": a.k}), flush=True)
                await anyio.to_thread.run_sync(sys.stdin.readline)  # go: CPU counted from here
                for v in range(1, a.rounds + 1):
                    t0 = time.monotonic()
                    server.publish_weights(v, buffers, chunk_bytes=int(a.chunk_mb * (1 << 20)))
                    with anyio.fail_after(600):
                        await done[v].wait()
                    times.append(time.monotonic() - t0)
                    log(f"  {a.mode} K={a.k} round {v}: {times[-1]:.3f} s")
                server.close("bench done")
                await anyio.sleep(0.2)
                tg.cancel_scope.cancel()
        finally:
            await channel.aclose()
        print(json.dumps({"times": times}), flush=True)

    anyio.run(main)


def role_receiver(a: argparse.Namespace) -> None:
    import uuid

    import anyio

    async def main() -> None:
        conn = RolloutConnection(
            peer_id=f"receiver-{a.ip}",
            epoch=uuid.uuid4().hex,
            model=Identity("bench", "0" * 64, 512),
            tokenizer=Identity("bench", "", 512),
            heartbeat_timeout_s=120.0,
            host=f"host-{a.ip}",
        )
        client = RolloutClient(conn, client_factory(a.learner, max_message_bytes=1 << 30))
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            async for ev in client.events:
                if isinstance(ev, WeightsReceived):
                    w = ev.weights
                    client.weights_applied(w.version, w.transfer_id, ok=True)

    anyio.run(main)


def role_raw_sink(a: argparse.Namespace) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.RCVHWM, 0)
    s.bind(f"tcp://{a.ip}:{RAW_PORT}")
    print(json.dumps({"ready": True}), flush=True)
    total = int(a.mb * (1 << 20)) // 4 * 4
    for _ in range(a.rounds):
        got, who = 0, b""
        while got < total:
            who, *frames = s.recv_multipart(copy=False)
            got += sum(len(f.buffer) for f in frames)
        s.send_multipart([who, b"!"])
    s.close(linger=1000)
    ctx.term()


def role_raw_source(a: argparse.Namespace) -> None:
    import zmq

    arrays = payload(a.mb)
    chunk = int(a.chunk_mb * (1 << 20))
    views = [memoryview(x).cast("B") for _, x in arrays]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(a.learner)
    s.send(b"")  # connect first: the timed rounds start on an open connection
    times = []
    for _ in range(a.rounds):
        t0 = time.monotonic()
        for v in views:
            for off in range(0, v.nbytes, chunk):
                s.send(v[off : off + chunk], copy=False)
        s.recv()
        times.append(time.monotonic() - t0)
    s.close(linger=0)
    ctx.term()
    print(json.dumps({"times": times}), flush=True)


# -- orchestration ------------------------------------------------------------------------------
def _json_line(p: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The next JSON line ``p`` prints (its other lines are skipped)."""
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"process {p.args} exited ({p.wait()}) without its result")
        if line.startswith("{"):
            return json.loads(line)
    raise TimeoutError(p.args)


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, argv: list[str], **kw: Any) -> subprocess.Popen[str]:
        p = subprocess.Popen(argv, cwd=ROOT, text=True, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the live processes used so far."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for p in self.procs:
            try:
                f = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(f[11]) + int(f[12])) / tick
            except (OSError, IndexError, ValueError):
                pass
        return total

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.procs.clear()


def me(role: str, a: argparse.Namespace, ip: str, learner: str = "", k: int = 0) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--role", role, "--ip", ip,
        "--learner", learner, "--mb", str(a.mb), "--chunk-mb", str(a.chunk_mb),
        "--rounds", str(a.rounds), "--k", str(k), "--mode", a.mode or "",
    ]  # fmt: skip


def run_config(
    hosts: Hosts, a: argparse.Namespace, mode: str, k: int, shm: Path
) -> tuple[list[float], float]:
    """Round times, and CPU seconds per round of the learner and all K receivers together."""
    procs = Procs()
    a.mode = mode
    try:
        learner = procs.start(
            hosts.cmd(0, *me("learner", a, hosts.ip(0), k=k)),
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
        )
        address = _json_line(learner, 60)["ready"]
        for i in range(1, k + 1):
            if mode == "direct":
                procs.start(hosts.cmd(i, *me("receiver", a, hosts.ip(i), learner=address)))
            else:
                procs.start(
                    hosts.cmd(
                        i, sys.executable, str(ROOT / "bin/weight-relay"), "--learner", address,
                        "--bind", f"tcp://{hosts.ip(i)}:{PORT}", "--host", f"bench-host-{i}",
                        "--peer-id", f"relay-{i}", "--weights-dir", str(shm),
                    ),
                    stdout=subprocess.DEVNULL,
                )  # fmt: skip
        _json_line(learner, 120)  # every receiver joined
        cpu0 = procs.cpu_s()
        assert learner.stdin is not None
        learner.stdin.write("go\n")
        learner.stdin.flush()
        times = _json_line(learner, 900)["times"]
        return times, (procs.cpu_s() - cpu0) / max(1, len(times))
    finally:
        procs.stop()


def run_raw(hosts: Hosts, a: argparse.Namespace) -> list[float]:
    procs = Procs()
    try:
        sink = procs.start(hosts.cmd(1, *me("raw-sink", a, hosts.ip(1))), stdout=subprocess.PIPE)
        _json_line(sink, 60)
        src = procs.start(
            hosts.cmd(
                0, *me("raw-source", a, hosts.ip(0), learner=f"tcp://{hosts.ip(1)}:{RAW_PORT}")
            ),
            stdout=subprocess.PIPE,
        )
        return _json_line(src, 600)["times"]
    finally:
        procs.stop()


def orchestrate(a: argparse.Namespace) -> None:
    ks = [int(x) for x in a.receivers.split(",")]
    if os.geteuid() != 0:
        raise SystemExit("bench/weights.py needs root (network namespaces, veth, tc)")
    hosts = Hosts(max(ks) + 1, a.rate)
    shm = Path("/dev/shm") / f"wbench-{os.getpid()}"
    shm.mkdir()

    def cleanup() -> None:
        hosts.remove()
        shutil.rmtree(shm, ignore_errors=True)

    atexit.register(cleanup)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()
    try:
        hosts.create()
        log(f"{hosts.n} hosts behind {a.rate} links; {a.mb} MB in {a.chunk_mb} MB chunks")
        raw = run_raw(hosts, a)
        log(f"raw ZeroMQ over one link: {statistics.median(raw):.3f} s")
        res: dict[str, dict[int, float]] = {"relay": {}, "direct": {}}
        cpu: dict[str, dict[int, float]] = {"relay": {}, "direct": {}}
        for mode in ("relay", "direct"):
            for k in ks:
                times, cpu[mode][k] = run_config(hosts, a, mode, k, shm)
                res[mode][k] = statistics.median(times)
                log(f"{mode} K={k}: {res[mode][k]:.3f} s, {cpu[mode][k]:.2f} CPU s per round")
        raw_s = statistics.median(raw)
        rounds_raw = raw  # every round, for the record
    finally:
        cleanup()
        atexit.unregister(cleanup)
    kmax, k1 = max(ks), min(ks)
    out = {
        "bench": "weights",
        "rate": a.rate,
        "mb": a.mb,
        "chunk_mb": a.chunk_mb,
        "rounds": a.rounds,
        "raw_s": round(raw_s, 4),
        "raw_rounds_s": [round(x, 4) for x in rounds_raw],
        "relay_s": {k: round(v, 4) for k, v in res["relay"].items()},
        "direct_s": {k: round(v, 4) for k, v in res["direct"].items()},
        "fanout_ratio": round(res["relay"][kmax] / res["relay"][k1], 3),
        "link_ratio": round(raw_s / res["relay"][k1], 3),
        "direct_fanout_ratio": round(res["direct"][kmax] / res["direct"][k1], 3),
        "direct_link_ratio": round(raw_s / res["direct"][k1], 3),
        "relay_cpu_s": {k: round(v, 2) for k, v in cpu["relay"].items()},
        "direct_cpu_s": {k: round(v, 2) for k, v in cpu["direct"].items()},
        "cores": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    log(
        f"relay tier: fanout_ratio {out['fanout_ratio']} (K={kmax} vs K={k1}), link_ratio "
        f"{out['link_ratio']}; direct: {out['direct_fanout_ratio']}, {out['direct_link_ratio']}"
    )
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--receivers", default="1,2,4,8", help="receiver counts K")
    p.add_argument("--rate", default="500mbit", help="each host's link, both directions (tc rate)")
    p.add_argument("--mb", type=float, default=64.0, help="payload per version (float32)")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="WEIGHTS_CHUNK size")
    p.add_argument("--rounds", type=int, default=3, help="versions published per configuration")
    p.add_argument("--role", default="", help=argparse.SUPPRESS)
    p.add_argument("--ip", default="", help=argparse.SUPPRESS)
    p.add_argument("--learner", default="", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    roles = {
        "learner": role_learner,
        "receiver": role_receiver,
        "raw-sink": role_raw_sink,
        "raw-source": role_raw_source,
    }
    if a.role:
        roles[a.role](a)
    else:
        orchestrate(a)


if __name__ == "__main__":
    main()
