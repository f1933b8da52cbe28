"""Shipping finished groups to the learner: batching, a crash-safe spool, back-pressure, acks.

``Shipper`` owns a ``RolloutClient``. Episodes hand it whole groups (``ship_group``); every
``groups_per_batch`` groups become one column-wise batch (``TrajectoryBuilder``), which is written
to the spool directory (one batch file, fsynced, renamed into place; format in RECORDING.md)
*before* the protocol sees it. The protocol keeps it in memory and resends it across reconnects;
the spool covers the other failure, this process dying: a new ``Shipper`` on the same directory
resubmits every file left there (decoded with ``protocol.codec``, so it is validated again, and
re-encoded under new sequence numbers of the new connection epoch). A resent batch may reach the
learner twice; the learner deduplicates by trajectory id, so delivery is at-least-once + dedup.

A spool file is deleted when its batch is acknowledged, and only then are the groups'
``on_acked`` callbacks called (the data cursor commits there), so a prompt counts as done only
once the learner owns its trajectories. Batches recovered from the spool have no callbacks (they
died with their process); their group uids are announced instead (``recovered_group_uids`` at
start, ``on_recovered_acked`` on acknowledgement), so the server neither reruns those prompts
nor loses track of them (``PromptSource.hold_groups`` / ``commit_group``). ``ship_group`` waits while ``max_unacked_batches``
batches are unacknowledged: that is what stops a server from running ahead of a slow learner.

Events other than acknowledgements (weights, connection changes, errors) go to ``events``, which
the owner must read (the rollout server applies weights from it); like the driver's, the stream
is bounded and a reader that falls behind slows acknowledgement handling rather than losing
events.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from common.logging import get_logger
from protocol.batch import Trajectories, TrajectoryBuilder
from protocol.driver import RolloutClient
from protocol.errors import ErrorCode
from protocol.events import BatchAcked, BatchRejected, Event
from protocol.sender import SenderState, encode_batch
from protocol.trajectory import Trajectory
from rollout_service.metrics import RolloutStats
from rollout_service.recording import (
    BatchFileError,
    Recorder,
    batch_files,
    batch_path,
    read_batch_file,
    remove_temporaries,
    write_batch_file,
)

Callback = Callable[[], None]


class ShippingError(RuntimeError):
    """The shipper cannot deliver any more (the connection failed for good, or it was stopped)."""


@dataclass
class _InFlight:
    """A batch in the spool, handed to the protocol, waiting for its acknowledgement."""

    path: Path
    trajectories: int
    callbacks: list[Callback] = field(default_factory=list)
    on_refused: list[Callback] = field(default_factory=list)  # after callbacks, if refused
    recovered_groups: list[str] | None = None  # set for batches a previous process left behind


class Shipper:
    def __init__(
        self,
        client: RolloutClient,
        *,
        spool_dir: str | os.PathLike[str],
        server_id: str,
        groups_per_batch: int = 1,
        max_unacked_batches: int = 8,
        recorder: Recorder | None = None,
        stats: RolloutStats | None = None,
        event_buffer: int = 256,
        on_recovered_acked: Callable[[list[str]], None] | None = None,
    ) -> None:
        if groups_per_batch < 1 or max_unacked_batches < 1:
            raise ValueError("groups_per_batch and max_unacked_batches must be >= 1")
        self.client, self.server_id = client, server_id
        self.spool_dir = Path(spool_dir)
        self.groups_per_batch, self.max_unacked_batches = groups_per_batch, max_unacked_batches
        self.recorder, self.stats = recorder, stats
        self._send_events, self.events = anyio.create_memory_object_stream[Event](event_buffer)
        self._builder = TrajectoryBuilder()
        self._groups = 0
        self._callbacks: list[Callback] = []
        self._on_refused: list[Callback] = []
        self._in_flight: dict[int, _InFlight] = {}  # wire seq -> batch
        self._unacked = 0  # batches built and not yet acknowledged (being spooled included)
        self._spooled = 0
        self._next_spool = 1
        self._ready, self._changed = anyio.Event(), anyio.Event()
        self._stopped: str | None = None
        self.on_recovered_acked = on_recovered_acked
        """Called with the group uids of a batch resubmitted from the spool once it is acknowledged
        (their on_acked callbacks died with the process that shipped them)."""
        self.recovered_group_uids: set[str] = set()
        """Groups resubmitted from the spool at start; the server should not rerun them."""
        self._log = get_logger(__name__, server_id=server_id)

    @property
    def unacked(self) -> int:
        """Batches built and not yet acknowledged by the learner."""
        return self._unacked

    @property
    def spooled(self) -> int:
        """Batch files in the spool."""
        return self._spooled

    # -- running -----------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the client and the acknowledgement pump; resubmit what a previous process left in
        the spool before any new group is accepted. Returns after ``close`` once the connection is
        closed; raises ``ShippingError`` when the learner refused us for good."""
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.client.run)
                tg.start_soon(self._pump)
                await self._recover()
                self._ready.set()
                task_status.started()
        finally:
            self._stop("the shipper stopped")
        if self.client.conn.state is SenderState.FAILED:
            err = self.client.conn.fatal_error
            what = f"{_code_name(err.code)}: {err.message}" if err else "unknown error"
            raise ShippingError(f"the learner refused this server: {what}")

    async def close(self, reason: str = "") -> None:
        """Say BYE; batches not yet acknowledged stay in the spool for the next start."""
        await self.client.close(reason)

    # -- shipping ----------------------------------------------------------------------------------

    async def ship_group(
        self,
        trajectories: Sequence[Trajectory],
        *,
        on_acked: Callback | None = None,
        on_refused: Callback | None = None,
    ) -> None:
        """Add one whole group; ship a batch when ``groups_per_batch`` are collected. Waits while
        ``max_unacked_batches`` batches are unacknowledged. ``on_acked`` runs once the learner has
        acknowledged (or refused as invalid) the batch holding this group, then ``on_refused`` if
        it refused it."""
        if not trajectories:
            raise ValueError("a group needs at least one trajectory")
        for t in trajectories:  # all checked before any is appended: a group goes in whole or not
            n = len(t.response_ids)
            if not len(t.response_mask) == len(t.rollout_logprobs) == len(t.versions) == n:
                raise ValueError(f"trajectory {t.trajectory_id}: response arrays differ in length")
        await self._ready.wait()
        while self._unacked >= self.max_unacked_batches:
            self._raise_if_stopped()
            await self._changed.wait()
        self._raise_if_stopped()
        # From the check above to the build below nothing awaits, so the unacked count never
        # exceeds the limit however many episodes call in at once.
        for t in trajectories:
            self._builder.append(t)
        if on_acked is not None:
            self._callbacks.append(on_acked)
        if on_refused is not None:
            self._on_refused.append(on_refused)
        self._groups += 1
        if self._groups >= self.groups_per_batch:
            await self._ship_current()

    async def flush(self) -> None:
        """Ship the groups collected so far even if fewer than ``groups_per_batch``."""
        await self._ready.wait()
        self._raise_if_stopped()
        if self._groups:
            await self._ship_current()

    async def drain(self) -> None:
        """Flush, then wait until the learner has acknowledged every batch."""
        await self.flush()
        while self._unacked:
            self._raise_if_stopped()
            await self._changed.wait()

    async def _ship_current(self) -> None:
        batch = self._builder.build()
        callbacks, self._callbacks, self._groups = self._callbacks, [], 0
        on_refused, self._on_refused = self._on_refused, []
        self._unacked += 1
        n, self._next_spool = self._next_spool, self._next_spool + 1
        path = batch_path(self.spool_dir, n)
        # Shielded (bounded: one file write): an episode cancelled here must not leave a batch
        # spooled but never submitted, which nothing would ever acknowledge.
        with anyio.CancelScope(shield=True):
            try:
                # The spool's own number goes in the file (wire seqs are per connection epoch and
                # are reassigned when a later process resends it).
                await anyio.to_thread.run_sync(
                    lambda: write_batch_file(
                        path, encode_batch(n, batch), server_id=self.server_id, seq=n, durable=True
                    )
                )
            except BaseException:
                self._unacked -= 1  # not shipped: the caller gets the error, the prompts rerun
                self._notify()
                raise
            self._spooled += 1
            seq = await self.client.submit(batch)
            self._in_flight[seq] = _InFlight(path, len(batch), callbacks, on_refused)
            self._report()
            if self.stats is not None:
                self.stats.batch_shipped(len(batch))
            if self.recorder is not None:
                await self.recorder.record(seq, encode_batch(seq, batch))

    async def _recover(self) -> None:
        await anyio.to_thread.run_sync(remove_temporaries, self.spool_dir)
        files = await anyio.to_thread.run_sync(batch_files, self.spool_dir)
        if files:
            self._next_spool = files[-1][0] + 1
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        for _, path in files:
            try:
                _, msg = await anyio.to_thread.run_sync(
                    read_batch_file, path, self.client.conn.limits
                )
            except BatchFileError as e:
                # Renamed into place only when complete, so this is damage, not a torn write: keep
                # it for inspection, out of the way of the next start.
                self._log.error("unreadable spool file set aside", error=str(e))
                await anyio.to_thread.run_sync(_set_aside, path, "corrupt")
                continue
            trajectories = msg.trajectories
            assert isinstance(trajectories, Trajectories)  # what codec.decode returns
            self._unacked += 1
            self._spooled += 1
            seq = await self.client.submit(trajectories)
            uids = list(dict.fromkeys(trajectories.meta["group_uid"]))
            self._in_flight[seq] = _InFlight(path, len(trajectories), recovered_groups=uids)
            self.recovered_group_uids.update(uids)
        if files:
            self._log.info(
                "resubmitted batches left in the spool",
                batches=self._unacked,
                groups=len(self.recovered_group_uids),
            )
        self._report()

    # -- acknowledgements ------------------------------------------------------------------------

    async def _pump(self) -> None:
        async with self._send_events:
            async for ev in self.client.events:
                if isinstance(ev, BatchAcked):
                    await self._settle(ev.seqs)
                elif isinstance(ev, BatchRejected):
                    self._log.error(
                        "the learner refused a batch as invalid; it is kept under spool/rejected",
                        seq=ev.seq,
                        error=ev.error.message,
                    )
                    await self._settle([ev.seq], rejected=True)
                else:
                    await self._send_events.send(ev)

    async def _settle(self, seqs: Sequence[int], *, rejected: bool = False) -> None:
        for seq in seqs:
            batch = self._in_flight.pop(seq, None)
            if batch is None:
                continue  # acknowledged twice (resent after a reconnect): already settled
            if rejected:
                await anyio.to_thread.run_sync(_set_aside, batch.path, "rejected")
            else:
                await anyio.to_thread.run_sync(lambda p=batch.path: p.unlink(missing_ok=True))
            self._spooled -= 1
            self._unacked -= 1
            # A refused batch is final too: rerunning its prompts would only stall the cursor.
            for callback in [*batch.callbacks, *(batch.on_refused if rejected else ())]:
                callback()
            if batch.recovered_groups is not None and self.on_recovered_acked is not None:
                self.on_recovered_acked(batch.recovered_groups)
            if self.stats is not None:
                self.stats.batches_acked(1)
        self._report()
        self._notify()

    # -- helpers -----------------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _stop(self, reason: str) -> None:
        self._stopped = reason
        self._ready.set()  # callers waiting for start-up must see the failure, not hang
        self._notify()

    def _raise_if_stopped(self) -> None:
        if self._stopped is not None:
            raise ShippingError(self._stopped)

    def _report(self) -> None:
        if self.stats is not None:
            self.stats.set_queue_depths(spool=self._spooled, unacked=self._unacked)


def _code_name(code: int) -> str:
    return ErrorCode(code).name if code in ErrorCode._value2member_map_ else f"error {code}"


def _set_aside(path: Path, folder: str) -> None:
    target = path.parent / folder
    target.mkdir(exist_ok=True)
    os.replace(path, target / path.name)
