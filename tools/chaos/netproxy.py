"""The network between the learner and its rollout servers, with faults: a TCP proxy in the chaos run.

Design: the rollout servers connect to the proxy's port instead of the learner's; every accepted
connection is piped to the learner in both directions by two pumps, each a reader and a writer
joined by a bounded queue, so a writer that may not send makes its reader stop reading and the
sender's socket buffer fill, as across a real link that carries nothing. Per connection a `Link`
says what the network does now:

- a partition: nothing is carried either way until it ends (the connections stay open, as TCP's
  do across a cut that heals before its retransmissions give up);
- a delay: every chunk is held this long before it goes on;
- loss, as TCP's peers see it: a lost segment is sent again after a retransmission timeout, and
  everything behind it waits (head-of-line), so each chunk is held, with the loss probability, for
  one timeout of 0.2-1 s, in order;
- a reset: both sides get an RST (SO_LINGER 0), as when a middlebox drops the connection.

This kernel has no netem (CONFIG_NET_SCH_NETEM is not set), so packet loss is not dropped at the IP
level here: its effect on the byte stream is. The proxy runs its own event loop in a thread; the
chaos run sets a link's faults from its own thread through `FaultProxy.set`, which only assigns
fields that the pumps read.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

CHUNK = 64 * 1024
QUEUE_CHUNKS = 64  # at most 4 MiB held per direction; then the sender is pushed back


@dataclass
class Link:
    """What the network does to one connection now (the chaos thread writes, the pumps read)."""

    client_port: int
    partitioned_until: float = 0.0
    delay_s: float = 0.0
    loss: float = 0.0
    impaired_until: float = 0.0  # delay and loss hold until then
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    carried: int = 0  # bytes, both ways

    def hold_s(self, rng: random.Random, now: float) -> float:
        if now >= self.impaired_until:
            return 0.0
        lost = rng.random() < self.loss
        return self.delay_s + (rng.uniform(0.2, 1.0) if lost else 0.0)


class FaultProxy:
    """``FaultProxy(upstream_port).start()`` listens on 127.0.0.1:``port`` and pipes every
    connection to 127.0.0.1:``upstream_port``; ``links()`` are the live connections."""

    def __init__(self, upstream_port: int, seed: int = 0) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._rng = random.Random(seed)
        self._links: dict[int, Link] = {}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-netproxy", daemon=True)
        self._server: asyncio.Server | None = None

    # -- the chaos thread's side -----------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the chaos network proxy did not start")
        return self

    def links(self) -> list[Link]:
        return [link for link in list(self._links.values()) if link.writers]

    def partition(self, link: Link, seconds: float) -> None:
        link.partitioned_until = time.monotonic() + seconds

    def impair(
        self, link: Link, seconds: float, *, delay_s: float = 0.0, loss: float = 0.0
    ) -> None:
        link.delay_s, link.loss = delay_s, loss
        link.impaired_until = time.monotonic() + seconds

    def reset(self, link: Link) -> None:
        self._loop.call_soon_threadsafe(self._reset, link)

    def stop(self) -> None:
        """Reset every connection, end every task, then the loop and its thread."""
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_closed() and not self._thread.is_alive():
            self._loop.close()

    # -- the proxy's loop ------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", 0, reuse_address=True)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links.values()):
            self._reset(link)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client_port = writer.get_extra_info("peername")[1]
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        link = self._links[client_port] = Link(client_port, writers=[writer, up_writer])
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._pump(reader, up_writer, link))
                tg.create_task(self._pump(up_reader, writer, link))
        except* (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._reset(link)
            self._links.pop(client_port, None)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

        async def read() -> None:
            last = 0.0
            while data := await reader.read(CHUNK):
                now = time.monotonic()
                last = max(last, now + link.hold_s(self._rng, now))  # in order, as TCP delivers
                await queue.put((last, data))
            await queue.put((0.0, b""))

        async def write() -> None:
            while True:
                release, data = await queue.get()
                if not data:
                    writer.close()  # the other side closed: pass it on
                    return
                while (now := time.monotonic()) < max(release, link.partitioned_until):
                    await asyncio.sleep(min(0.05, max(release, link.partitioned_until) - now))
                writer.write(data)
                await writer.drain()
                link.carried += len(data)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(read())
            tg.create_task(write())

    def _reset(self, link: Link) -> None:
        for writer in link.writers:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    # linger 0: close sends an RST, not a FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        link.writers = []
