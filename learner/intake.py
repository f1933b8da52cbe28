"""The learner's intake: rollout servers stream trajectory batches in, the trainer takes groups out.

``Intake`` is the learner-side endpoint of protocol/ configured from the run config: it binds
``learner.bind_address``, checks that peers use the tokenizer of ``actor_rollout_ref.model.path``,
validates token ids against its vocabulary, deduplicates, and grants credits from a room of
``learner.buffer_batches`` batches. Design:

- Durability. Every new batch is appended to the journal (``learner.journal``, fsynced) before
  the protocol may acknowledge it (``LearnerServer(persist=...)``: the ACK is not even queued until
  the append returned), because the ACK lets the rollout server delete its copy. An append that
  fails refuses the batch (the sender keeps it and resends), it never stops the server.
- Buffer. Accepted batches are split into groups (``learner.buffer``) and wait in arrival order;
  ``next_batch`` takes the oldest fresh ones and drops stale ones as soon as it sees them. A
  batch's room is freed (credits flow again) once all its groups are trained (``mark_trained``)
  or dropped, so credits never promise more than the buffer holds.
- Checkpoints. ``state_dict`` holds the dedup state, the groups not yet trained and the journal
  position. An intake built with that state (after a crash, even SIGKILL) replays from the journal
  exactly those groups plus every record appended after the position, and re-registers their
  batches for deduplication, so nothing accepted is lost and nothing is trained twice (relative to
  the checkpointed model). ``checkpoint_saved`` compacts the journal down to what a state needs.
- Without a state the intake replays the whole journal (a learner that died before its first
  checkpoint); ``fresh=True`` deletes it instead (a new run).

- Admission (``learner.admission``, protocol 1.3). ``configure_admission`` turns it on: rollout
  servers that offer it start prompt groups only under this intake's grants, made by
  ``learner.admission.Admission`` whenever the window has room (a server joined or left, a step
  trained or dropped groups), always on the newest published version. ``next_batch`` then also
  waits for groups still generating that would be too stale after the step, and takes the buffer
  earliest deadline first. ``waste_metrics`` reports the share of generated tokens never trained
  (dropped here as stale, or dropped by the servers themselves and reported in heartbeats).

- Mixed batches (``data.datasets``, ``configure_mix``). Each step takes exactly the configured
  count of groups per data source (``common.mixing.batch_counts`` of the ratios, the counts every
  rollout server's schedule already holds), earliest deadline first within each source
  (``learner.buffer.mixed_pick``). The rule: a step first waits as it does without mixing (enough
  groups, and with admission a feasible remainder). If a source then has too few groups buffered,
  the step waits for them at most ``learner.mix_wait_s`` from that moment, or not at all when
  nothing more can arrive (the buffer is full, or with admission nothing is generating), and then
  fills the missing places from the other sources, earliest deadline first. Deadlines come before
  the mix: a group that would be too stale after the step, or that admission's feasibility needs
  trained now, takes the place of the latest-deadline group picked, so groups of one source never
  go stale waiting behind another's quota. Places not filled by their own source are counted
  (``TakenBatch.mix_shortfall``, the trainer's ``batch/mix_shortfall``); with every source
  delivering and no deadline forcing a swap, it is 0 and the batch is exactly the configured mix.
  With admission, grants go to servers in whole batches (``Admission.chunk``) while the window
  holds one per server, so what is generated is whole schedule batches, each in the exact mix.

- Validation. ``validate`` asks every connected rollout server that offers validation to run the
  validation set on a policy version and waits (bounded) for their metrics, or for them to leave
  (``learner.validation`` has the round and the metrics). Validation answers carry no trajectories:
  they never touch the buffer, the journal or the credits.

- Timeline. With a ``timeline`` writer (the trainer's, ``common.timeline``), every grant and every
  weight version published is recorded as it happens, and ``timeline_levels`` gives the buffer's
  levels for the trainer's periodic samples.

``serve`` runs the intake alone (no trainer): every batch is marked trained as soon as it arrives.
Either way the final stats are written to ``RUN_DIR/intake_stats.json`` when ``run`` returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from common.config.root import Config
from common.hostkey import host_key
from common.identity import embedding_rows, wire_identities
from common.log_throttle import PeerErrorLog
from common.logging import get_logger
from common.mixing import batch_counts
from common.peer_auth import auth_mode, learner_token, token_path
from common.timeline import GRANT_EVENT, PUBLISH_EVENT, TimelineWriter, Track
from learner.admission import Admission
from learner.buffer import Group, GroupBuffer, GroupKey, mix_shortfall, mixed_pick
from learner.journal import Journal
from learner.validation import ValidationRound
from protocol.batch import token_count
from protocol.codec import CodecLimits, run_message_bytes
from protocol.driver import LearnerServer
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
from protocol.receiver import LearnerProtocol
from protocol.trajectory import Trajectory
from protocol.weights import NamedBuffer
from protocol.zmq_transport import CurveServerKeys, ZmqServerChannel, exposure_warning

STATE_FORMAT = 1
PROBE_RECORD = -1
"""The record id a probe's batch gets instead of a journal record: it is never stored nor trained."""


