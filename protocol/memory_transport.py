"""In-memory channels (anyio memory streams): the drivers without sockets, under asyncio or trio.

A first-class fake for unit tests of the drivers and of application logic. Frames are copied to
``bytes`` on send, as a real transport would, so no test can pass by sharing buffers.
"""

from __future__ import annotations

import itertools

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from protocol.codec import view
from protocol.sender import Frames


def _copy(frames: Frames) -> Frames:
    return [bytes(view(f).cast("B")) for f in frames]


class MemoryHub:
    """Plays the network: one server inbox, one inbox per client channel, keyed by identity."""

    def __init__(self) -> None:
        self._server_tx, self._server_rx = anyio.create_memory_object_stream[tuple[bytes, Frames]](
            1 << 16
        )
        self._clients: dict[bytes, MemoryObjectSendStream[Frames]] = {}
        self._ids = itertools.count(1)
        self.drop_to_clients = False  # simulate a one-way outage (learner -> rollout)

    def server(self) -> MemoryServerChannel:
        return MemoryServerChannel(self)

    async def connect(self) -> MemoryClientChannel:
        identity = next(self._ids).to_bytes(4, "big")
        tx, rx = anyio.create_memory_object_stream[Frames](1 << 16)
        self._clients[identity] = tx
        return MemoryClientChannel(self, identity, rx)


class MemoryServerChannel:
    def __init__(self, hub: MemoryHub) -> None:
        self.hub = hub

    async def send(self, identity: bytes, frames: Frames) -> None:
        tx = self.hub._clients.get(identity)
        if tx is not None and not self.hub.drop_to_clients:  # unroutable: dropped, like a ROUTER
            await tx.send(_copy(frames))

    async def recv(self) -> tuple[bytes, Frames]:
        return await self.hub._server_rx.receive()

    async def aclose(self) -> None:
        pass


class MemoryClientChannel:
    def __init__(
        self, hub: MemoryHub, identity: bytes, rx: MemoryObjectReceiveStream[Frames]
    ) -> None:
        self.hub, self.identity, self._rx = hub, identity, rx

    async def send(self, frames: Frames) -> None:
        await self.hub._server_tx.send((self.identity, _copy(frames)))

    async def recv(self) -> Frames:
        return await self._rx.receive()

    async def aclose(self) -> None:
        self.hub._clients.pop(self.identity, None)
        self._rx.close()
