"""Process-level sections: `rollout_server`, `learner`, `transport` and `logging`.

Design: the transport limits are shared by both ends on purpose (one file configures the learner
and every rollout server), so a sender never produces a message its receiver refuses. Values that
depend on the machine a process runs on (the server id) stay null here and are derived at runtime.
"""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field

from common.config.base import MiB, Section, ZmqEndpoint


class PromptMemoryConfig(Section):
    """Skip prompts whose groups keep coming out uniform (``rollout_service/prompt_memory.py``)."""

    last_k: int = Field(default=0, ge=0)
    """Skip a prompt once its last `last_k` groups were uniform (every episode passed or every one
    failed, under algorithm.filter_groups.metric); 0: off."""
    skip_epochs: int = Field(default=1, ge=1)
    """Epochs such a prompt is skipped for; then it runs again with a clean record."""


class RolloutServerConfig(Section):
    """A standalone rollout server (vLLM engine + agent loops) feeding the learner."""

    server_id: str | None = Field(default=None, min_length=1)
    """Name of this server in logs and on the wire; null: `<hostname>-<pid>`."""
    engine: Literal["vllm", "scripted"] = "vllm"
    """What generates: vllm (the model, vLLM's AsyncLLM in process), or scripted (a fixed answer on
    the model's tokenizer, no sampling: for tests of the launcher, placement and data paths where
    the model is not under test; ``rollout_service/engine/scripted.py``)."""
    scripted_turns: list[str] | None = Field(default=None, min_length=1)
    """The scripted engine's answers, one per turn in rotation (an answer and a non-answer make
    groups whose episodes score differently); null: one final answer, ``\\boxed{0}``."""
    prompt_memory: PromptMemoryConfig = Field(default_factory=PromptMemoryConfig)
    """Per-prompt memory: prompts always solved or always failed are skipped for a while."""
    learner_address: ZmqEndpoint = "tcp://127.0.0.1:5555"
    """ZeroMQ endpoint of the learner to connect to."""
    max_concurrent_episodes: int = Field(default=64, gt=0)
    """Episodes (agent loops) running at once on this server."""
    max_groups: int | None = Field(default=None, gt=0)
    """Stop after this many prompt groups are shipped and acknowledged; null: run until stopped."""
    shard_index: int = Field(default=0, ge=0)
    """This server's shard of the training data (rows i with i % shard_count == shard_index)."""
    shard_count: int = Field(default=1, gt=0)
    """Rollout servers sharing the data set without overlap."""
    groups_per_batch: int = Field(default=1, gt=0)
    """Whole prompt groups (rollout.n trajectories each) per trajectory batch sent to the learner."""
    max_unacked_batches: int = Field(default=8, gt=0)
    """Batches handed to the protocol and not yet acknowledged before episodes stop being admitted
    (they wait on disk in the spool, never in memory only)."""
    record: bool = False
    """Write every shipped batch to <run_dir>/recordings/<server_id>/ (read by the replay tool)."""
    record_max_mb: float | None = Field(default=None, gt=0)
    """Bound of each server's recording: beyond it the oldest batch files are deleted; null: none."""
    stats_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between stats lines in the log."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the Prometheus endpoint (/metrics); null: off, 0: any free port (logged)."""
    metrics_host: str = Field(default="127.0.0.1", min_length=1)
    """Interface the Prometheus endpoint binds: loopback by default; 0.0.0.0 for a scraper on
    another host (the endpoint has no authentication: expose it only on a trusted network)."""
    reward_fn: str = Field(default="math", min_length=1)
    """Reward function (registry name: math, qa_f1, qa_em, code) for rows that name none."""
    reward_by_data_source: dict[str, str] = Field(default_factory=dict)
    """Reward function per data source, overriding reward_fn (a row's own `reward_fn` field wins)."""
    tool_timeout_s: float = Field(default=30.0, gt=0)
    """Wall-clock limit of one tool call of any kind; a slower call becomes an error response. A
    rate-limited tool's wait for its token is not counted (tools.rate_limits.acquire_timeout_s)."""
    weights_timeout_s: float = Field(default=60.0, gt=0)
    """A weight transfer from the learner is abandoned when no new chunk has arrived for this long,
    or when it is not complete this long plus its size at ``weights_min_mb_per_s`` after its
    announce: the learner gets WEIGHTS_APPLIED ok=false and ERROR TIMED_OUT, and the server keeps
    its weights (protocol SPEC §8)."""
    weights_min_mb_per_s: float = Field(default=5.0, gt=0)
    """The slowest rate (MB/s) a weight transfer is given time for; a 15 GB model: 60 s + 50 min."""

    def resolved_server_id(self) -> str:
        """The configured server id, or one unique to this host and process."""
        return self.server_id or f"{socket.gethostname()}-{os.getpid()}"