class IntakeClosed(Exception):
    """The intake was closed while a training batch was being waited for."""


class IntakeStarved(RuntimeError):
    """The buffer is full and still holds fewer groups than a training batch needs."""


def build_server(
    config: Config,
    *,
    persist: Callable[[BatchReceived], Any] | None = None,
    publish_initial: bool = True,
    run_dir: Path | None = None,
    on_refused: Callable[[str, str, str], None] | None = None,
) -> tuple[LearnerServer, ZmqServerChannel]:
    """The protocol server of the run config, bound. ``publish_initial`` serves the model directory's
    weights as version 0 to rollout servers that ask. ``run_dir`` holds the token of token auth
    (default: the config's); ``on_refused(address, code, reason)`` hears of every peer refused at the
    handshake (``transport.auth``)."""
    t = config.transport
    _, tok = wire_identities(config.actor_rollout_ref.model.path)
    # Ids the policy can emit: its embedding rows, which often exceed the tokenizer's ids (Qwen2.5:
    # 151936 rows, 151665 tokens); a sampled padding id is still a valid action with a logprob.
    vocab = max(tok.vocab_size, embedding_rows(config.actor_rollout_ref.model.path))
    # Lengths the run can produce (the rollout server's own budgets, rollout_service/server.py):
    # prompt + response within the context, the response within the episode's budget. The prompt
    # has no tighter bound of its own: a rendered prompt (or a StateLM segment's) may exceed
    # data.max_prompt_length as long as it fits the context.
    rollout = config.actor_rollout_ref.rollout
    # Filled in from data.* when the config is loaded (common.config.root): never None here.
    assert rollout.prompt_length is not None and rollout.response_length is not None
    limits = CodecLimits(
        max_message_bytes=t.max_message_bytes,
        max_trajectories_per_batch=t.max_trajectories_per_batch,
        max_tokens_per_trajectory=t.max_tokens_per_trajectory,
        vocab_size=vocab,
        max_model_len=rollout.max_model_len or rollout.prompt_length + rollout.response_length,
        max_response_tokens=rollout.response_length,
    )
    # The message bound of the run, not only the configured ceiling: announced in WELCOME, and no
    # frame above it is ever buffered (libzmq's MAXMSGSIZE, SPEC §13).
    limits = dataclasses.replace(limits, max_message_bytes=run_message_bytes(limits))
    proto = LearnerProtocol(
        tokenizer=tok,
        host=host_key(),
        capacity=config.learner.buffer_batches,
        max_credits_per_peer=t.initial_credits,
        limits=limits,
        heartbeat_interval_s=t.heartbeat_interval_s,
        heartbeat_timeout_s=t.heartbeat_timeout_s,
    )
    curve, mode = None, auth_mode(config)
    if mode == "curve":
        # Both are required with curve on when the config is loaded (common.config.root).
        assert t.curve.secret_key_file is not None and t.curve.allowed_keys_dir is not None
        curve = CurveServerKeys(Path(t.curve.secret_key_file), Path(t.curve.allowed_keys_dir))
    # Peers are authenticated in ZeroMQ's handshake: one that fails it never has a message
    # buffered, which no per-message budget can promise (libzmq delivers a message whole).
    token = learner_token(config, run_dir)
    address = config.learner.bind_address
    if (
        warning := exposure_warning(address, curve=curve is not None, token=bool(token))
    ) is not None:
        get_logger("learner.intake").warning(
            warning,
            address=address,
            auth=mode,
            fix="transport.auth: auto (a token, or CURVE with transport.curve); across hosts "
            "transport.curve",
        )
    channel = ZmqServerChannel(
        address,
        curve=curve,
        token=token,
        on_refused=on_refused,
        max_message_bytes=limits.max_message_bytes,
        budget=proto.message_budget,
    )
    server = LearnerServer(proto, channel, persist=persist)
    if publish_initial:
        from common.safetensors_buffers import load_dir

        server.publish_weights(
            0, load_dir(config.actor_rollout_ref.model.path), chunk_bytes=t.weight_chunk_bytes
        )
    return server, channel


@dataclass
class TakenBatch:
    """Groups for one training step: ``trajectories`` holds each group's trajectories contiguously,
    in the order of ``group_uids``."""

    trajectories: list[Trajectory]
    group_uids: list[str]
    group_sizes: list[int]
    staleness: list[int]  # per group: policy version - the oldest version of its trained tokens
    dropped_stale: int  # groups dropped as stale since the previous batch was taken
    wait_s: float
    keys: list[GroupKey] = field(default_factory=list, repr=False)  # for mark_trained
    sources: list[str] = field(default_factory=list)  # per group: its data source
    mix_shortfall: int = 0  # mixed runs: places of the configured mix not filled by their source
    mix: dict[str, int] = field(default_factory=dict)  # mixed runs: groups per source configured


