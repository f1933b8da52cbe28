"""Who may connect to the learner: the run's ``transport.auth`` turned into what a socket needs.

Design: peers are authenticated in ZeroMQ's handshake (``protocol.zmq_transport``), never after a
message, because libzmq buffers a whole multi-frame message before any reader sees its first frame
(SPEC §13). Without certificates the default is a shared token: the learner creates it once per
run directory (mode 0600) and keeps it across restarts; every client of the run (rollout servers,
relays, replay, conformance, tests) reads the same file, so one config on one host just works.
The token itself never crosses the wire: both ends derive CURVE key pairs from it
(``protocol.zmq_auth.token_keys``), so each proves to the other that it holds the token, and
traffic is encrypted. It is a secret, never part of the config, so it never lands in
``config.resolved.yaml``.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from common.config import Config
from common.config.agents import ToolServerConfig
from common.rundir import resolve_run_dir

AuthMode = Literal["curve", "token", "none"]
TOKEN_FILE_NAME = "learner.token"
TOOL_TOKEN_FILE_NAME = "tool-server.token"
"""Where bin/train keeps the secret of the tool server it starts (``tool_server.token_file``)."""
TOKEN_BYTES = 32  # 256 random bits, written as hex


def auth_mode(config: Config) -> AuthMode:
    """``transport.auth`` with ``auto`` resolved: curve when CURVE is on, else token."""
    mode = config.transport.auth
    if mode == "auto":
        return "curve" if config.transport.curve.enabled else "token"
    return mode


def token_path(config: Config, run_dir: Path | None = None) -> Path:
    """``transport.auth_token_file``, else ``learner.token`` in the run directory (``run_dir``, or
    the one the config names: where the learner and every rollout server of the run meet)."""
    if config.transport.auth_token_file:
        return Path(config.transport.auth_token_file)
    return (run_dir if run_dir is not None else resolve_run_dir(config)) / TOKEN_FILE_NAME


def read_token(path: Path) -> str:
    """The token in ``path``; FileNotFoundError when there is none yet, ValueError when empty."""
    token = path.read_text(encoding="ascii").strip()
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


def ensure_token(path: Path) -> str:
    """The token in ``path``, created (0600, random) when missing. A half-written file is never
    seen: it is written under a temporary name and linked into place, and when two processes race
    the first link wins and both return its token."""
    try:
        return read_token(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_hex(TOKEN_BYTES) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return read_token(path)


def learner_token(config: Config, run_dir: Path | None = None) -> str | None:
    """The learner's side: the token it requires (created when missing), or None when
    ``transport.auth`` is not token."""
    return ensure_token(token_path(config, run_dir)) if auth_mode(config) == "token" else None


def client_token(config: Config, run_dir: Path | None = None) -> str | None:
    """What a client of the run's learner presents (None when ``transport.auth`` is not token):
    the one helper for tools, benches and tests that connect to a learner. The learner must have
    started (it creates the file); rollout servers use ``wait_for_token`` instead."""
    return read_token(token_path(config, run_dir)) if auth_mode(config) == "token" else None


async def wait_for_token(
    path: Path,
    *,
    poll_s: float = 0.2,
    warn_after_s: float = 10.0,
    warn: Callable[..., Any] | None = None,
) -> str:
    """The token in ``path``, waiting for the learner to create it (as a client waits for the
    learner itself). ``warn(message, **fields)`` is called once if that takes ``warn_after_s``."""
    import anyio

    start, warned = time.monotonic(), False
    while True:
        try:
            return read_token(path)
        except (FileNotFoundError, ValueError):
            pass
        if not warned and warn is not None and time.monotonic() - start >= warn_after_s:
            warned = True
            warn(
                "waiting for the learner's token file",
                path=str(path),
                fix="start the learner with the same config (it creates the file), or copy the "
                "file to this path when the learner runs on another host",
            )
        await anyio.sleep(poll_s)


def tool_server_token(settings: ToolServerConfig, *, create: bool = False) -> str | None:
    """The tool server's shared secret: ``tool_server.token``, else the token in
    ``tool_server.token_file`` (created when missing if ``create``: the tool server's side), else
    None (no check). A client whose file is missing gets a FileNotFoundError naming the key."""
    if settings.token is not None:
        return settings.token
    if settings.token_file is None:
        return None
    path = Path(settings.token_file)
    if create:
        return ensure_token(path)
    try:
        return read_token(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"tool_server.token_file: {path} does not exist (the tool server creates it when it "
            "starts; for a tool server on another host, copy its file here)"
        ) from None
