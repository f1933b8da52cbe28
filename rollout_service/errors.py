"""The rollout server's start-up error, shared by the server, its wiring and ``--check``."""


class StartupError(Exception):
    """The server cannot start as configured; the message names the key or resource to change."""