class Intake:
    """The intake of one learner process. ``state``: an earlier intake's ``state_dict`` to resume
    from (a checkpoint's); ``journal_dir``: where accepted batches are stored (default
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
    ) -> None:
        self.config, self.run_dir = config, Path(run_dir)
        self.timeline = timeline if timeline is not None else TimelineWriter.off()
        self._log = get_logger("learner.intake")
        # One window per (peer, code): a flood of bad frames costs a few lines and a summary.
        self._peer_log = PeerErrorLog(self._log.warning, what="invalid messages")
        self._peer_errors = PeerErrorLog(self._log.warning, what="errors reported by peers")
        # Peers refused at the handshake (transport.auth), per address: a wrong-token client
        # reconnecting every 100 ms costs a few lines a minute.
        self._refusals = PeerErrorLog(self._log.warning, what="connections refused")
        self._journal = Journal(journal_dir or Path(run_dir) / "intake-journal")
        if fresh and state is None and len(self._journal):
            self._log.info(
                "fresh run: deleting the intake journal",
                records=len(self._journal),
                directory=str(self._journal.directory),
            )
            self._journal.clear()
        try:
            self._server, self._channel = build_server(
                config,
                persist=self._persist,
                publish_initial=False,
                run_dir=self.run_dir,
                on_refused=self._refused,
            )
        except BaseException:
            self._journal.close()
            raise
        self.address: str = self._channel.address
        self.token: str | None = self._channel.token  # what clients present (transport.auth)
        self._proto = self._server.proto
        self._buffer = GroupBuffer()
        self._position = 0  # highest journal record id whose groups reached the buffer
        self._counts = dict.fromkeys(
            (
                "batches",
                "trajectories",
                "tokens",
                "violations",
                "refused_connections",
                "persisted_bytes",
                "persist_failures",
                "replayed_records",
                "replayed_groups",
                "probe_batches",
            ),
            0,
        )
        self._peer_versions: dict[str, int] = {}
        self._published_at: dict[int, float] = {}  # version -> when publishing began (monotonic)
        self._applied: dict[
            int, dict[str, float]
        ] = {}  # version -> weights/* metrics once all applied
        self._apply_times: dict[int, list[float]] = {}  # version -> each server's apply_time_s
        self._arrived: anyio.Event | None = None
        self._joined: anyio.Event | None = None  # set when a rollout server joins
        self._rounds: dict[str, ValidationRound] = {}  # validation requests being waited for
        self._rule: tuple[int, int] | None = (
            None  # (policy version, max staleness) of the last request
        )
        self._dropped_reported = 0
        self._admission: Admission | None = None
        self._mix: dict[str, float] | None = None  # data source -> ratio (configure_mix)
        self._mix_wait_s = 0.0
        self._unknown_sources: set[str] = set()  # sources seen that the mix does not name (warned)
        self._remaining = 0  # groups the run can still train (admission grants no more)
        self._tokens = {
            "generated": 0,
            "dropped": 0,
        }  # sampled response tokens received / dropped as stale
        self._waste_reported = (0, 0)  # (generated, wasted) at the last waste_metrics call
        self._closed = self._started = False
        self._born = time.monotonic()
        try:
            self._restore(state)
        except BaseException:
            self._channel.close()
            self._journal.close()
            raise

    # -- trainer API -----------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve rollout servers until ``close`` (BYE sent to each) or cancellation. Reports the
        bound address through ``task_status``."""
        if self._started:
            raise RuntimeError("Intake.run() runs once")
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
                    buffered_groups=len(self._buffer),
                )
                task_status.started(self.address)
                tg.start_soon(self._flush_peer_logs)
                async for ev in self._server.events:
                    self._handle(ev)
                tg.cancel_scope.cancel()  # the server has stopped (its events ended): stop the flusher
        finally:
            for log in (self._peer_log, self._peer_errors, self._refusals):
                log.flush(time.monotonic(), all_windows=True)
            self._closed = True
            self._wake()
            self._end_validations()
            with anyio.CancelScope(shield=True):
                await self._channel.aclose()
            self._journal.close()
            summary = self.summary()
            self._log.info("intake stopped", **summary)
            with contextlib.suppress(OSError):  # a report: never worth failing the shutdown for
                (self.run_dir / "intake_stats.json").write_text(
                    json.dumps(summary, indent=2) + "\n"
                )

    def configure_admission(
        self, batch_groups: int, max_staleness: int, remaining_groups: int
    ) -> None:
        """Grant rollout servers that offer admission the groups a run of ``remaining_groups`` more
        groups, ``batch_groups`` per step, needs at ``max_staleness`` (``learner.admission``).
        Call before ``run``."""
        self._admission = Admission(batch_groups, max_staleness)
        self._remaining = remaining_groups
        self._proto.admission = True
        # Room for every admitted group (one batch each at worst) and the credits promised, so a
        # group the learner waits for can always be delivered.
        self._proto.capacity = max(self._proto.capacity, 2 * self._admission.window)
        self._log.info(
            "admission",
            window=self._admission.window,
            groups_per_step=batch_groups,
            max_staleness=max_staleness,
            groups_left=remaining_groups,
        )

    def configure_mix(self, ratios: Mapping[str, float], wait_s: float) -> None:
        """Take every batch in the mix of ``ratios`` (data source -> ratio, ``data.datasets``),
        waiting at most ``wait_s`` for a missing source (the module docstring has the rule). With
        admission (configured first), grants then go to servers in whole batches (``chunk``)."""
        if not ratios or min(ratios.values()) <= 0 or wait_s < 0:
            raise ValueError(f"a mix needs ratios above 0 and wait_s >= 0 (got {ratios}, {wait_s})")
        self._mix, self._mix_wait_s = dict(ratios), wait_s
        if self._admission is not None:  # grants in whole schedule batches (learner.admission)
            self._admission.chunk = self._admission.batch_groups
        self._log.info("mixed batches", ratios=self._mix, mix_wait_s=wait_s)

    async def next_batch(
        self, n_groups: int, policy_version: int, max_staleness: int
    ) -> TakenBatch:
        """Wait until ``n_groups`` fresh groups are buffered and take them, earliest deadline first.
        Groups staler than ``max_staleness`` are dropped whenever they are seen. With admission, also
        wait for every group still generating that this step must train (it is too stale after).
        With a mix (``configure_mix``), take each source's count, waiting a bounded time for it."""
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1 (got {n_groups})")
        t0 = time.monotonic()
        quotas = self._quotas(n_groups)
        ready_since: float | None = None  # when the step could have been taken without the mix
        mixed: list[Group] | None = None
        while True:
            self._rule = (
                policy_version,
                max_staleness,
            )  # also applied to arrivals until the next call
            self._drop_stale(policy_version, max_staleness)
            wait_for: float | None = None  # until something arrives
            if len(self._buffer) >= n_groups and self._can_take(
                n_groups, policy_version, max_staleness
            ):
                if quotas is None:
                    break
                now = time.monotonic()
                ready_since = now if ready_since is None else ready_since
                fill = now - ready_since >= self._mix_wait_s or not self._more_can_arrive()
                mixed = self._mixed_pick(quotas, policy_version, max_staleness, fill=fill)
                if mixed is not None:
                    break
                wait_for = ready_since + self._mix_wait_s - now
            if self._closed:
                raise IntakeClosed("the intake was closed")
            self._check_starved(n_groups)
            self._arrived = self._arrived or anyio.Event()
            with anyio.move_on_after(wait_for):
                await self._arrived.wait()
        if mixed is None:
            out = self._buffer.take(n_groups, policy_version, max_staleness)
            self._free(out.done_records)  # (nothing is stale here: dropped just above)
            groups = out.groups
        else:
            groups = self._buffer.take_these(mixed)
        dropped, self._dropped_reported = (
            self._buffer.dropped_stale - self._dropped_reported,
            self._buffer.dropped_stale,
        )
        return TakenBatch(
            trajectories=[t for g in groups for t in g.trajectories],
            group_uids=[g.uid for g in groups],
            group_sizes=[len(g.trajectories) for g in groups],
            staleness=[g.staleness(policy_version) for g in groups],
            dropped_stale=dropped,
            wait_s=time.monotonic() - t0,
            keys=[g.key for g in groups],
            sources=[g.source for g in groups],
            mix_shortfall=mix_shortfall(groups, quotas) if quotas is not None else 0,
            mix=dict(quotas or {}),
        )

    def _quotas(self, n_groups: int) -> dict[str, int] | None:
        """Groups per source in a mixed step of ``n_groups`` (None: no mix)."""
        if self._mix is None:
            return None
        counts = batch_counts(list(self._mix.values()), n_groups)
        return dict(zip(self._mix, counts, strict=True))

    def _mixed_pick(
        self, quotas: dict[str, int], policy_version: int, max_staleness: int, *, fill: bool
    ) -> list[Group] | None:
        """``mixed_pick`` of the buffer: what it leaves behind must not be due now (it would be
        dropped after this step) and, with admission, must still be trainable in time."""

        def fits(left: list[Group]) -> bool:
            deadlines = [
                g.oldest_version + max_staleness for g in left if g.oldest_version is not None
            ]
            if any(d <= policy_version for d in deadlines):
                return False
            return self._admission is None or self._admission.can_take(deadlines, policy_version)

        queued = self._buffer.by_deadline()
        unknown = {g.source for g in queued} - set(quotas) - self._unknown_sources
        if unknown:
            self._unknown_sources |= unknown
            self._log.warning(
                "groups of a data source the mix does not name: they only fill places of others",
                sources=sorted(unknown),
                mix=sorted(quotas),
            )
        return mixed_pick(queued, quotas, fill=fill, fits=fits)

    def _more_can_arrive(self) -> bool:
        """Whether waiting can bring more groups: not when the buffer holds all the room there is,
        nor, with admission, when nothing is generating and every server takes grants."""
        buf, proto = self._buffer, self._proto
        if buf.records >= proto.capacity and proto.buffered == buf.records:
            return False
        if self._admission is not None and not self._admission.generating:
            return not set(proto.ready_peers()) <= set(proto.admission_peers())
        return True

    def mark_trained(self, taken: TakenBatch) -> None:
        """``taken`` was trained on: batches whose groups are now all trained free their room, and
        (with admission) as many new groups are granted, on the newest published weights."""
        self._free(self._buffer.finish(taken.keys))
        self._remaining = max(0, self._remaining - len(taken.keys))
        self._admit()

    def waste_metrics(self) -> dict[str, float]:
        """``rollout/waste_frac``: the share of sampled response tokens generated so far that were
        never trained and never will be (dropped as stale here, or dropped by a rollout server and
        reported in its heartbeats); ``rollout/waste_frac_step`` the same since the last call."""
        dropped_there = self._proto.dropped_tokens
        generated = self._tokens["generated"] + dropped_there
        wasted = self._tokens["dropped"] + dropped_there
        g0, w0 = self._waste_reported
        self._waste_reported = (generated, wasted)
        return {
            "rollout/waste_frac": wasted / generated if generated else 0.0,
            "rollout/waste_frac_step": (wasted - w0) / (generated - g0) if generated > g0 else 0.0,
            "rollout/generated_tokens": float(generated),
            "rollout/wasted_tokens": float(wasted),
        }

    async def validate(
        self,
        policy_version: int,
        *,
        timeout_s: float,
        request_id: str | None = None,
        shard_wait_s: float = 0.0,
    ) -> ValidationRound:
        """Ask every connected rollout server that offers validation to validate ``policy_version``
        (or newer) and wait until each answered or left, at most ``timeout_s`` in all. With no rollout
        server connected at all (before the first step), first wait within the same budget for one to
        join; servers that do not offer validation (protocol 1.0) are not asked. Servers that join
        while the round is open are asked too, and when the answers leave shards of the validation
        set uncovered, the round waits up to ``shard_wait_s`` more (within ``timeout_s``) for their
        servers to join and answer (learner.validation). The round is returned with whatever
        arrived; answers after it returned are ignored."""
        deadline = time.monotonic() + timeout_s
        rnd = ValidationRound(
            request_id or f"v{policy_version}-{uuid.uuid4().hex[:8]}", policy_version
        )
        with anyio.move_on_after(timeout_s):
            while not self._proto.ready_peers() and not self._closed:
                self._joined = self._joined or anyio.Event()
                await self._joined.wait()
        left = deadline - time.monotonic()
        if left > 0 and not self._closed:
            self._rounds[rnd.request_id] = rnd
            rnd.started = (
                time.monotonic()
            )  # the duration is the run's, not the wait for a server to join
            rnd.deadline = deadline
            try:
                rnd.asked = self._server.request_validation(
                    rnd.request_id, policy_version, timeout_s=left
                )
                self._log.info(
                    "validation requested",
                    request=rnd.request_id,
                    policy_version=policy_version,
                    servers=rnd.asked,
                    timeout_s=round(left, 1),
                )
                with anyio.move_on_after(left):
                    await rnd.wait()
                    if rnd.shards_missing and shard_wait_s > 0:
                        self._log.info(
                            "validation waits for the servers of uncovered shards",
                            request=rnd.request_id,
                            shards_missing=rnd.shards_missing,
                            wait_s=shard_wait_s,
                        )
                        with anyio.move_on_after(shard_wait_s):
                            await rnd.wait(covered=True)
            finally:
                del self._rounds[rnd.request_id]
        rnd.duration_s = time.monotonic() - rnd.started
        return rnd

    def publish_weights(
        self,
        version: int,
        tensors: list[NamedBuffer],
        *,
        file: str = "",
        started: float | None = None,
    ) -> bool:
        """Send policy ``version`` to every rollout server (and to joiners that ask). The buffers must
        stay unchanged until the next publish. With ``file`` (a safetensors file holding exactly
        ``tensors``), servers on this machine load that file instead of receiving chunks.
        ``started``: when gathering the weights began (``time.monotonic``), for ``weights/applied_s``.

        Returns whether chunks were cut from the version this one replaces: ZeroMQ may then still be
        sending slices of its buffers (read just before the publish, with no await in between, so no
        later planning is missed; `learner.publisher` retires such a slot file)."""
        replaced_chunked = self._proto.chunks_planned
        self._published_at[version] = time.monotonic() if started is None else started
        self._server.publish_weights(
            version, tensors, chunk_bytes=self.config.transport.weight_chunk_bytes, file=file
        )
        self.timeline.instant(
            Track.WEIGHTS, PUBLISH_EVENT, version=version, via="file" if file else "chunks"
        )
        if self._rule is not None:
            self._rule = (max(version, self._rule[0]), self._rule[1])
        return replaced_chunked

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

    def weight_update_metrics(self) -> dict[str, float]:
        """``weights/*`` of the newest version every server applied since the last call ({} if none):
        ``applied_s`` from the start of the publish until the last server generates with it,
        ``apply_s`` the slowest server's own load time."""
        if not self._applied:
            return {}
        newest = self._applied[max(self._applied)]
        self._applied.clear()
        return newest

    def file_peers_oldest_version(self) -> int | None:
        """The lowest version applied by a connected rollout server that loads weights files (None:
        no such server): slot files of older versions will not be read again."""
        return self._proto.file_peers_oldest_version()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume without losing or re-training accepted data (plain
        msgpack/JSON types). Take it after ``mark_trained`` of the checkpointed step."""
        return {
            "format": STATE_FORMAT,
            "protocol": self._proto.export_state(),
            "pending": [[rid, uid] for rid, uid in self._buffer.pending_keys()],
            "position": self._position,
        }

    def checkpoint_saved(self, state: dict[str, Any]) -> None:
        """``state`` (from ``state_dict``) is now the oldest one a restart may resume from: delete the
        journal records it does not need."""
        needed = [int(rid) for rid, _ in state["pending"]] + [int(state["position"]) + 1]
        removed = self._journal.truncate_before(min(needed))
        if removed:
            self._log.debug(
                "journal compacted", records_removed=removed, records_left=len(self._journal)
            )

    def close(self) -> None:
        """Say BYE to every rollout server and stop; ``run`` returns once that is sent. Waiting
        ``next_batch`` calls raise ``IntakeClosed``."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        self._wake()
        self._end_validations()
        if not self._started:  # run() will never clean up: do it now
            self._channel.close()
            self._journal.close()

    @property
    def stats(self) -> dict[str, int | float]:
        p = self._proto.stats
        return {
            "peers": len(self._proto.ready_peers()),
            **self._counts,
            **{
                f"violations_{code.lower()}": n for code, n in sorted(self._peer_log.counts.items())
            },
            "violations_log_suppressed": self._peer_log.suppressed_total,
            "duplicate_batches": p["duplicate_batches"],
            "duplicate_trajectories": p["duplicate_trajectories"],
            "dropped_stale_groups": self._buffer.dropped_stale,
            "buffered_groups": len(self._buffer),
            "in_flight_groups": self._buffer.in_flight,
            "buffered_batches": self._proto.buffered,
            "journal_records": len(self._journal),
        }

    def summary(self) -> dict[str, int | float]:
        """``stats`` plus rates since the intake was made (the periodic log line)."""
        s = self.stats
        dt = max(time.monotonic() - self._born, 1e-9)
        return {
            **s,
            "traj_per_s": round(s["trajectories"] / dt, 1),
            "tokens_per_s": round(s["tokens"] / dt),
        }

    def timeline_levels(self) -> dict[str, float]:
        """The values the learner's timeline samples (``common.timeline.LEARNER_COUNTERS``): groups
        waiting in the buffer, groups granted and still generating (-1: no admission), and the
        trajectories received so far."""
        return {
            "buffered_groups": len(self._buffer),
            "generating_groups": self._admission.generating if self._admission is not None else -1,
            "received_trajectories": self._counts["trajectories"],
        }

    @property
    def peer_versions(self) -> dict[str, int]:
        """Policy version each connected rollout server generates with: its last WEIGHTS_APPLIED(ok),
        else the version its HELLO named (servers that asked for the current weights are absent
        until they applied them)."""
        return dict(self._peer_versions)

    @property
    def policy_version(self) -> int:
        """The latest version published (or restored from the state)."""
        return self._proto.policy_version

    # -- internals -------------------------------------------------------------------------------
    def _persist(self, ev: BatchReceived) -> tuple[int, int]:
        """The driver's persist hook (a worker thread): (record id, bytes) once the batch is durable.
        A probe's batch (the conformance suite's) is never journaled: it must not be trained."""
        if ev.probe:
            return PROBE_RECORD, 0
        return self._journal.append(ev.peer_id, ev.epoch, ev.seq, ev.trajectories)

    def _restore(self, state: dict[str, Any] | None) -> None:
        journal = self._journal
        pending: dict[int, set[str]] = {}
        position = 0
        if state is not None:
            if state.get("format") != STATE_FORMAT:
                raise ValueError(
                    f"intake state of format {state.get('format')!r}, expected {STATE_FORMAT}"
                )
            self._proto.restore_state(state["protocol"])
            position = int(state["position"])
            for rid, uid in state["pending"]:
                pending.setdefault(int(rid), set()).add(uid)
            journal.advance_to(
                position + 1
            )  # records appended from now on are replayed after a crash
        wanted: dict[int, set[str] | None] = {
            **pending
        }  # record id -> group uids to replay (None: all)
        wanted.update((rid, None) for rid in journal.record_ids if rid > position)
        missing = sorted(rid for rid in wanted if rid not in journal)
        if missing:
            raise ValueError(
                f"the intake journal {journal.directory} lacks {len(missing)} records the checkpoint needs "
                f"(ids {missing[:5]}...): it belongs to another run, or it was compacted for a later "
                "checkpoint than the one resumed. Resume from the latest checkpoint, or start a fresh run."
            )
        for rec in journal.records(wanted):
            n = len(self._buffer.add(rec.record_id, rec.trajectories, only=wanted[rec.record_id]))
            self._proto.replay_batch(rec.peer_id, rec.epoch, rec.seq, rec.trajectories.ids)
            if not n:
                self._proto.batch_consumed()
            self._counts["replayed_records"] += 1
            self._counts["replayed_groups"] += n
        self._position = max([position, *wanted])
        if wanted:
            self._log.info(
                "replayed the intake journal",
                records=len(wanted),
                groups=len(self._buffer),
                position=position,
                from_state=state is not None,
            )

    def _handle(self, ev: Event) -> None:
        match ev:
            case BatchReceived() if ev.probe:
                # Acknowledged like any batch (the wire behaviour under test), then let go: probing a
                # live learner must not change what it trains.
                self._counts["probe_batches"] += 1
                self._free([PROBE_RECORD])
            case BatchReceived():
                rid, nbytes = ev.persisted
                c = self._counts
                c["batches"] += 1
                c["trajectories"] += len(ev.trajectories)
                c["tokens"] += token_count(ev.trajectories)
                c["persisted_bytes"] += nbytes
                groups = self._buffer.add(rid, ev.trajectories)
                if not groups:
                    self._free([rid])
                self._received(ev.peer_id, groups)
                self._position = max(self._position, rid)
                if self._rule is not None:
                    self._drop_stale(*self._rule)
                self._wake()
            case BatchRefused():
                self._counts["persist_failures"] += 1
                self._log.error(
                    "could not store a batch; its rollout server will resend it",
                    peer=ev.peer_id,
                    seq=ev.seq,
                    error=ev.reason,
                )
            case PeerJoined():
                if self._joined is not None:
                    self._joined.set()
                    self._joined = None
                self._ask_joiner_to_validate()
                if ev.hello.policy_version >= 0:
                    self._peer_versions[ev.peer_id] = ev.hello.policy_version
                else:
                    self._peer_versions.pop(ev.peer_id, None)
                self._log.info(
                    "rollout server joined",
                    peer=ev.peer_id,
                    epoch=ev.hello.epoch,
                    policy_version=ev.hello.policy_version,
                )
                if self._admission is not None:
                    if ev.peer_id in self._proto.admission_peers():
                        self._admission.joined(
                            ev.peer_id, ev.hello.slots
                        )  # a new session: earlier grants are void
                    else:
                        self._admission.left(ev.peer_id)
                    self._admit()
            case PeerClosed() | PeerTimedOut():
                self._peer_versions.pop(ev.peer_id, None)
                self._log.info("rollout server left", peer=ev.peer_id, why=type(ev).__name__)
                if self._admission is not None and self._admission.left(ev.peer_id):
                    self._admit()  # its grants go to the servers still here
                    self._wake()  # nothing to wait for from it any more
            case PeerWeightsApplied():
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
            case ValidationReceived():
                r = ev.result
                if (rnd := self._rounds.get(r.request_id)) is not None:
                    rnd.answered(ev.peer_id, r)
                self._log.info(
                    "validation result",
                    peer=ev.peer_id,
                    request=r.request_id,
                    ok=r.ok,
                    episodes=r.count,
                    policy_version=r.policy_version,
                    error=r.error or None,
                    late=rnd is None,
                )
            case ValidationAbandoned():
                if (rnd := self._rounds.get(ev.request_id)) is not None:
                    rnd.left(ev.peer_id, ev.reason)
                    self._log.warning(
                        "a rollout server left before its validation result",
                        peer=ev.peer_id,
                        request=ev.request_id,
                        why=ev.reason,
                    )
            case ProtocolViolation():
                self._counts["violations"] += 1
                self._peer_log.log(
                    ev.peer_id,
                    ev.error.code.name,
                    time.monotonic(),
                    "invalid message",
                    error=ev.error.message[:300],
                    field=ev.error.field,
                )
            case PeerError():
                self._peer_errors.log(
                    ev.peer_id,
                    str(ev.error.code),
                    time.monotonic(),
                    "peer reported an error",
                    error=ev.error.message[:300],
                )

    def _refused(self, address: str, code: str, reason: str) -> None:
        """A peer failed ZeroMQ's handshake (wrong or missing token or key): nothing of it was
        buffered. Counted, and logged per address through the limiter."""
        self._counts["refused_connections"] += 1
        self._refusals.log(
            address or "(unknown)",
            code,
            time.monotonic(),
            "connection refused at the handshake",
            reason=reason[:100],
            auth=auth_mode(self.config),
        )

    async def _flush_peer_logs(self, every_s: float = 10.0) -> None:
        """Summaries of suppressed peer errors come out within ``every_s`` of their window's end."""
        while True:
            await anyio.sleep(every_s)
            for log in (self._peer_log, self._peer_errors, self._refusals):
                log.flush(time.monotonic())

    def peer_error_metrics(self) -> dict[str, float]:
        """``intake/violations/<CODE>``: invalid messages refused so far, per error code (every one,
        logged or not); ``intake/violations_log_suppressed``: those not logged in full."""
        out = {
            f"intake/violations/{code}": float(n)
            for code, n in sorted(self._peer_log.counts.items())
        }
        out["intake/violations"] = float(self._counts["violations"])
        out["intake/violations_log_suppressed"] = float(self._peer_log.suppressed_total)
        out["intake/refused_connections"] = float(self._counts["refused_connections"])
        return out

    def _drop_stale(self, policy_version: int, max_staleness: int) -> None:
        out = self._buffer.drop_stale(policy_version, max_staleness)
        if out.dropped:
            self._tokens["dropped"] += sum(g.sampled_tokens for g in out.dropped)
            self._log.debug(
                "stale groups dropped",
                groups=len(out.dropped),
                policy_version=policy_version,
                max_staleness=max_staleness,
            )
            self._admit()
        self._free(out.done_records)

    def _can_take(self, n_groups: int, policy_version: int, max_staleness: int) -> bool:
        """With admission: the groups left after taking ``n_groups`` now (earliest deadline first),
        those still generating included, can all be trained in time. Nothing generating: yes (a
        wait could not help)."""
        if self._admission is None:
            return True
        left = [
            g.oldest_version + max_staleness
            for g in self._buffer.by_deadline()[n_groups:]
            if g.oldest_version is not None
        ]
        return self._admission.can_take(left, policy_version)

    def _received(self, peer_id: str, groups: list[Group]) -> None:
        self._tokens["generated"] += sum(g.sampled_tokens for g in groups)
        if self._admission is not None:
            for g in groups:
                self._admission.received(peer_id, g.oldest_version)
            self._admit()  # the server has slots free again

    def _admit(self) -> None:
        """Grant what the admission window has room for, on the newest published version."""
        if self._admission is None or self._closed:
            return
        held = len(self._buffer) + self._buffer.in_flight
        for peer, n in self._admission.grants(
            held=held, remaining=self._remaining, min_version=self._proto.policy_version
        ):
            self._server.admit(peer, n, self._proto.policy_version)
            self.timeline.instant(
                Track.ADMISSION,
                GRANT_EVENT,
                server=peer,
                groups=n,
                min_version=self._proto.policy_version,
            )
            self._log.debug(
                "groups admitted", peer=peer, groups=n, min_version=self._proto.policy_version
            )

    def _free(self, records: list[int]) -> None:
        if records:
            self._server.batch_consumed(len(records))

    def _wake(self) -> None:
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    def _ask_joiner_to_validate(self) -> None:
        """A server joined: every open validation round asks it too (request_validation asks only
        peers not yet asked for that request)."""
        now = time.monotonic()
        for rnd in self._rounds.values():
            if rnd.deadline > now:
                asked = self._server.request_validation(
                    rnd.request_id, rnd.policy_version, timeout_s=rnd.deadline - now
                )
                if asked:
                    rnd.ask_more(asked)
                    self._log.info(
                        "validation requested", request=rnd.request_id, servers=asked, joined=True
                    )

    def _end_validations(self) -> None:
        """The intake is closing: nobody will join or answer any more."""
        for rnd in self._rounds.values():
            for peer in rnd.outstanding:
                rnd.left(peer, "the intake closed")
        if self._joined is not None:
            self._joined.set()
            self._joined = None

    def _check_starved(self, n_groups: int) -> None:
        """Nothing can arrive (all room holds buffered batches) and nothing in flight will free any."""
        buf, proto = self._buffer, self._proto
        if not buf.in_flight and buf.records >= proto.capacity and proto.buffered == buf.records:
            raise IntakeStarved(
                f"the intake buffer is full ({buf.records} batches, learner.buffer_batches={proto.capacity}) "
                f"but holds only {len(buf)} fresh groups and a training batch needs {n_groups}: raise "
                "learner.buffer_batches (or ship more groups per batch)"
            )


