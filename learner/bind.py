"""The learner's protocol server of the run config, bound: what ``learner.link`` serves.

Design: everything a peer may send is bounded before it is read. The codec's limits come from the
run (the policy's embedding rows, the context and response budgets), the message bound announced in
WELCOME is the run's own, and peers are authenticated in ZeroMQ's handshake (``transport.auth``:
a token, or CURVE), so one that fails it never has a message buffered. Frames are bounded at
``MAX_FRAME_BYTES`` (peers split larger ones) and connections in the handshake are capped per
source and in all, so what hosts without credentials can make the learner hold is bounded too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config.root import Config
from common.hostkey import host_key
from common.identity import embedding_rows, wire_identities
from common.logging import get_logger
from common.peer_auth import auth_mode, learner_token
from common.safetensors_buffers import load_dir
from protocol.codec import CodecLimits, run_message_bytes
from protocol.driver import LearnerServer
from protocol.events import BatchReceived
from protocol.limits import MAX_FRAME_BYTES
from protocol.receiver import LearnerProtocol
from protocol.zmq_auth import CurveServerKeys
from protocol.zmq_transport import ZmqServerChannel, exposure_warning, raise_fd_limit


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
        # Peers split every larger frame (SPEC §2), so libzmq buffers at most this much for any
        # one frame: what a connection still in the handshake can make the learner hold (§13).
        max_frame_bytes=MAX_FRAME_BYTES,
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
            fix="transport.auth: auto (the run's token, or the certificates of transport.curve)",
        )
    raise_fd_limit()  # a descriptor per connection, handshaking ones included
    channel = ZmqServerChannel(
        address,
        curve=curve,
        token=token,
        on_refused=on_refused,
        max_message_bytes=limits.max_message_bytes,
        max_frame_bytes=MAX_FRAME_BYTES,
        budget=proto.message_budget,
        allowance=proto.hold_allowance,
    )
    server = LearnerServer(proto, channel, persist=persist)
    if publish_initial:
        server.publish_weights(
            0, load_dir(config.actor_rollout_ref.model.path), chunk_bytes=t.weight_chunk_bytes
        )
    return server, channel
