"""``bin/weight-relay``: one per host; forwards each policy version down the relay chain and hands
it to the rollout servers of its host as a slot file (protocol 1.4, SPEC §"Weight relays").

Design: ``protocol.relay.RelayNode`` decides everything; this module only moves frames. One task
group owns every task: the learner link (a DEALER, re-opened when the learner goes silent), the
upstream link (a DEALER to the relay named in WELCOME ``relay_upstream``, replaced on every
re-route), the downstream socket (a ROUTER that relays behind this one connect to), and the pump
(heartbeats, deadlines, queued sends). A weight message is forwarded downstream before it is
assembled, so a hop costs one chunk's time. Chunks are assembled straight into a memory-mapped
slot file (``SlotFiles``) in a worker thread, so the page faults and the final checksums overlap
the network; the file is only reported (WEIGHTS_APPLIED ``file``) once every checksum matched.

Slot files live in ``<dir>/agentrl-weights-<pid>-<id>/v<version>-<transfer>/model.safetensors``
(the layout rollout servers accept, ``protocol.weights.check_weights_file``). The newest ``keep``
verified versions stay; an older one is unlinked (a server that has it mapped keeps its pages).
Everything is removed on exit; a relay killed outright leaves a directory that the next relay or
learner on the host removes (``protocol.slot_files.remove_stale``).
"""

from __future__ import annotations

import atexit
import mmap
import os
import shutil
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from common.hostkey import host_key
from common.peer_auth import read_token
from common.safetensors_buffers import header_bytes
from protocol import codec
from protocol.limits import MAX_FRAME_BYTES
from protocol.messages import Bye, Identity, WeightsAnnounce
from protocol.relay import Completed, Frames, LearnerLost, RelayEvent, RelayNode, Routed
from protocol.slot_files import FILE_NAME, make_root, remove_stale
from protocol.weights import DTYPE_SIZES, WeightAssembler
from protocol.zmq_auth import CurveClientKeys
from protocol.zmq_transport import ZmqClientChannel, ZmqServerChannel

# What a downstream peer may make a relay hold unread: its messages (HELLO, WEIGHTS_APPLIED,
# heartbeats) are a few KiB; this leaves room for many of them piling up while the relay forwards.
DOWNSTREAM_HOLD_BYTES = 4 << 20

RECONNECT_S = 0.5  # between two attempts to reach a silent learner


class RelayRefused(RuntimeError):
    """The learner cannot use this relay (it does not run the relay tier)."""


@dataclass
class _Slot:
    version: int
    folder: Path
    mm: mmap.mmap
    complete: bool = False