async def serve(
    config: Config,
    run_dir: Path,
    *,
    stats_interval_s: float = 10.0,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> int:
    """The intake alone (no trainer): batches count as trained as soon as they arrive. Stops on
    SIGINT/SIGTERM; a stats line is logged every ``stats_interval_s`` and written to
    ``RUN_DIR/intake_stats.json`` on exit."""
    from common.safetensors_buffers import load_dir

    log = get_logger("learner.intake")
    intake = Intake(config, run_dir, fresh=True)
    # Version 0 is the checkpoint the run starts from: served to rollout servers that ask for it.
    intake.publish_weights(0, load_dir(config.actor_rollout_ref.model.path))
    keys = (
        "peers",
        "batches",
        "trajectories",
        "traj_per_s",
        "tokens_per_s",
        "violations",
        "refused_connections",
        "duplicate_batches",
        "duplicate_trajectories",
    )
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(
                intake.run
            )  # the group then waits for it to return (BYE sent to every peer)
            task_status.started(intake.address)

            async def on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for sig in signals:
                        log.info("stopping", signal=signal.Signals(sig).name)
                        intake.close()

            async def report() -> None:
                while True:
                    await anyio.sleep(stats_interval_s)
                    log.info("intake", **{k: v for k, v in intake.summary().items() if k in keys})
                    intake.checkpoint_saved(intake.state_dict())  # nothing is kept: compact

            async with anyio.create_task_group() as helpers:
                helpers.start_soon(on_signal)
                helpers.start_soon(report)
                try:
                    while True:
                        taken = await intake.next_batch(
                            max(1, int(intake.stats["buffered_groups"])), 0, sys.maxsize
                        )
                        intake.mark_trained(taken)
                except IntakeClosed:
                    pass
                helpers.cancel_scope.cancel()
    finally:
        intake.close()
    return 0
