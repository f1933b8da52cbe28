#!/usr/bin/env python3
"""Throughput of the trajectory path against raw ZeroMQ on the same bytes.

Phase 1 (protocol): a sender process streams realistic batches with the real ``RolloutClient`` to a
receiver process running the real ``LearnerServer`` over TCP loopback. The receiver frees the room
of every batch as soon as it arrives; credits keep the pipe full; the sender keeps at most
``--window`` batches submitted and unacknowledged, so encoding overlaps the wire. Timed: first
submit to last ACK (encode, send, decode, validate, dedup, ACK).

Phase 2 (bound): the same number of messages with the same frames (the protocol phase's first
encoded batches, cycled, so no buffer stays cache-hot) from a plain DEALER to a plain ROUTER with
``copy=False``, then one final ack: what ZeroMQ alone does with these bytes on this machine.

Both phases run in fresh processes with the same allocator settings (``tune_malloc``, on by
default). Per-thread CPU seconds of the timed part go into the JSON: on a small machine they show
which thread or process is the bottleneck.

Prints progress lines to stderr, a summary, and as its last line a JSON object with the figures.
Run: ``.venv/bin/python bench/protocol.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from protocol import codec
from protocol.batch import (
    Trajectories,
    TrajectoryBuilder,
    token_count,
)
from protocol.codec import view
from protocol.driver import (
    LearnerServer,
    RolloutClient,
)
from protocol.events import BatchAcked, BatchReceived, Connected, PeerClosed
from protocol.limits import MAX_FRAME_BYTES, CodecLimits
from protocol.messages import Identity
from protocol.receiver import LearnerProtocol
from protocol.sender import RolloutConnection, encode_batch
from protocol.trajectory import Trajectory
from protocol.zmq_auth import serve_token, use_token
from protocol.zmq_transport import ZmqServerChannel, client_factory

VOCAB = 151_936
DISTINCT = 32  # distinct batches (own buffers) both phases cycle through (~200 MB by default)


@dataclass(frozen=True)
class Config:
    trajectories: int = 256
    prompt: int = 256
    response: int = 1792
    batches: int = 1000
    credits: int = 8
    window: int = 16
    templates: int = 4
    malloc_tuning: bool = True
    input: str = (
        "columns"  # what producers hand to submit(): "columns" (TrajectoryBuilder) or "objects"
    )
    token: str = ""  # the raw phase: "" plain ZeroMQ, else CURVE with this token's keys
    max_frame_bytes: int = MAX_FRAME_BYTES  # the receiver's frame bound (0: frames go whole)
    hold_watch: bool = True  # the receiver bounds what libzmq holds per connection, as the learner


# -- process set-up -------------------------------------------------------------------------------------
def tune_malloc() -> bool:
    """Keep freed large buffers in the heap instead of returning them to the kernel (glibc only).

    Every batch allocates megabytes (the sender's column buffers, ZeroMQ's receive buffers). By
    default glibc serves these with fresh mmaps or trims them back on free, so every batch pays a
    page fault per 4 KiB touched, which in a VM costs more than the copy itself. Raising the mmap
    and trim thresholds lets the same memory be reused batch after batch.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        return all(
            libc.mallopt(opt, val) == 1
            for opt, val in (
                (m_mmap_threshold, 512 << 20),
                (m_trim_threshold, 2 << 30),
                (m_top_pad, 64 << 20),
            )
        )
    except (OSError, AttributeError):  # not glibc
        return False


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process (Linux /proc; {} elsewhere), named for the report."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(tid), comm)
        name = "zmq-gc" if "Garbage" in name else name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def usable_cpus() -> int | None:
    """The cores this process may run on (``taskset`` narrows them), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def cpu_diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v - before.get(k, 0.0) > 0
    }


def _child_setup(cfg: Config) -> None:
    if cfg.malloc_tuning:
        tune_malloc()


# -- data ---------------------------------------------------------------------------------------------
def make_templates(cfg: Config) -> list[list[Any]]:
    """Distinct batches of realistic token arrays; submissions reuse them under fresh ids."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for b in range(cfg.templates):
        batch = []
        for i in range(cfg.trajectories):
            mask = np.ones(cfg.response, np.uint8)
            for _ in range(3):  # three tool results spliced into the response
                start = int(rng.integers(0, cfg.response - 128))
                mask[start : start + int(rng.integers(16, 128))] = 0
            lp = np.where(mask == 1, -rng.exponential(0.5, cfg.response), 0.0).astype(np.float32)
            versions = np.full(cfg.response, 7, np.int32)
            versions[: cfg.response // 3] = 6  # generation straddled a weight update
            batch.append(
                Trajectory(
                    trajectory_id=f"template-{b}-{i}",
                    group_uid=f"g{b}-{i // 8}",
                    prompt_ids=rng.integers(0, VOCAB, cfg.prompt, dtype=np.int32),
                    response_ids=rng.integers(0, VOCAB, cfg.response, dtype=np.int32),
                    response_mask=mask,
                    rollout_logprobs=lp,
                    versions=versions,
                    reward=float(rng.random()),
                    source_server="bench-rollout",
                    data_source="gsm8k",
                    agent_type="tool",
                    termination="answered",
                    num_turns=4,
                    reward_extras={"acc": 1.0, "format": True},
                    timings={"generate_s": 1.25},
                )
            )
        out.append(batch)
    return out


def distinct_batches(cfg: Config, templates: list[list[Any]], form: str) -> list[Any]:
    """The batches both phases cycle through: ``DISTINCT`` of them in their own buffers, so no
    phase gains from one cache-hot buffer. Column-wise ones are built as a rollout server's
    ``TrajectoryBuilder`` builds them (one copy, as episodes end: producer work, outside the clock)."""

    out: list[Any] = []
    for i in range(min(cfg.batches, DISTINCT)):
        template = templates[i % len(templates)]
        if form == "objects":
            out.append(template)
            continue
        builder = TrajectoryBuilder()
        for t in template:
            builder.append(t)
        out.append(builder.build())
    return out


def fresh(batch: Any, prefix: str) -> Any:
    """The batch's arrays under new trajectory ids (the learner deduplicates on ids); no copy."""
    import dataclasses

    if isinstance(batch, Trajectories):
        ids = [f"{prefix}-{i}" for i in range(len(batch))]
        return Trajectories({**batch.meta, "trajectory_id": ids}, batch.columns)
    return [dataclasses.replace(t, trajectory_id=f"{prefix}-{i}") for i, t in enumerate(batch)]


# -- phase 1: protocol ---------------------------------------------------------------------------------
def protocol_receiver(cfg: Config, pipe: Any) -> None:
    _child_setup(cfg)
    import anyio

    async def main() -> None:
        # The learner's frame bound (learner.bind): the sender splits, the receiver joins.
        frame = cfg.max_frame_bytes
        proto = LearnerProtocol(
            tokenizer=Identity("bench", "", VOCAB),
            capacity=2 * cfg.credits,
            max_credits_per_peer=cfg.credits,
            limits=CodecLimits(vocab_size=VOCAB),
            max_frame_bytes=frame,
        )
        channel = ZmqServerChannel(
            "tcp://127.0.0.1:0",
            max_frame_bytes=frame,
            allowance=proto.hold_allowance if cfg.hold_watch else None,
        )
        server = LearnerServer(proto, channel)
        pipe.send(channel.address)
        got = tokens = 0
        c0 = cpu = 0.0
        th0: dict[str, float] = {}
        threads: dict[str, float] = {}
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(server.run)
                async for ev in server.events:
                    if isinstance(ev, BatchReceived):
                        server.batch_consumed()
                        if not got:
                            c0, th0 = time.process_time(), thread_cpu()
                        got += 1
                        tokens += token_count(ev.trajectories)
                        if got == cfg.batches:
                            cpu, threads = time.process_time() - c0, cpu_diff(th0, thread_cpu())
                    elif isinstance(ev, PeerClosed):
                        break  # the sender has all its ACKs and said BYE: nothing is left in flight
                server.close("bench done")
        finally:
            await channel.aclose()
        pipe.send(
            {
                "batches": got,
                "tokens": tokens,
                "stats": proto.stats,
                "cpu_s": cpu,
                "threads": threads,
            }
        )

    anyio.run(main)


def protocol_sender(cfg: Config, address: str, pipe: Any) -> None:
    _child_setup(cfg)
    import anyio

    templates = make_templates(cfg)

    async def main() -> None:
        conn = RolloutConnection(
            peer_id="bench-rollout",
            epoch=f"bench-{os.getpid()}",
            model=Identity("bench", "0" * 64, VOCAB),
            tokenizer=Identity("bench", "", VOCAB),
        )
        client = RolloutClient(conn, client_factory(address))
        acked = 0
        connected = anyio.Event()
        progress = anyio.Event()
        # Batches differ only in id lengths: a few bytes in ~6 MB. Sized once, outside the clock.
        distinct = distinct_batches(cfg, templates, cfg.input)
        nbytes = codec.frame_bytes(encode_batch(1, fresh(distinct[0], "b0"), conn.number_frames))
        t0 = 0.0

        async def watch() -> None:
            nonlocal acked, progress
            async for ev in client.events:
                if isinstance(ev, Connected):
                    connected.set()
                elif isinstance(ev, BatchAcked):
                    acked += len(ev.seqs)
                    progress.set()
                    progress = anyio.Event()

        async def report() -> None:
            while True:
                await anyio.sleep(0.5)
                dt = time.perf_counter() - t0
                print(
                    f"  protocol: {acked}/{cfg.batches} batches acked, "
                    f"{acked * cfg.trajectories / dt:,.0f} traj/s, "
                    f"{nbytes * acked / dt / 1e6:,.0f} MB/s",
                    file=sys.stderr,
                    flush=True,
                )

        submitted = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await tg.start(client.run)
            # The producer's work (building trajectories as episodes end) is not the protocol's: done
            # up front. With "objects" the concatenation into columns is timed (it is submit's).
            batches = [fresh(distinct[i % len(distinct)], f"b{i}") for i in range(cfg.batches)]
            await connected.wait()
            t0, c0, th0 = time.perf_counter(), time.process_time(), thread_cpu()
            tg.start_soon(report)
            for batch in batches:
                while submitted - acked >= cfg.window:
                    await progress.wait()
                await client.submit(batch)
                submitted += 1
            while acked < cfg.batches:
                await progress.wait()
            elapsed, cpu, threads = (
                time.perf_counter() - t0,
                time.process_time() - c0,
                cpu_diff(th0, thread_cpu()),
            )
            await client.close("bench done")
            tg.cancel_scope.cancel()
            pipe.send(
                {
                    "elapsed_s": elapsed,
                    "cpu_s": cpu,
                    "threads": threads,
                    "message_bytes": nbytes,
                    "connections": client.connections,
                }
            )

    anyio.run(main)


# -- phase 2: raw ZeroMQ bound ---------------------------------------------------------------------------
def raw_sender(cfg: Config, address: str, pipe: Any) -> None:
    _child_setup(cfg)
    import zmq

    # The protocol phase's batches (the first DISTINCT of them, cycled): distinct buffers, so the
    # bound does not gain from sending one cache-hot buffer over and over. Views, not copies.
    templates = make_templates(cfg)
    # In the form the protocol phase negotiates (1.5: per-trajectory numbers as frames).
    distinct = [
        [view(f) for f in encode_batch(i + 1, fresh(b, f"b{i}"), number_frames=True)]
        for i, b in enumerate(distinct_batches(cfg, templates, "columns"))
    ]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    if cfg.token:
        use_token(sock, cfg.token)
    sock.connect(address)
    sock.send_multipart([b"\x08", b"hi"])  # connect before the clock starts; not counted below
    sock.recv()  # the receiver acks this warm-up at once
    t0, c0, th0 = time.perf_counter(), time.process_time(), thread_cpu()
    for i in range(cfg.batches):
        sock.send_multipart(distinct[i % len(distinct)], copy=False)
    sock.recv_multipart()
    elapsed, cpu, threads = (
        time.perf_counter() - t0,
        time.process_time() - c0,
        cpu_diff(th0, thread_cpu()),
    )
    sock.close(linger=0)
    ctx.term()
    pipe.send({"elapsed_s": elapsed, "cpu_s": cpu, "threads": threads})


def raw_receiver(cfg: Config, pipe: Any) -> None:
    _child_setup(cfg)
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 0)
    if cfg.token:  # the token's server key; no ZAP handler, which only matters at the handshake
        serve_token(sock, cfg.token)
    sock.bind("tcp://127.0.0.1:0")
    pipe.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    ident, _, _ = sock.recv_multipart()
    sock.send_multipart([ident, b"ok"])
    nbytes = 0
    c0, th0 = time.process_time(), thread_cpu()  # restarted when the first batch arrives
    for i in range(cfg.batches):
        parts = sock.recv_multipart(copy=False)
        if not i:
            c0, th0 = time.process_time(), thread_cpu()
        nbytes += sum(len(p) for p in parts[1:])
    cpu, threads = time.process_time() - c0, cpu_diff(th0, thread_cpu())
    sock.send_multipart([ident, b"ack"])
    sock.close(linger=1000)
    ctx.term()
    pipe.send({"bytes": nbytes, "cpu_s": cpu, "threads": threads})


