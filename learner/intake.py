"""The learner's intake service: accepts rollout servers and takes their trajectory streams.

It is the learner-side endpoint of protocol/ configured from the run config: it binds
``learner.bind_address``, checks that peers use the same tokenizer as ``actor_rollout_ref.model.path``,
validates token ids against that vocabulary, grants credits from a buffer of ``learner.buffer_batches``
and deduplicates. ``bin/learner`` runs it on its own until the trainer is built on top of it; a stats
line is logged every ``stats_interval_s`` and written to ``RUN_DIR/intake_stats.json`` on exit.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from common.identity import wire_identities
from common.logging import get_logger
from common.safetensors_buffers import load_dir
from protocol.batch import token_count
from protocol.codec import CodecLimits
from protocol.driver import LearnerServer
from protocol.events import (
    BatchReceived,
    Event,
    PeerClosed,
    PeerError,
    PeerJoined,
    PeerTimedOut,
    ProtocolViolation,
)
from protocol.receiver import LearnerProtocol
from protocol.zmq_transport import CurveServerKeys, ZmqServerChannel


def build_server(config: Any) -> tuple[LearnerServer, ZmqServerChannel]:
    t = config.transport
    _, tok = wire_identities(config.actor_rollout_ref.model.path)
    limits = CodecLimits(
        max_message_bytes=t.max_message_bytes, max_trajectories_per_batch=t.max_trajectories_per_batch,
        max_tokens_per_trajectory=t.max_tokens_per_trajectory, vocab_size=tok.vocab_size,
    )
    curve = None
    if t.curve.enabled:
        curve = CurveServerKeys(Path(t.curve.secret_key_file), Path(t.curve.allowed_keys_dir))
    channel = ZmqServerChannel(config.learner.bind_address, curve=curve, max_message_bytes=t.max_message_bytes)
    proto = LearnerProtocol(
        tokenizer=tok,
        capacity=config.learner.buffer_batches, max_credits_per_peer=t.initial_credits, limits=limits,
        heartbeat_interval_s=t.heartbeat_interval_s, heartbeat_timeout_s=t.heartbeat_timeout_s,
    )
    server = LearnerServer(proto, channel)
    # Version 0 is the checkpoint the run starts from: served to rollout servers that ask for it.
    server.publish_weights(0, load_dir(config.actor_rollout_ref.model.path),
                           chunk_bytes=t.weight_chunk_bytes)
    return server, channel


class IntakeStats:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.trajectories = self.tokens = self.batches = self.violations = 0
        self.peers: set[str] = set()

    def line(self) -> dict[str, Any]:
        dt = max(time.monotonic() - self.started, 1e-9)
        return {"peers": len(self.peers), "batches": self.batches, "trajectories": self.trajectories,
                "traj_per_s": round(self.trajectories / dt, 1), "tokens_per_s": round(self.tokens / dt),
                "violations": self.violations}


def handle(ev: Event, stats: IntakeStats, log: Any, consumed: Callable[[], None]) -> None:
    match ev:
        case BatchReceived():
            stats.batches += 1
            stats.trajectories += len(ev.trajectories)
            stats.tokens += token_count(ev.trajectories)
            consumed()  # no trainer yet: room is free again at once
        case PeerJoined():
            stats.peers.add(ev.peer_id)
            log.info("rollout server joined", peer=ev.peer_id, epoch=ev.hello.epoch,
                     policy_version=ev.hello.policy_version)
        case PeerClosed() | PeerTimedOut():
            stats.peers.discard(ev.peer_id)
            log.info("rollout server left", peer=ev.peer_id, why=type(ev).__name__)
        case ProtocolViolation():
            stats.violations += 1
            log.warning("invalid message", peer=ev.peer_id, code=ev.error.code.name, error=ev.error.message)
        case PeerError():
            log.warning("peer reported an error", peer=ev.peer_id, code=ev.error.code, error=ev.error.message)


async def serve(config: Any, run_dir: Path, *, stats_interval_s: float = 10.0,
                task_status: Any = anyio.TASK_STATUS_IGNORED) -> int:
    log = get_logger("learner.intake")
    server, channel = build_server(config)
    stats = IntakeStats()
    log.info("listening", address=channel.address, tokenizer=server.proto.tokenizer.name)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(server.run)
            task_status.started(channel.address)

            async def on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for sig in signals:
                        log.info("stopping", signal=signal.Signals(sig).name)
                        server.close()
                        tg.cancel_scope.cancel()

            async def report() -> None:
                while True:
                    await anyio.sleep(stats_interval_s)
                    log.info("intake", **stats.line())

            tg.start_soon(on_signal)
            tg.start_soon(report)
            async for ev in server.events:
                handle(ev, stats, log, server.batch_consumed)
    finally:
        await channel.aclose()
        (run_dir / "intake_stats.json").write_text(json.dumps(stats.line(), indent=2) + "\n")
        log.info("intake stopped", **stats.line())
    return 0
