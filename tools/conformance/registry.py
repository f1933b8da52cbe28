"""The check registry and the types every check shares.

A check is a coroutine function registered for a role with ``@register(role)``; its name is the
function name without ``check_`` and its summary the first docstring line. Registration order is
run order (the rollout-server checks depend on it). A check passes by returning, fails by raising
``CheckFailed`` with a one-line reason, and may attach notes (shown after PASS) and details (JSON
only) to its context. Check modules are imported lazily by ``checks(role)``, so importing the
registry costs nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["learner", "rollout-server"]
ROLES: tuple[Role, ...] = ("learner", "rollout-server")
_MODULES: dict[str, str] = {
    "learner": "tools.conformance.checks_learner",
    "rollout-server": "tools.conformance.checks_rollout",
}


class CheckFailed(Exception):
    """The endpoint under test did something the protocol forbids (or nothing where it must act)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CheckContext:
    """What every check receives: its time budget and where to put notes and details."""

    def __init__(self, *, timeout: float) -> None:
        self.timeout = timeout
        self.notes: list[str] = []
        self.details: dict[str, Any] = {}
        # What the check is waiting for right now (set by the context's receive helpers): when the
        # suite's safety limit or --deadline cuts a check off, the reason names it.
        self.waiting_for = ""

    def note(self, text: str) -> None:
        self.notes.append(text)

    def reset_report(self) -> None:
        self.notes, self.details, self.waiting_for = [], {}, ""


CheckFn = Callable[[Any], Awaitable[None]]


@dataclass(frozen=True)
class Check:
    name: str
    role: Role
    func: CheckFn
    summary: str


@dataclass
class Result:
    name: str
    passed: bool
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, dict[str, Check]] = {role: {} for role in ROLES}


def register(role: Role) -> Callable[[CheckFn], CheckFn]:
    def deco(func: CheckFn) -> CheckFn:
        name = func.__name__.removeprefix("check_")
        if name in _REGISTRY[role]:
            raise ValueError(f"check {name!r} registered twice for role {role}")
        summary = (func.__doc__ or "").strip().splitlines()[0] if func.__doc__ else ""
        _REGISTRY[role][name] = Check(name, role, func, summary)
        return func

    return deco


def checks(role: Role) -> list[Check]:
    """The registered checks of ``role``, in run order."""
    importlib.import_module(_MODULES[role])
    return list(_REGISTRY[role].values())