class LearnerConfig(Section):
    """The learner's network side."""

    bind_address: ZmqEndpoint = "tcp://127.0.0.1:5555"
    """ZeroMQ endpoint the learner binds for rollout servers. Loopback by default: rollout servers on
    other hosts need an explicit address (tcp://0.0.0.0:5555, configs/multinode.yaml); transport.auth
    (the token, or certificates) decides who gets in, and lets servers tell the learner from an
    impostor."""
    buffer_batches: int = Field(default=16, gt=0)
    """Trajectory batches the learner holds at most (received and not yet trained on, plus credits
    granted and unused): the room that credit-based flow control hands out to rollout servers.
    With admission it is raised, if needed, to hold every admitted group (twice the window)."""
    admission: bool = True
    """Rollout servers start prompt groups only as the learner grants them (protocol 1.3,
    ``learner/admission.py``): at most ``(max_staleness + 1) * train_batch_size`` groups are
    generating or waiting at once, each on weights fresh enough to be trained, and the learner
    waits for a slow group instead of dropping it. Nothing generated is wasted; ``max_staleness:
    0`` is a synchronous trainer. false: servers generate ahead as credits allow and the learner
    drops what grew too stale (and servers that predate 1.3 always do)."""
    mix_wait_s: float = Field(default=30.0, ge=0)
    """Mixed runs (``data.datasets``): each step takes exactly the configured count of groups per
    source (the servers' schedule counts). When a source has too few groups buffered, the step waits
    for them at most this long after it could otherwise have been taken, then fills their places
    from the other sources (``batch/mix_shortfall``). 0: never wait for the mix."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the learner's Prometheus endpoint (``trainer.logger`` includes prometheus); null or
    0: any free port (logged)."""
    metrics_host: str = Field(default="127.0.0.1", min_length=1)
    """Interface the learner's Prometheus endpoint binds: loopback by default; 0.0.0.0 for a
    scraper on another host (no authentication: expose it only on a trusted network)."""
    weights_file_dir: str | None = "/dev/shm"
    """Where new weights are written as safetensors files for rollout servers on this machine,
    which reload them in place instead of receiving chunks (the fast path; others still get
    chunks); null: chunks only. The directory must be RAM-backed and hold a few model copies."""
    weights_file_slots: int = Field(default=3, ge=2)
    """Files the learner keeps there at most; one is rewritten in place (no new pages to fault
    in) once every rollout server using files has applied a newer version."""


class CurveConfig(Section):
    """ZeroMQ CURVE encryption and authentication with ZeroMQ certificate files (bin/make-curve-keys).

    One file configures both ends: the learner uses secret_key_file and allowed_keys_dir, a rollout
    server uses secret_key_file and server_public_key_file (each side overrides secret_key_file
    with its own certificate).
    """

    enabled: bool = False
    """Authenticate every connection with these certificates instead of the token (both encrypt);
    needs secret_key_file, server_public_key_file and allowed_keys_dir."""
    secret_key_file: str | None = None
    """This process's certificate with its secret key (`*.key_secret`)."""
    public_key_file: str | None = None
    """This process's public certificate; null: the public key inside secret_key_file."""
    server_public_key_file: str | None = None
    """The learner's public certificate; rollout servers authenticate the learner with it."""
    allowed_keys_dir: str | None = None
    """Directory of public certificates of the rollout servers the learner lets in."""


CURVE_REQUIRED_FIELDS = ("secret_key_file", "server_public_key_file", "allowed_keys_dir")
"""Fields of CurveConfig that must be set when CURVE is enabled."""


class TransportConfig(Section):
    """Limits and timings of the learner <-> rollout server protocol."""

    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    """Seconds between heartbeats."""
    heartbeat_timeout_s: float = Field(default=10.0, gt=0)
    """A peer silent this long is declared dead; must exceed heartbeat_interval_s."""
    handshake_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds to wait for the peer's handshake reply before failing start-up."""
    initial_credits: int = Field(default=4, gt=0)
    """Trajectory batches a rollout server may send before the learner grants more (back-pressure)."""
    max_message_bytes: int = Field(default=256 * MiB, gt=0)
    """Largest message either side accepts (ZeroMQ maxmsgsize)."""
    max_trajectories_per_batch: int = Field(default=4096, gt=0)
    """Most trajectories in one message."""
    max_tokens_per_trajectory: int = Field(default=1_048_576, gt=0)
    """Most tokens (prompt + response) in one trajectory."""
    weight_chunk_bytes: int = Field(default=64 * MiB, gt=0)
    """Size of the chunks weights are streamed in; at most max_message_bytes."""
    curve: CurveConfig = Field(default_factory=CurveConfig)
    """Encryption."""
    auth: Literal["auto", "curve", "token", "none"] = "auto"
    """Who may open a connection to the learner, checked in ZeroMQ's handshake (ZAP) so that no
    message of a refused peer is ever buffered (protocol SPEC §13). Both curve and token are
    mutual (the learner proves itself before a client sends any credential, so a process posing
    as the learner learns nothing and pushes no weights) and encrypted; both need a libzmq with
    CURVE (pyzmq's wheels have it). curve: the certificates of transport.curve (needs
    curve.enabled); token: CURVE with key pairs derived from the shared secret in auth_token_file,
    which never crosses the wire; none: anyone who reaches the address, and a rollout server
    cannot tell the learner from an impostor (warned at start); auto: curve when
    transport.curve.enabled, else token."""
    auth_token_file: str | None = None
    """The shared token of auth: token; null: <run_dir>/learner.token. The learner creates it
    (mode 0600, 256 random bits) when missing and keeps it across restarts; rollout servers read it
    at every connection and wait for it to appear (on another host: copy the file; relays and
    bin/replay, bin/conformance take it as --token-file)."""


class LoggingConfig(Section):
    """Log output of every process."""

    format: Literal["console", "json"] = "console"
    """console: readable lines; json: one JSON object per line (overridden by --log-format and
    AGENTRL_LOG_FORMAT)."""
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level written."""
