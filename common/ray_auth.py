"""Joining a Ray cluster that uses Ray's token authentication.

Design: `ray start --head` turns token authentication on by default and leaves the token in
``~/.ray/auth_token``, but a process that joins with ``ray.init(address=...)`` presents it only in
token mode (``RAY_AUTH_MODE=token``); without it every call fails with InvalidAuthToken. A cluster
may also run without authentication, and a client in token mode breaks there. So `join` connects
as the environment says, and only when that is refused while a token is at hand and the user chose
no mode does it switch this process (and the children it starts) to token mode and connect again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MODE = "RAY_AUTH_MODE"


def _token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(path).is_file() if path else (Path.home() / ".ray" / "auth_token").is_file()


def join(address: str, **init_kwargs: Any) -> None:
    """``ray.init(address=address, **init_kwargs)``, in token mode if the cluster asks for it."""
    import ray  # lazy: the callers import Ray only when they join a cluster

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