# -- orchestration ---------------------------------------------------------------------------------------
def run_pair(receiver: Any, sender: Any, cfg: Config) -> tuple[dict, dict]:
    ctx = mp.get_context("spawn")
    r_parent, r_child = ctx.Pipe()
    s_parent, s_child = ctx.Pipe()
    rp = ctx.Process(target=receiver, args=(cfg, r_child), daemon=True)
    rp.start()
    try:
        address = r_parent.recv()
        sp = ctx.Process(target=sender, args=(cfg, address, s_child), daemon=True)
        sp.start()
        try:
            sent = s_parent.recv()
            received = r_parent.recv()
        finally:
            sp.join(10)
            if sp.is_alive():
                sp.kill()
    finally:
        rp.join(10)
        if rp.is_alive():
            rp.kill()
    return sent, received


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    d = Config()
    ap.add_argument(
        "--trajectories", type=int, default=d.trajectories, help="trajectories per batch"
    )
    ap.add_argument("--prompt", type=int, default=d.prompt, help="prompt tokens per trajectory")
    ap.add_argument(
        "--response", type=int, default=d.response, help="response tokens per trajectory"
    )
    ap.add_argument("--batches", type=int, default=d.batches, help="batches per phase")
    ap.add_argument(
        "--credits", type=int, default=d.credits, help="learner credits per peer (capacity 2x)"
    )
    ap.add_argument(
        "--window", type=int, default=d.window, help="max submitted, unacknowledged batches"
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="run both phases this many times; report medians"
    )
    ap.add_argument(
        "--input",
        choices=("columns", "objects"),
        default=d.input,
        help="producer hands column-wise batches (TrajectoryBuilder, no copy at submit) or a "
        "list of Trajectory objects (concatenated at submit, in a worker thread)",
    )
    ap.add_argument(
        "--no-malloc-tuning",
        dest="malloc_tuning",
        action="store_false",
        help="leave glibc's malloc thresholds alone in all four processes (see tune_malloc)",
    )
    ap.add_argument(
        "--max-frame-bytes",
        type=int,
        default=d.max_frame_bytes,
        help="the protocol receiver's frame bound: the sender splits larger frames into pieces "
        "of this size (SPEC §2); 0: frames go whole, as before protocol 1.6",
    )
    ap.add_argument(
        "--no-hold-watch",
        dest="hold_watch",
        action="store_false",
        help="the receiver does not bound what libzmq holds per connection (the learner does, "
        "protocol.hold_ledger)",
    )
    args = ap.parse_args(argv)
    cfg = Config(
        args.trajectories,
        args.prompt,
        args.response,
        args.batches,
        args.credits,
        args.window,
        malloc_tuning=args.malloc_tuning,
        input=args.input,
        max_frame_bytes=args.max_frame_bytes,
        hold_watch=args.hold_watch,
    )

    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    runs = []
    sent: dict[str, Any] = {}
    for r in range(args.repeat):
        print(
            f"run {r + 1}/{args.repeat}: {cfg.batches} batches of {cfg.trajectories} x "
            f"{cfg.prompt + cfg.response} tokens",
            file=sys.stderr,
            flush=True,
        )
        sent, received = run_pair(protocol_receiver, protocol_sender, cfg)
        assert received["batches"] == cfg.batches, received
        assert received["stats"]["duplicate_batches"] == 0, received
        raw_sent, raw_received = run_pair(raw_receiver, raw_sender, cfg)
        # Batches differ only in the digits of their ids: sizes agree to a few hundred bytes in 6 MB.
        total = sent["message_bytes"] * cfg.batches
        assert abs(raw_received["bytes"] - total) < total * 1e-3, (raw_received, total)
        proto_mbs = total / sent["elapsed_s"] / 1e6
        bound_mbs = raw_received["bytes"] / raw_sent["elapsed_s"] / 1e6
        runs.append(
            {
                "traj_per_s": cfg.batches * cfg.trajectories / sent["elapsed_s"],
                "mb_per_s": proto_mbs,
                "bound_mb_per_s": bound_mbs,
                "ratio": proto_mbs / bound_mbs,
                "protocol_s": sent["elapsed_s"],
                "bound_s": raw_sent["elapsed_s"],
                # CPU seconds (all threads) per process while timed: who is the bottleneck
                "protocol_cpu_s": {"sender": sent["cpu_s"], "receiver": received["cpu_s"]},
                "bound_cpu_s": {"sender": raw_sent["cpu_s"], "receiver": raw_received["cpu_s"]},
                "thread_cpu_s": {
                    "protocol_sender": sent["threads"],
                    "protocol_receiver": received["threads"],
                    "bound_sender": raw_sent["threads"],
                    "bound_receiver": raw_received["threads"],
                },
            }
        )
        print(
            f"  protocol {proto_mbs:,.0f} MB/s ({runs[-1]['traj_per_s']:,.0f} traj/s), raw ZeroMQ "
            f"{bound_mbs:,.0f} MB/s, ratio {runs[-1]['ratio']:.2f}; CPU s sender/receiver: protocol "
            f"{sent['cpu_s']:.2f}/{received['cpu_s']:.2f}, raw {raw_sent['cpu_s']:.2f}/{raw_received['cpu_s']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    med = {
        k: statistics.median(r[k] for r in runs)
        for k in runs[0]
        if not isinstance(runs[0][k], dict)
    }
    print(
        f"trajectories/s {med['traj_per_s']:,.0f}   MB/s {med['mb_per_s']:,.0f}   "
        f"bound MB/s {med['bound_mb_per_s']:,.0f}   ratio {med['ratio']:.2f}   "
        f"(median of {len(runs)}; batch {sent['message_bytes'] / 1e6:.2f} MB)"
    )
    print(
        json.dumps(
            {
                "config": asdict(cfg),
                "message_bytes": sent["message_bytes"],
                "runs": runs,
                "median": med,
                "cpus": usable_cpus(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
