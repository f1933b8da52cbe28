"""Building the rollout server's link to the learner: one ``Shipper`` around one connection.

Design: the rollout side has one connection to the learner, a ``RolloutConnection`` (sans-IO, the
protocol's rollout end) driven by a ``RolloutClient`` (ZeroMQ), and the ``Shipper`` owns that
client: it batches and spools trajectories, and hands every other event of the connection
(weights, grants, validation requests, the session's start and end) to the server, which owns
the link and dispatches them (``RolloutServer._events``). ``build_shipper`` only assembles it from
the config, so that the server's class keeps the running of the link and this module the choices
made once per process:

- the HELLO: this server's id, a fresh epoch per process (a restart is a new session), the wire
  identities of model and tokenizer, the capabilities this side offers (validation, weights by
  file, admission grants), the host key (weights by file only on one host) and the slots it asks
  grants for (``max_concurrent_episodes // n``);
- the weights' receiving side (``weights_applier.weight_assembler``: checked against the engine's
  model before anything is received), hence built after the engine is attached;
- authentication, both ways (CURVE: the learner proves its key before this side sends anything):
  a token read at every connection, waiting for the learner to write it (a server started first
  waits, one whose learner restarted follows the new token), whose derived keys pin the learner, or
  CurveZMQ certificate files, whose missing files fail as a ``StartupError`` naming the keys;
- the spool in the shard's state directory (a restarted server of the shard resends what its
  predecessor left, and announces those groups' acknowledgement through ``on_recovered_acked``)
  and, with ``rollout_server.record``, a recording per run for ``bin/replay``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from common.hostkey import host_key
from common.identity import wire_identities
from common.peer_auth import auth_mode, token_path, wait_for_token
from common.rundir import resolve_run_dir
from protocol.driver import RolloutClient
from protocol.messages import (
    ADMISSION_CAPABILITY,
    VALIDATION_CAPABILITY,
    WEIGHTS_FILE_CAPABILITY,
)
from protocol.sender import RolloutConnection
from protocol.zmq_auth import CurveClientKeys, require_curve
from protocol.zmq_transport import client_factory
from rollout_service.errors import StartupError
from rollout_service.metrics import RolloutStats
from rollout_service.recording import Recorder
from rollout_service.shipping import Shipper
from rollout_service.weights_applier import weight_assembler

if TYPE_CHECKING:
    from common.config import Config
    from rollout_service.engine.base import Engine


def build_shipper(
    config: Config,
    *,
    server_id: str,
    engine: Engine,
    state_dir: Path,
    stats: RolloutStats,
    log: structlog.stdlib.BoundLogger,
    on_recovered_acked: Callable[[list[str]], None],
) -> Shipper:
    """The shipper and its connection for the server ``server_id``, whose engine is ``engine``."""
    c, server = config, config.rollout_server
    model, tokenizer = wire_identities(c.actor_rollout_ref.model.path)
    conn = RolloutConnection(
        peer_id=server_id,
        epoch=uuid.uuid4().hex,
        model=model,
        tokenizer=tokenizer,
        capabilities=[VALIDATION_CAPABILITY, WEIGHTS_FILE_CAPABILITY, ADMISSION_CAPABILITY],
        host=host_key(),
        slots=max(1, server.max_concurrent_episodes // c.actor_rollout_ref.rollout.n),
        heartbeat_interval_s=c.transport.heartbeat_interval_s,
        heartbeat_timeout_s=c.transport.heartbeat_timeout_s,
        weights=weight_assembler(c, engine, log),
    )
    curve, keys = None, c.transport.curve
    token: Callable[[], Awaitable[str]] | None = None
    if auth_mode(c) == "none":
        log.warning(
            "transport.auth none: this server cannot tell the learner from a process posing "
            "as it at its address, and would apply that process's weights",
            fix="transport.auth: auto (the run's token, as CURVE)",
        )
    else:
        require_curve()  # at start, not at the first connection
    if auth_mode(c) == "token":
        # Read at every connection, waiting for the learner to create it: a server started
        # first just waits, and one whose learner restarted with a new token follows it.
        path = token_path(c)

        async def read_token() -> str:
            return await wait_for_token(path, warn=log.warning)

        token = read_token

    if keys.enabled:
        if keys.secret_key_file is None or keys.server_public_key_file is None:
            raise StartupError(
                "transport.curve.enabled needs secret_key_file and server_public_key_file"
            )
        curve = CurveClientKeys(Path(keys.secret_key_file), Path(keys.server_public_key_file))
    client = RolloutClient(
        conn,
        client_factory(
            server.learner_address,
            curve=curve,
            token=token,
            max_message_bytes=c.transport.max_message_bytes,
        ),
    )
    # One place per run, for bin/replay.
    recordings = resolve_run_dir(c) / "recordings" / server_id
    recorder = (
        Recorder(
            recordings,
            server_id=server_id,
            max_bytes=None if server.record_max_mb is None else int(server.record_max_mb * 2**20),
        )
        if server.record
        else None
    )
    # A group found in the spool at start is resent, not rerun; its prompt is committed once
    # the learner acknowledges the resent batch.
    return Shipper(
        client,
        spool_dir=state_dir / "spool",
        server_id=server_id,
        groups_per_batch=server.groups_per_batch,
        max_unacked_batches=server.max_unacked_batches,
        recorder=recorder,
        stats=stats,
        on_recovered_acked=on_recovered_acked,
    )
