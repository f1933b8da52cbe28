"""The learner's link: the one owner of the learner's connection to every rollout server.

``LearnerLink`` binds ``learner.bind_address`` (the protocol server of the run config,
``build_server``: the tokenizer of ``actor_rollout_ref.model.path``, token ids checked against its
vocabulary, ``transport.auth``), runs the event loop, and hands each event to the narrow part that
owns what it is about. The trainer talks to those parts, not to the link:

- ``intake`` (``learner.intake``): the journal, the buffer, the credits, the dedup state; the
  trainer takes groups from it and marks them trained.
- ``weights`` (``learner.announcer``): announces policy versions, learns which one each server runs
  and times how long a version took to reach them all.
- ``validation`` (``learner.validation``): the validation rounds the trainer opens.
- ``admission`` (``learner.granting``): the grants of protocol 1.3.
- ``peer_logs`` (``learner.peer_logs``): rate-limited logs and counts of what peers did wrong.

Design: the dispatch table (``_routes``) is the whole of the link's logic: for each event kind the
parts that hear of it, in order. A part never calls the socket; it calls the protocol driver
(``protocol.driver.LearnerServer``), which the link runs. ``close`` says BYE to every server and
wakes every waiter; ``run`` then returns, and the final stats are written to
``RUN_DIR/intake_stats.json``. ``learner.intake_only`` runs the link without a trainer.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from common.config.root import Config
from common.logging import get_logger
from common.peer_auth import auth_mode, token_path
from common.timeline import TimelineWriter
from learner import group_filter
from learner.announcer import WeightAnnouncer
from learner.bind import build_server
from learner.buffer import GroupBuffer
from learner.granting import Granting
from learner.intake import Intake, open_journal, persist
from learner.peer_logs import PeerLogs
from learner.validation import Validations
from protocol.events import (
    BatchReceived,
    BatchRefused,
    Event,
    PeerClosed,
    PeerError,
    PeerJoined,
    PeerTimedOut,
    PeerWeightsApplied,
    ProtocolViolation,
    ValidationAbandoned,
    ValidationReceived,
)
from protocol.lineage import NO_RESTARTS, Lineage

LOGGER = "learner.intake"


class LearnerLink:
    """The link of one learner process. ``state``: an earlier intake's ``state_dict`` to resume from
    (a checkpoint's); ``journal_dir``: where accepted batches are stored (default
    ``run_dir/intake-journal``); ``fresh``: without a state, delete the journal instead of replaying
    it (a new run). Binds the socket at once; ``run`` serves it."""

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        *,
        state: dict[str, Any] | None = None,
        journal_dir: Path | None = None,
        fresh: bool = False,
        timeline: TimelineWriter | None = None,
        lineage: Lineage = NO_RESTARTS,
    ) -> None:
        """``lineage``: the run's restarts (``learner.versions``), by which accepted data is aged."""
        self.config, self.run_dir = config, Path(run_dir)
        timeline = timeline if timeline is not None else TimelineWriter.off()
        log = self._log = get_logger(LOGGER)
        self.peer_logs = PeerLogs(log, auth_mode(config))
        self._journal = journal = open_journal(
            journal_dir or self.run_dir / "intake-journal",
            fresh=fresh,
            resumed=state is not None,
            log=log,
        )
        try:
            self._server, self._channel = build_server(
                config,
                persist=partial(persist, journal),
                publish_initial=False,
                run_dir=self.run_dir,
                on_refused=self.peer_logs.refused,
            )
        except BaseException:
            journal.close()
            raise
        self.address: str = self._channel.address
        self.token: str | None = self._channel.token  # what clients present (transport.auth)
        self._proto = self._server.proto
        buffer = GroupBuffer(lineage)
        self.admission = Granting(self._server, buffer, timeline=timeline, log=log)
        try:
            self.intake = Intake(
                self._server,
                journal,
                buffer,
                self.admission,
                state=state,
                log=log,
                group_filter=group_filter.from_config(config),
            )
        except BaseException:
            self._channel.close()
            journal.close()
            raise
        self.weights = WeightAnnouncer(
            self._server,
            chunk_bytes=config.transport.weight_chunk_bytes,
            timeline=timeline,
            log=log,
            on_announced=self.intake.announced,
        )
        self.validation = Validations(self._server, log)
        left = (self.weights.on_left, self._left)
        self._routes: dict[type[Event], tuple[Callable[[Any], None], ...]] = {
            BatchReceived: (self.intake.on_batch,),
            BatchRefused: (self.intake.on_refused,),
            PeerJoined: (
                self.validation.on_joined,
                self.weights.on_joined,
                self._joined,
                self.admission.on_joined,
            ),
            PeerClosed: left,
            PeerTimedOut: left,
            PeerWeightsApplied: (self.weights.on_applied,),
            ValidationReceived: (self.validation.on_result,),
            ValidationAbandoned: (self.validation.on_abandoned,),
            ProtocolViolation: (self.peer_logs.on_violation,),
            PeerError: (self.peer_logs.on_error,),
        }
        self._closed = self._started = False
        self._born = time.monotonic()

    async def run(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve rollout servers until ``close`` (BYE sent to each) or cancellation. Reports the
        bound address through ``task_status``."""
        if self._started:
            raise RuntimeError("LearnerLink.run() runs once")
        self._started = True
        if self._closed:  # closed before it ran: close() released everything
            task_status.started(self.address)
            return
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self._server.run)
                mode = auth_mode(self.config)
                self._log.info(
                    "listening",
                    address=self.address,
                    auth=mode,
                    token_file=str(token_path(self.config, self.run_dir))
                    if mode == "token"
                    else None,
                    tokenizer=self._proto.tokenizer.name,
                    buffer_batches=self._proto.capacity,
                    buffered_groups=self.intake.stats()["buffered_groups"],
                )
                task_status.started(self.address)
                tg.start_soon(self.peer_logs.flush_every)
                async for ev in self._server.events:
                    for handle in self._routes.get(type(ev), ()):
                        handle(ev)
                # The server has stopped (its events ended): stop the flusher.
                tg.cancel_scope.cancel()
        finally:
            self.peer_logs.flush(all_windows=True)
            self._close_parts()
            with anyio.CancelScope(shield=True):
                await self._channel.aclose()
            self._journal.close()
            summary = self.summary()
            self._log.info("intake stopped", **summary)
            # A report: never worth failing the shutdown for.
            with contextlib.suppress(OSError):
                (self.run_dir / "intake_stats.json").write_text(
                    json.dumps(summary, indent=2) + "\n"
                )

    def close(self) -> None:
        """Say BYE to every rollout server and stop; ``run`` returns once that is sent. Waiting
        ``next_batch`` calls raise ``IntakeClosed``."""
        if self._closed:
            return
        self._server.close()
        self._close_parts()
        if not self._started:  # run() will never clean up: do it now
            self._channel.close()
            self._journal.close()

    @property
    def stats(self) -> dict[str, int | float]:
        return {
            "peers": len(self._proto.ready_peers()),
            **self.intake.stats(),
            **self.peer_logs.stats(),
        }

    def summary(self) -> dict[str, int | float]:
        """``stats`` plus rates since the link was made (the periodic log line)."""
        s = self.stats
        dt = max(time.monotonic() - self._born, 1e-9)
        return {
            **s,
            "traj_per_s": round(s["trajectories"] / dt, 1),
            "tokens_per_s": round(s["tokens"] / dt),
        }

    def _close_parts(self) -> None:
        self._closed = self.admission.closed = True
        self.intake.close()
        self.validation.close()

    def _joined(self, ev: PeerJoined) -> None:
        self._log.info(
            "rollout server joined",
            peer=ev.peer_id,
            epoch=ev.hello.epoch,
            policy_version=ev.hello.policy_version,
        )

    def _left(self, ev: PeerClosed | PeerTimedOut) -> None:
        self._log.info("rollout server left", peer=ev.peer_id, why=type(ev).__name__)
        # Its grants go to the servers still here, and nothing is to be waited for from it.
        if self.admission.on_left(ev):
            self.intake.wake()
