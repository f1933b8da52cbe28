"""The rollout server's half of admission: whether the next prompt group may start, and on which
grant.

Design: sans-IO. ``GrantBook`` holds no engine, socket or clock: the server tells it what happened
(a session began or ended, the learner granted groups or announced a version, a group started or
finished, a ``drain`` weight update is waiting) and asks ``may_admit`` before each group, passing
the version its engine runs. A group starts only while

(a) there is room under ``max_concurrent_episodes`` (a group always starts when nothing runs, so a
    group larger than the limit still runs, alone),
(b) the engine's weights are at most ``max_staleness`` versions behind the newest the learner
    announced (``protocol.staleness.weights_too_old``),
(c) no ``drain`` weight update is waiting, and
(d) when the learner grants groups (protocol 1.3, "admission": ``learner/admission.py`` has the
    learner's rule) a grant is held whose ``min_version`` the engine's weights reach.

Grants are used smallest ``min_version`` first and end with their session. A group whose batch the
learner refused never arrives, but the learner counts its grant as generating until a group
arrives on it: ``refused`` holds that grant again (within its session) for another group.
Whether the learner grants at all is what its WELCOME says, so nothing starts before the first
session; a learner that grants nothing (older than 1.3, or ``learner.admission: false``) leaves
(a)-(c). Between sessions the last WELCOME still rules: without grants admission goes on (the
shipper's window of unacked batches stops it), with grants it waits for the next session's.

The cluster simulator (``bench/clustersim``) runs one ``GrantBook`` per simulated server, so its
predictions follow this rule and not a copy of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from protocol.staleness import weights_too_old


def _ignore(_held: int) -> None:
    pass


class GrantBook:
    def __init__(
        self,
        *,
        max_concurrent_episodes: int,
        max_staleness: int,
        on_held: Callable[[int], None] = _ignore,
    ) -> None:
        """``on_held(held)``: told ``held`` after every change of the grants (the server's gauge)."""
        self.max_concurrent_episodes, self.max_staleness = max_concurrent_episodes, max_staleness
        self._on_held = on_held
        self.newest_version = 0  # newest policy version the learner announced
        self.running = 0  # episodes in flight
        self.groups = 0  # groups in flight
        self.draining = False  # a drain weight update waits for the running groups to finish
        self.welcomed = False  # a first session tells whether the learner grants groups
        self.sessions = 0  # sessions begun: a grant belongs to one
        self._granted: Counter[int] | None = None  # min_version -> groups granted; None: no grants

    @property
    def held(self) -> int:
        """Groups granted and not started yet; -1 when the learner grants none."""
        return -1 if self._granted is None else sum(self._granted.values())

    def may_admit(self, n: int, engine_version: int) -> bool:
        """Whether a group of ``n`` episodes may start on an engine running ``engine_version``."""
        if self.draining or not self.welcomed:
            return False
        if weights_too_old(self.newest_version, engine_version, self.max_staleness):
            return False
        if self._granted is not None and self.grant(engine_version) is None:
            return False
        return self.running == 0 or self.running + n <= self.max_concurrent_episodes

    def grant(self, engine_version: int) -> int | None:
        """The smallest ``min_version`` among the grants ``engine_version`` satisfies (None: none)."""
        usable = [m for m, k in (self._granted or {}).items() if k > 0 and m <= engine_version]
        return min(usable) if usable else None

    def start(self, n: int, engine_version: int) -> int | None:
        """A group of ``n`` episodes starts (``may_admit`` said so): it uses the grant ``grant``
        picks, when the learner grants. Returns that grant's ``min_version`` (None: no grants)."""
        m = None
        if self._granted is not None:
            m = self.grant(engine_version)
            if m is None:
                raise RuntimeError("no usable grant: a group starts only when may_admit says so")
            self._granted[m] -= 1
            if not self._granted[m]:
                del self._granted[m]
            self._on_held(self.held)
        self.running += n
        self.groups += 1
        return m

    def refused(self, min_version: int, session: int) -> bool:
        """The learner refused the batch of a group started on a grant of ``min_version`` in
        ``session``: the learner still counts that grant as generating, and only a group that
        arrives takes it off its books, so the grant is held again for another group. False
        (nothing changes) when that session has ended: its grants are void on both sides."""
        if session != self.sessions or self._granted is None:
            return False
        self._granted[min_version] += 1
        self._on_held(self.held)
        return True

    def finished(self, n: int) -> None:
        """A group of ``n`` episodes ended (shipped, dropped or failed)."""
        self.running -= n
        self.groups -= 1

    def session(self, *, grants: bool) -> None:
        """A session began; ``grants``: the learner grants groups (its WELCOME offers admission).
        Grants of an earlier session are void."""
        self._granted = Counter() if grants else None
        self.welcomed = True
        self.sessions += 1
        self._on_held(self.held)

    def session_ended(self) -> None:
        """The learner left: with grants, wait for the next session's."""
        if self._granted is not None:
            self._granted = Counter()
            self._on_held(self.held)

    def granted(self, groups: int, min_version: int) -> bool:
        """The learner granted ``groups`` more, to run on ``min_version`` or newer. False (and
        nothing changes) when this session takes no grants."""
        if self._granted is None:
            return False
        self._granted[min_version] += groups
        self._on_held(self.held)
        return True

    def announced(self, version: int) -> bool:
        """The learner announced ``version`` (or the engine applied it); True when it is newer than
        any before: the staleness bound (b) counts from it."""
        if version <= self.newest_version:
            return False
        self.newest_version = version
        return True

    def transfer_failed(self, version: int, engine_version: int) -> bool:
        """The transfer of ``version`` failed; True when that frees admission: it was the newest
        announced, which the engine (at ``engine_version``) does not run."""
        if not version == self.newest_version > engine_version:
            return False
        # Nothing more of it will come (abandoned at its deadline, failed verification), and it
        # superseded any transfer before it: admission no longer waits for weights that will not
        # arrive. The learner's next version, or its grants, set the pace again.
        self.newest_version = engine_version
        return True
