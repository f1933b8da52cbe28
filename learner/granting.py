"""The learner link's admission part: ``learner.admission``'s sans-IO policy wired to the protocol.

Design: ``configure`` turns admission on (protocol 1.3): rollout servers that offer it start
prompt groups only under grants (ADMIT) that this part sends whenever the policy's window has
room, always on the newest published version. The window opens when a server joins or leaves,
when groups arrive (the server has slots free again), and when a step trained or dropped groups.
A server that leaves takes its grants with it; they go to the servers still here. Without
``configure`` every method is a no-op and every step may go ahead.

The intake asks it two questions about a step: ``can_take`` (can what a step leaves behind,
groups still generating included, all be trained in time) and ``idle`` (nothing is generating
although some ready server does not take grants, so waiting may still bring groups).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import structlog

from common.timeline import GRANT_EVENT, TimelineWriter, Track
from learner.admission import Admission
from learner.buffer import Group, GroupBuffer
from protocol.driver import LearnerServer
from protocol.events import PeerClosed, PeerJoined, PeerTimedOut


class Granting:
    def __init__(
        self,
        server: LearnerServer,
        buffer: GroupBuffer,
        *,
        timeline: TimelineWriter,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        """``buffer``: the intake's, read for the groups received and not yet trained."""
        self._server, self._proto, self._buffer = server, server.proto, buffer
        self._timeline, self._log = timeline, log
        self.policy: Admission | None = None
        self.remaining = 0  # groups the run can still train (no grants beyond)
        self.closed = False

    def configure(self, batch_groups: int, max_staleness: int, remaining_groups: int) -> None:
        """Grant rollout servers that offer admission the groups a run of ``remaining_groups`` more
        groups, ``batch_groups`` per step, needs at ``max_staleness``. Call before the link runs."""
        self.policy = Admission(batch_groups, max_staleness)
        self.remaining = remaining_groups
        self._proto.admission = True
        # Room for every admitted group (one batch each at worst) and the credits promised, so a
        # group the learner waits for can always be delivered.
        self._proto.capacity = max(self._proto.capacity, 2 * self.policy.window)
        self._log.info(
            "admission",
            window=self.policy.window,
            groups_per_step=batch_groups,
            max_staleness=max_staleness,
            groups_left=remaining_groups,
        )

    def whole_batches(self) -> None:
        """Mixed runs: grants go to servers in whole schedule batches (``Admission.chunk``)."""
        if self.policy is not None:
            self.policy.chunk = self.policy.batch_groups

    @property
    def generating(self) -> int:
        """Groups granted and still generating (-1: no admission)."""
        return self.policy.generating if self.policy is not None else -1

    def generating_from(self) -> float:
        """The oldest version a group that can still arrive starts from: inf when none can (no
        grant outstanding); -inf when unknown (no admission, or a server in session that does not
        take grants and may send any group)."""
        proto = self._proto
        if self.policy is None or not set(proto.ready_peers()) <= set(proto.admission_peers()):
            return -math.inf
        oldest = self.policy.oldest_generating()
        return math.inf if oldest is None else float(oldest)

    def on_joined(self, ev: PeerJoined) -> None:
        if self.policy is None:
            return
        if ev.peer_id in self._proto.admission_peers():
            # A new session: earlier grants are void.
            self.policy.joined(ev.peer_id, ev.hello.slots)
        else:
            self.policy.left(ev.peer_id)
        self.admit()

    def on_left(self, ev: PeerClosed | PeerTimedOut) -> bool:
        """``ev``'s server left; True when it took grants with it (granted again to the servers
        still here): nothing more is to be waited for from it."""
        if self.policy is not None and self.policy.left(ev.peer_id):
            self.admit()
            return True
        return False

    def received(self, peer_id: str, groups: list[Group], pass_rate: float = 1.0) -> None:
        """``groups`` arrived from ``peer_id`` (filtered ones included: they used grants too);
        ``pass_rate``: the share of groups dynamic sampling expects to keep (1: no filter)."""
        if self.policy is not None:
            self.policy.pass_rate = pass_rate
            for g in groups:
                self.policy.received(peer_id, g.oldest_version)
            self.admit()  # the server has slots free again

    def trained(self, n_groups: int) -> None:
        self.remaining = max(0, self.remaining - n_groups)
        self.admit()

    def can_take(self, deadlines: Iterable[int], policy_version: int) -> bool:
        """Whether a step of ``policy_version`` may go ahead, leaving received groups with
        ``deadlines`` behind (``Admission.can_take``). Without admission: yes."""
        return self.policy is None or self.policy.can_take(deadlines, policy_version)

    def idle(self) -> bool:
        """With admission, nothing is generating: only servers that take no grants can send more."""
        return self.policy is not None and not self.policy.generating

    def admit(self) -> None:
        """Grant what the admission window has room for, on the newest published version."""
        if self.policy is None or self.closed:
            return
        held = len(self._buffer) + self._buffer.in_flight
        version = self._proto.policy_version
        for peer, n in self.policy.grants(held=held, remaining=self.remaining, min_version=version):
            self._server.admit(peer, n, version)
            self._timeline.instant(
                Track.ADMISSION, GRANT_EVENT, server=peer, groups=n, min_version=version
            )
            self._log.debug("groups admitted", peer=peer, groups=n, min_version=version)
