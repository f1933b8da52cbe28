"""The rollout half of admission (``rollout_service.granting.GrantBook``), on its own: room, weights
lag, a waiting drain and the learner's grants decide whether a group starts, and on which grant."""

from __future__ import annotations

import pytest

from rollout_service.granting import GrantBook


def book(*, limit: int = 4, k: int = 1, grants: bool | None = False) -> tuple[GrantBook, list[int]]:
    """A book with room for ``limit`` episodes at ``max_staleness`` ``k``, after a first session
    (``grants``: whether the learner grants; None: no session yet), and the gauge values it reported."""
    held: list[int] = []
    b = GrantBook(max_concurrent_episodes=limit, max_staleness=k, on_held=held.append)
    if grants is not None:
        b.session(grants=grants)
    return b, held


def test_nothing_starts_before_the_first_session_says_whether_the_learner_grants() -> None:
    b, held = book(grants=None)
    assert b.held == -1 and not b.may_admit(1, 0)
    b.session(grants=False)
    assert b.may_admit(1, 0) and held == [-1]


def test_episodes_in_flight_stay_under_the_limit_but_one_group_always_fits() -> None:
    b, _ = book(limit=4)
    assert b.may_admit(8, 0)  # nothing runs: a group larger than the limit runs alone
    b.start(2, 0)
    assert b.may_admit(2, 0) and not b.may_admit(3, 0)
    b.start(2, 0)
    assert (b.running, b.groups) == (4, 2) and not b.may_admit(1, 0)
    b.finished(2)
    assert (b.running, b.groups) == (2, 1) and b.may_admit(2, 0)


def test_no_group_starts_while_the_weights_lag_past_max_staleness() -> None:
    b, _ = book(k=1)
    assert b.announced(1) and b.may_admit(1, 0)  # one version behind: allowed at k=1
    assert b.announced(2) and not b.may_admit(1, 0)
    assert b.may_admit(1, 1)  # the engine caught up
    assert not b.announced(2) and not b.announced(1)  # not newer: nothing changes
    assert b.newest_version == 2


def test_a_waiting_drain_stops_admission() -> None:
    b, _ = book()
    b.draining = True
    assert not b.may_admit(1, 0)
    b.draining = False
    assert b.may_admit(1, 0)


def test_with_grants_a_group_starts_only_on_a_grant_its_weights_reach() -> None:
    b, held = book(grants=True)
    assert b.held == 0 and not b.may_admit(1, 0)
    assert b.granted(1, 2) and b.granted(2, 1)
    assert held == [0, 1, 3]
    assert not b.may_admit(1, 0)  # both need newer weights
    assert b.grant(1) == 1 and b.grant(5) == 1  # smallest min_version first
    b.start(1, 5)
    b.start(1, 5)
    assert b.grant(5) == 2 and held[-2:] == [2, 1]
    b.start(1, 5)
    assert b.held == 0 and not b.may_admit(1, 5)
    assert held[-1] == 0


def test_a_start_without_a_usable_grant_is_refused() -> None:
    b, _ = book(grants=True)
    b.granted(1, 3)
    with pytest.raises(RuntimeError, match="may_admit"):
        b.start(1, 2)
    assert (b.running, b.held) == (0, 1)


def test_grants_end_with_their_session() -> None:
    b, held = book(grants=True)
    b.granted(2, 0)
    b.session_ended()
    assert b.held == 0 and not b.may_admit(1, 0) and held[-1] == 0
    b.granted(1, 0)
    b.session(grants=True)  # a new session: the old one's grants are void
    assert b.held == 0 and not b.may_admit(1, 0)


def test_a_learner_that_grants_nothing_leaves_admission_to_room_and_lag() -> None:
    b, held = book(grants=False)
    assert not b.granted(3, 0)  # ignored: this session takes no grants
    b.session_ended()  # between sessions the last WELCOME rules: admission goes on
    assert b.may_admit(1, 0) and b.held == -1 and held == [-1]
    b.start(1, 0)  # no grant used
    assert b.running == 1


def test_a_failed_transfer_of_the_newest_version_frees_admission() -> None:
    b, _ = book(k=1)
    b.announced(10**9)
    assert not b.may_admit(1, 3)
    assert not b.transfer_failed(5, 3)  # not the newest: changes nothing
    assert b.transfer_failed(10**9, 3)
    assert b.newest_version == 3 and b.may_admit(1, 3)  # what the engine runs
    b.announced(5)
    assert not b.transfer_failed(5, 5)  # the engine runs it already
    assert b.newest_version == 5


def test_a_refused_groups_grant_is_held_again_within_its_session_only() -> None:
    b, held = book(grants=True)
    b.granted(2, min_version=3)
    first = b.start(1, 3)
    assert first == 3 and b.held == 1 and b.sessions == 1
    # the learner still counts the refused group's grant: held again
    assert b.refused(first, session=1) and b.held == 2 and held[-1] == 2
    second = b.start(1, 3)
    b.session(grants=True)  # a new session: the old one's grants are void on both sides
    assert second is not None and not b.refused(second, session=1) and b.held == 0
    plain, _ = book(grants=False)
    assert plain.start(1, 0) is None  # without grants there is none to hold again