class SlotFiles:
    """Mapped safetensors files that chunks are assembled into, one per transfer."""

    def __init__(self, parent: str | Path, *, keep: int = 2) -> None:
        remove_stale(parent)
        self.root = make_root(parent)
        atexit.register(self.close)
        self.keep = keep
        self._slots: dict[str, _Slot] = {}  # transfer id -> slot

    def allocate(self, a: WeightsAnnounce) -> list[memoryview]:
        """The file of ``a`` (already checked by the assembler): header written, tensors laid out
        widest element first (each aligned for its dtype), one byte view per tensor, in announce
        order."""
        order = sorted(
            range(len(a.tensors)),
            key=lambda i: (-DTYPE_SIZES[a.tensors[i].dtype], a.tensors[i].name),
        )
        specs = [a.tensors[i] for i in order]
        header = header_bytes([(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in specs])
        folder = self.root / f"v{a.version}-{a.transfer_id[:12]}"
        folder.mkdir(exist_ok=True)
        size = len(header) + sum(t.nbytes for t in specs)
        fd = os.open(folder / FILE_NAME, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        mm[: len(header)] = header
        whole = memoryview(mm)
        views: list[memoryview] = [whole] * len(a.tensors)
        off = len(header)
        for i in order:
            views[i] = whole[off : off + a.tensors[i].nbytes]
            off += a.tensors[i].nbytes
        self._slots[a.transfer_id] = _Slot(a.version, folder, mm)
        return views

    def finish(self, transfer_id: str) -> str:
        """The transfer is verified: its file's path. Superseded transfers and verified versions
        beyond the newest ``keep`` are removed."""
        slot = self._slots[transfer_id]
        slot.complete = True
        done = sorted(
            (s for s in self._slots.values() if s.complete), key=lambda s: s.version, reverse=True
        )
        for tid, s in list(self._slots.items()):
            if s is not slot and (not s.complete or s in done[self.keep :]):
                shutil.rmtree(s.folder, ignore_errors=True)
                del self._slots[tid]
        return str(slot.folder / FILE_NAME)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self._slots.clear()
        atexit.unregister(self.close)


class WeightRelay:
    """The relay process's driver around ``RelayNode``."""

    def __init__(
        self,
        *,
        learner: str,
        bind: str,
        advertise: str = "",
        peer_id: str = "",
        host: str = "",
        weights_dir: str = "/dev/shm",
        keep: int = 2,
        max_message_bytes: int = 1 << 30,
        stall_after_chunks: int = 0,
        curve: CurveClientKeys | None = None,
        token_file: str = "",
    ) -> None:
        """``stall_after_chunks``: fault injection for tests (0: off): after forwarding that many
        chunks the relay stops moving weights but keeps its learner session, to be killed
        mid-transfer. ``curve``: keys for the learner link (a learner with certificates); then the
        links between relays are plain TCP (SPEC §17). ``token_file``: the learner's token
        (transport.auth token), read again at every connection to the learner so a restarted
        learner's new token is followed; the links between relays are token CURVE too, each relay
        a server with the token's server key, so a relay takes weights only from a token holder."""
        self.learner_address, self.max_message_bytes = learner, max_message_bytes
        self.stall_after_chunks, self.curve = stall_after_chunks, curve
        self.token_file = token_file
        # Downstream relays and servers send only small messages: frames over the bound are
        # dropped by libzmq, also before the handshake completes, and a connection that makes
        # libzmq hold more than DOWNSTREAM_HOLD_BYTES unread (a message of many frames) is cut
        # (SPEC §13).
        self.down = ZmqServerChannel(
            bind,
            token=self._token(),
            max_frame_bytes=MAX_FRAME_BYTES,
            peers_split=False,
            allowance=lambda identity: DOWNSTREAM_HOLD_BYTES,
        )
        if not advertise:
            # a wildcard bind is reached through this machine's name (set --advertise otherwise)
            advertise = self.down.address.replace("0.0.0.0", socket.gethostname())
        self.files = SlotFiles(weights_dir, keep=keep)
        self.node = RelayNode(
            peer_id=peer_id or f"relay-{host or host_key()}-{os.getpid()}",
            host=host or host_key(),
            address=advertise,
            assembler=WeightAssembler(
                max_total_bytes=1 << 40, allocate=self.files.allocate, timeout_s=None
            ),
            model=Identity("weight-relay", ""),
            tokenizer=Identity("weight-relay", ""),
            epoch=uuid.uuid4().hex,
            limits=codec.CodecLimits(max_message_bytes=max_message_bytes),
        )
        self._learner: ZmqClientChannel | None = None
        self._started: dict[int, float] = {}

    def _token(self) -> str | None:
        if not self.token_file:
            return None
        return read_token(Path(self.token_file))

    def _poke(self) -> None:
        self._wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._lock = anyio.Lock()  # one weight message at a time, from whichever link
        self._wake = anyio.Event()
        self._routes_in, self._routes_out = anyio.create_memory_object_stream[str](16)
        self._learner_scope = anyio.CancelScope()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._learner_loop)
                tg.start_soon(self._upstream_loop)
                tg.start_soon(self._downstream_loop)
                tg.start_soon(self._pump)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                if self._learner is not None:
                    await self._learner.send(codec.encode(Bye("relay stopping")))
                    await self._learner.aclose()
                await self.down.aclose()
            self.files.close()

    async def _learner_loop(self) -> None:
        while True:
            ch = self._learner = ZmqClientChannel(
                self.learner_address,
                curve=self.curve,
                token=self._token(),
                max_message_bytes=self.max_message_bytes,
            )
            self.node.start(time.monotonic())
            self._poke()
            try:
                with anyio.CancelScope() as self._learner_scope:
                    while True:
                        frames = await ch.recv()
                        self.node.heard(time.monotonic())
                        if RelayNode.is_weights(frames):
                            await self._on_weights(frames)
                        else:
                            await self._handle(self.node.from_learner(frames, time.monotonic()))
            finally:
                self._learner = None
                ch.sock.close(linger=0)
            await anyio.sleep(RECONNECT_S)

    async def _handle(self, events: Sequence[RelayEvent]) -> None:
        for ev in events:
            if isinstance(ev, Routed):
                await self._routes_in.send(ev.upstream)
            elif isinstance(ev, LearnerLost):
                if ev.fatal:
                    raise RelayRefused(ev.reason)
                self._learner_scope.cancel()
        self._poke()

    async def _on_weights(self, frames: Frames) -> None:
        async with self._lock:
            msg = self.node.weights(frames)
            for ident, out in self.node.to_downstream():  # forward first: the next hop starts now
                await self.down.send(ident, out)
            if 0 < self.stall_after_chunks <= self.node.stats["forwarded_chunks"]:
                print(f"stalled after {self.stall_after_chunks} chunks", flush=True)
                await anyio.sleep_forever()
            if msg is None:
                return
            if isinstance(msg, WeightsAnnounce):
                self._started.setdefault(msg.version, time.monotonic())
            if self.node.completes(msg):  # the checksums of a whole version: off the loop
                events = await anyio.to_thread.run_sync(self.node.assemble, msg)
            else:  # one chunk's copy into the mapped file: cheaper than a thread hop
                events = self.node.assemble(msg)
        for ev in events:
            if isinstance(ev, Completed):
                w = ev.weights
                path = self.files.finish(w.transfer_id)
                took = time.monotonic() - self._started.pop(w.version, time.monotonic())
                self.node.file_ready(w.version, w.transfer_id, path, took)
        self._poke()

    async def _upstream_loop(self) -> None:
        async with anyio.create_task_group() as tg:
            current: anyio.CancelScope | None = None
            async for upstream in self._routes_out:
                if current is not None:
                    current.cancel()
                current = anyio.CancelScope()
                if upstream:
                    tg.start_soon(self._pull, upstream, current)

    async def _pull(self, upstream: str, scope: anyio.CancelScope) -> None:
        ch = ZmqClientChannel(
            upstream, token=self._token(), max_message_bytes=self.max_message_bytes
        )
        try:
            with scope:
                await ch.send(self.node.hello_upstream())
                while True:
                    await self._on_weights(await ch.recv())
        finally:
            with anyio.CancelScope(shield=True):
                await ch.send(codec.encode(Bye("re-routed")))
                await ch.aclose()

    async def _downstream_loop(self) -> None:
        while True:
            identity, frames = await self.down.recv()
            async with self._lock:  # a joiner gets the frames so far, then every later one
                self.node.from_downstream(identity, frames)
                for ident, out in self.node.to_downstream():
                    await self.down.send(ident, out)

    async def _pump(self) -> None:
        while True:
            self._wake = anyio.Event()
            now = time.monotonic()
            for ev in self.node.tick(now):
                if isinstance(ev, LearnerLost):
                    self._learner_scope.cancel()
            if self._learner is not None:
                for frames in self.node.to_learner(now):
                    await self._learner.send(frames)
            with anyio.move_on_after(max(0.0, self.node.next_deadline() - time.monotonic())):
                await self._wake.wait()
