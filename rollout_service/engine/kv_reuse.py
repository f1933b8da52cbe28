"""Which cached KV a request may reuse across weight updates, and how much it found.

Design: vLLM's prefix cache is salted, so blocks are shared only by requests with the same salt.
A request's salt is ``policy-v<version>`` of the weights its KV was first computed with: a new
request gets the current version's, so it never reuses blocks of older weights. Under ``keep``
updates two kinds of request keep an older salt, and with it the KV they already had: a request
continued after the update (`VllmEngine` on a vLLM without per-token versions), and a later turn of
an episode (``SamplingSettings.kv_scope``), which takes the salt of its episode's first turn. An
``abort`` update forgets the episodes' salts (`Salts.forget`). ``Reuse`` counts how much of what
such requests sent vLLM found cached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

SCOPES_KEPT = 16384
"""Episodes whose salt is remembered (the oldest go first; one ended long ago is harmless)."""


def salt(version: int) -> str:
    return f"policy-v{version}"


class Salts:
    """The salt of each episode (``kv_scope``) that has submitted a turn."""

    def __init__(self) -> None:
        self._scopes: OrderedDict[str, str] = OrderedDict()

    def of(self, scope: str) -> str:
        """The salt ``scope``'s turns reuse, "" for none (a new episode, or none named)."""
        return self._scopes.get(scope, "") if scope else ""

    def used(self, scope: str, chosen: str) -> None:
        """``scope`` submitted a turn with the salt ``chosen`` (its first one sets it)."""
        if not scope:
            return
        self._scopes.setdefault(scope, chosen)
        self._scopes.move_to_end(scope)
        if len(self._scopes) > SCOPES_KEPT:
            self._scopes.popitem(last=False)

    def forget(self) -> None:
        self._scopes.clear()


@dataclass
class Reuse:
    """Submissions on KV from before a weight update: how much of what they sent (prompt and
    tokens so far) vLLM found cached."""

    submissions: int = 0
    tokens: int = 0
    cached_tokens: int = 0

    def add(self, tokens: int, cached: int) -> None:
        self.submissions += 1
        self.tokens += tokens
        self.cached_tokens += cached
