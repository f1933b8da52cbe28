"""protocol.lineage: the updates between two policy versions, across learner restarts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.lineage import Lineage


def test_without_restarts_it_is_the_difference() -> None:
    assert Lineage().distance(3, 10) == 7 == Lineage().distance(10, 3)


def test_one_restart() -> None:
    # checkpoint at 10, published up to 12, resumed as 13 (= the weights of 10)
    line = Lineage().resumed(13, 10)
    assert line.distance(10, 13) == 0  # the same weights
    assert line.distance(8, 15) == 2 + 2  # 8 -> 10, then 13 -> 15
    assert line.distance(12, 13) == 2  # a discarded branch: 12 back to 10
    assert line.distance(11, 14) == 1 + 1
    assert line.distance(14, 16) == 2


def test_a_restart_from_before_an_earlier_one() -> None:
    line = Lineage().resumed(13, 10).resumed(20, 8)
    assert line.distance(15, 21) == 2 + 2 + 1  # 15 -> 13 (= 10) -> 8 (= 20) -> 21
    assert line.distance(8, 20) == 0
    assert line.resumed(25, 25) == line  # a plain restart adds nothing


def test_bad_aliases_are_refused() -> None:
    with pytest.raises(ValueError):
        Lineage(((5, 7),))
    with pytest.raises(ValueError):
        Lineage(((5, 3), (5, 2)))


@given(st.lists(st.integers(0, 5), max_size=4), st.integers(0, 60), st.integers(0, 60))
def test_a_distance_is_the_path_in_the_tree_of_versions(drops: list[int], a: int, b: int) -> None:
    """Against a brute-force walk: build the run's versions one by one, restarting by ``drops``."""
    line, parent, top = Lineage(), {0: None}, 0
    for d in drops:  # train 3 versions, then restart from d versions back
        for _ in range(3):
            top += 1
            parent[top] = (top - 1, 1)
        restored, resumed = max(0, top - 1 - d), top + 1
        if restored < resumed:
            line = line.resumed(resumed, restored)
            parent[resumed] = (restored, 0)
            top = resumed
    while top < 60:
        top += 1
        parent[top] = (top - 1, 1)

    def path(x: int) -> dict[int, int]:  # ancestor -> updates from x
        out, cost = {}, 0
        while x is not None:
            out[x] = cost
            step = parent[x]
            if step is None:
                break
            x, c = step
            cost += c
        return out

    pa, pb = path(a), path(b)
    best = min(pa[x] + pb[x] for x in pa.keys() & pb.keys())
    assert line.distance(a, b) == best
