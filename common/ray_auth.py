"""Joining a Ray cluster that uses Ray's token authentication, and starting one of our own.

Design (joining): `ray start --head` turns token authentication on by default and leaves the token in
``~/.ray/auth_token``, but a process that joins with ``ray.init(address=...)`` presents it only in
token mode (``RAY_AUTH_MODE=token``); without it every call fails with InvalidAuthToken. A cluster
may also run without authentication, and a client in token mode breaks there. So `join` connects
as the environment says, and only when that is refused while a token is at hand and the user chose
no mode does it switch this process (and the children it starts) to token mode and connect again.

Design (a cluster of our own, `start_local`): Ray takes a machine's routable address as the node's
even when told 127.0.0.1, and then serves its metrics endpoints (dashboard agent, autoscaler,
dashboard head) on every interface to anyone. Ray keeps every endpoint on loopback when it believes
it runs without cluster support (its ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` switch, honoured on any
platform), which is what a single-host job is. The switch is read at import, so it goes in the
environment for Ray's own processes and into the constant this process may have read already.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MODE = "RAY_AUTH_MODE"
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(path).is_file() if path else (Path.home() / ".ray" / "auth_token").is_file()


def _loopback() -> None:
    """Ray's endpoints of this process and the Ray processes it starts stay on loopback."""
    os.environ[LOOPBACK_SWITCH] = "0"
    from ray._private import ray_constants  # lazy: Ray's switch, as read at its import

    ray_constants.ENABLE_RAY_CLUSTER = False


def _on_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    return host == "localhost" or host.startswith("127.") or host == "::1"


def join(address: str, **init_kwargs: Any) -> None:
    """``ray.init(address=address, **init_kwargs)``, in token mode if the cluster asks for it. A
    cluster at a loopback address (one `start_local` made) is joined on loopback: Ray would
    otherwise turn 127.0.0.1 into this machine's routable address, where that cluster is not."""
    import ray  # lazy: the callers import Ray only when they join a cluster

    if _on_loopback(address):
        _loopback()

    try:
        ray.init(address=address, **init_kwargs)
        return
    except ConnectionError:
        if MODE in os.environ or not _token_available():
            raise
    ray.shutdown()
    # lazy: Ray's own switch, which also refreshes the config Ray cached at import
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    os.environ.setdefault(MODE, "token")
    ray.init(address=address, **init_kwargs)


def start_local(**init_kwargs: Any) -> None:
    """``ray.init(address="local", **init_kwargs)``: a new cluster for this job alone, every
    endpoint of it on loopback (never one that a `ray start` left on the machine)."""
    import ray  # lazy: the callers import Ray only when they start a cluster

    _loopback()
    ray.init(address="local", **init_kwargs)
