"""The learner link's weight part: announce a policy version, learn which version each rollout
server runs, and time how long a version took to reach them all.

Design: ``learner.publisher.WeightPublisher`` decides what a version's bytes are and where they
live (a slot file or memory); this part only hands them to the protocol (``announce``: servers on
this machine get the file's name, the others chunks) and reads the answers. Each server's version
is its last WEIGHTS_APPLIED(ok), else the version its HELLO named; a version counts as applied
once no connected server runs an older one, and then ``metrics`` reports ``weights/applied_s``
(from the start of the publish, gather included, until the last server generates with it) and
``weights/apply_s`` (the slowest server's own load time).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from common.timeline import PUBLISH_EVENT, TimelineWriter, Track
from protocol.driver import LearnerServer
from protocol.events import PeerClosed, PeerJoined, PeerTimedOut, PeerWeightsApplied
from protocol.weights import NamedBuffer


class WeightAnnouncer:
    def __init__(
        self,
        server: LearnerServer,
        *,
        chunk_bytes: int,
        timeline: TimelineWriter,
        log: structlog.stdlib.BoundLogger,
        on_announced: Callable[[int], None],
    ) -> None:
        """``chunk_bytes``: the size of the chunks cut for servers that take no file
        (``transport.weight_chunk_bytes``); ``on_announced(version)``: told of every version
        announced (the intake's staleness rule follows the newest)."""
        self._server, self._proto = server, server.proto
        self._chunk_bytes, self._timeline, self._log = chunk_bytes, timeline, log
        self._on_announced = on_announced
        self._peer_versions: dict[str, int] = {}
        self._published_at: dict[int, float] = {}  # version -> when publishing began (monotonic)
        self._applied: dict[int, dict[str, float]] = {}  # version -> weights/* once all applied
        self._apply_times: dict[int, list[float]] = {}  # version -> each server's apply_time_s

    def announce(
        self,
        version: int,
        tensors: list[NamedBuffer],
        *,
        file: str = "",
        started: float | None = None,
    ) -> bool:
        """Send policy ``version`` to every rollout server (and to joiners that ask). The buffers must
        stay unchanged until the next announce. With ``file`` (a safetensors file holding exactly
        ``tensors``), servers on this machine load that file instead of receiving chunks.
        ``started``: when gathering the weights began (``time.monotonic``), for ``weights/applied_s``.

        Returns whether chunks were cut from the version this one replaces: ZeroMQ may then still be
        sending slices of its buffers (read just before the announce, with no await in between, so
        no later planning is missed; `learner.publisher` retires such a slot file)."""
        replaced_chunked = self._proto.routing.chunks_planned
        self._published_at[version] = time.monotonic() if started is None else started
        self._server.publish_weights(version, tensors, chunk_bytes=self._chunk_bytes, file=file)
        self._timeline.instant(
            Track.WEIGHTS, PUBLISH_EVENT, version=version, via="file" if file else "chunks"
        )
        self._on_announced(version)
        return replaced_chunked

    def on_joined(self, ev: PeerJoined) -> None:
        if ev.hello.policy_version >= 0:
            self._peer_versions[ev.peer_id] = ev.hello.policy_version
        else:
            self._peer_versions.pop(ev.peer_id, None)

    def on_left(self, ev: PeerClosed | PeerTimedOut) -> None:
        self._peer_versions.pop(ev.peer_id, None)

    def on_applied(self, ev: PeerWeightsApplied) -> None:
        a = ev.applied
        if a.ok:
            self._peer_versions[ev.peer_id] = a.version
            self._note_applied(a.version, a.apply_time_s)
        self._log.debug(
            "weights applied",
            peer=ev.peer_id,
            version=a.version,
            ok=a.ok,
            error=a.error,
            apply_time_s=a.apply_time_s,
        )

    def _note_applied(self, version: int, apply_time_s: float) -> None:
        """Once every connected server runs ``version``: how long that took from the publish."""
        self._apply_times.setdefault(version, []).append(apply_time_s)
        started = self._published_at.get(version)
        if started is None or any(v < version for v in self._peer_versions.values()):
            return
        times = self._apply_times.pop(version)
        self._applied[version] = {
            "weights/applied_s": time.monotonic() - started,
            "weights/apply_s": max(times),
            "weights/version": version,
        }
        for old in [v for v in self._published_at if v <= version]:
            self._published_at.pop(old)
            self._apply_times.pop(old, None)

    def metrics(self) -> dict[str, float]:
        """``weights/*`` of the newest version every server applied since the last call ({} if none):
        ``applied_s`` from the start of the publish until the last server generates with it,
        ``apply_s`` the slowest server's own load time."""
        if not self._applied:
            return {}
        newest = self._applied[max(self._applied)]
        self._applied.clear()
        return newest

    @property
    def peer_versions(self) -> dict[str, int]:
        """Policy version each connected rollout server generates with: its last WEIGHTS_APPLIED(ok),
        else the version its HELLO named (servers that asked for the current weights are absent
        until they applied them)."""
        return dict(self._peer_versions)

    @property
    def policy_version(self) -> int:
        """The latest version announced (or restored from the intake's state)."""
        return self._proto.policy_version

    def file_peers_oldest_version(self) -> int | None:
        """The lowest version applied by a connected rollout server that loads weights files (None:
        no such server): slot files of older versions will not be read again."""
        return self._proto.routing.file_peers_oldest_version()
