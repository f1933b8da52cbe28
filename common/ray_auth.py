"""Joining a Ray cluster that uses Ray's token authentication.

Design: `ray start --head` turns token authentication on by default and leaves the token in
``~/.ray/auth_token``, but a process that then joins it with ``ray.init(address=...)`` presents the
token only when ``RAY_AUTH_MODE=token`` is set; without it every call fails with InvalidAuthToken.
`join_mode` sets that mode, before ``ray.init``, whenever a token is there to present and the user
chose no mode; an explicit ``RAY_AUTH_MODE`` is always respected. The children it starts inherit
the mode through the environment.
"""

from __future__ import annotations

import os
from pathlib import Path

MODE = "RAY_AUTH_MODE"


def _token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(path).is_file() if path else (Path.home() / ".ray" / "auth_token").is_file()


def join_mode() -> str | None:
    """Set RAY_AUTH_MODE=token when it is unset and a token exists; the mode now in effect."""
    if MODE not in os.environ and _token_available():
        try:  # Ray's own switch also refreshes the config it cached at import
            from ray._private.authentication.authentication_token_setup import (
                maybe_enable_token_auth_if_token_available,
            )

            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        except ImportError:  # another Ray: the variable alone, read by ray.init
            pass
        os.environ.setdefault(MODE, "token")
    return os.environ.get(MODE)
