"""Mixed training batches at the learner (``learner.buffer.mixed_pick``, ``Intake.configure_mix``).

Property tests on the selection: with every source delivering its count, a step holds exactly the
configured counts (the servers' ``batch_counts``), earliest deadline first within each source; what a
pick leaves behind is never less trainable than what earliest-deadline-first leaves; a short source
leaves the step waiting unless told to fill. Then the real intake fed by real protocol senders over
ZeroMQ: groups arriving in any order of sources come out in the exact mix, and a missing source
delays a step by at most ``mix_wait_s`` and is counted as shortfall.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.mixing import batch_counts
from learner.admission import feasible
from learner.buffer import Group, mix_shortfall, mixed_pick
from learner.link import LearnerLink
from protocol.trajectory import Trajectory

if str(Path(__file__).resolve().parent) not in sys.path:  # test_intake's senders (importlib mode)
    sys.path.append(str(Path(__file__).resolve().parent))
from test_intake import make_config, sending, serving, traj

SOURCES = ("math", "qa", "code")


def group(i: int, source: str, version: int) -> Group:
    t = Trajectory(
        f"g{i}-0",
        f"g{i}",
        np.zeros(2, np.int32),
        np.zeros(3, np.int32),
        np.ones(3, np.uint8),
        np.zeros(3, np.float32),
        np.full(3, version, np.int32),
        data_source=source,
    )
    return Group((i, f"g{i}"), [t], version)


def edf(groups: list[Group]) -> list[Group]:
    return sorted(groups, key=lambda g: g.deadline_key)  # stable: arrival order among equals


def quotas_of(ratios: list[int], batch: int) -> dict[str, int]:
    return dict(zip(SOURCES, batch_counts([float(r) for r in ratios], batch), strict=True))


mixes = st.tuples(
    st.lists(st.integers(1, 9), min_size=3, max_size=3),  # ratios
    st.integers(1, 16),  # batch size
)


@settings(max_examples=300, deadline=None)
@given(
    mixes,
    st.lists(st.tuples(st.sampled_from(SOURCES), st.integers(0, 3)), max_size=40),
    st.integers(0, 3),
)
def test_every_source_delivering_gives_the_exact_mix(
    mix: tuple[list[int], int], extra: list[tuple[str, int]], base: int
) -> None:
    ratios, batch = mix
    quotas = quotas_of(ratios, batch)
    # every source has at least its count queued, in an arbitrary arrival order with extras
    arrivals = [(s, base) for s, q in quotas.items() for _ in range(q)] + extra
    order = np.random.default_rng(len(extra) + batch).permutation(len(arrivals))
    queued = edf([group(i, *arrivals[j]) for i, j in enumerate(order)])
    pick = mixed_pick(queued, quotas, fill=False, fits=lambda left: True)
    assert pick is not None and mix_shortfall(pick, quotas) == 0
    assert {s: sum(g.source == s for g in pick) for s in SOURCES} == quotas
    for s in SOURCES:  # each source's earliest-deadline groups, in the buffer's order
        mine = [g for g in queued if g.source == s]
        assert [g for g in pick if g.source == s] == mine[: quotas[s]]
    assert pick == [g for g in queued if g in set(pick)]


@settings(max_examples=300, deadline=None)
@given(
    mixes,
    st.lists(st.tuples(st.sampled_from(SOURCES), st.integers(0, 4)), max_size=40),
    st.integers(0, 2),  # max staleness
    st.integers(0, 4),  # policy version
)
def test_deadlines_come_before_the_mix(
    mix: tuple[list[int], int], arrivals: list[tuple[str, int]], k: int, version: int
) -> None:
    """What a filled pick leaves behind is trainable in time whenever earliest-deadline-first's
    would be, nothing due now is left while a later group is picked, and the mix gives way only
    as far as deadlines need: with room to spare the shortfall is what the queue lacks."""
    ratios, batch = mix
    quotas = quotas_of(ratios, batch)
    queued = edf([group(i, s, min(v, version)) for i, (s, v) in enumerate(arrivals)])

    def deadlines(gs: list[Group]) -> list[int]:
        return [g.oldest_version + k for g in gs if g.oldest_version is not None]

    def fits(left: list[Group]) -> bool:
        d = deadlines(left)
        return not any(x <= version for x in d) and feasible(d, version, batch)

    pick = mixed_pick(queued, quotas, fill=True, fits=fits)
    assert pick is not None and len(pick) == min(batch, len(queued))
    left = [g for g in queued if g not in set(pick)]
    if fits(queued[batch:]):
        assert fits(left)
    due = [g for g in left if g.oldest_version is not None and g.oldest_version + k <= version]
    if due:  # a due group is left only when every picked group is due as well
        assert all(g.deadline_key <= due[0].deadline_key for g in pick)
    pure = mixed_pick(queued, quotas, fill=True, fits=lambda _: True)
    assert pure is not None
    if fits([g for g in queued if g not in set(pure)]):  # no deadline in the way: no swap
        lacking = sum(max(0, q - sum(g.source == s for g in queued)) for s, q in quotas.items())
        assert pick == pure and mix_shortfall(pick, quotas) == lacking


@settings(max_examples=200, deadline=None)
@given(mixes, st.lists(st.sampled_from(SOURCES), max_size=30))
def test_a_short_source_waits_unless_told_to_fill(
    mix: tuple[list[int], int], sources: list[str]
) -> None:
    ratios, batch = mix
    quotas = quotas_of(ratios, batch)
    queued = [group(i, s, 0) for i, s in enumerate(sources)]
    short = any(sources.count(s) < q for s, q in quotas.items())
    waiting = mixed_pick(queued, quotas, fill=False, fits=lambda _: True)
    assert (waiting is None) == short
    filled = mixed_pick(queued, quotas, fill=True, fits=lambda _: True)
    assert filled is not None and len(filled) == min(batch, len(queued))
    for s, q in quotas.items():  # every source still gives what it has, up to its count
        assert sum(g.source == s for g in filled) >= min(q, sources.count(s))


def test_a_source_the_mix_does_not_name_only_fills() -> None:
    quotas = {"math": 2, "qa": 1}
    queued = [group(0, "other", 0), group(1, "math", 0), group(2, "qa", 0), group(3, "math", 0)]
    pick = mixed_pick(queued, quotas, fill=False, fits=lambda _: True)
    assert pick is not None and [g.uid for g in pick] == ["g1", "g2", "g3"]
    pick = mixed_pick(queued[:3], quotas, fill=True, fits=lambda _: True)
    assert pick is not None and [g.uid for g in pick] == ["g0", "g1", "g2"]
    assert mix_shortfall(pick, quotas) == 1


# -- the real link, real senders --------------------------------------------------------------------
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def source_batch(tag: str, source: str, version: int = 0) -> list[Trajectory]:
    """One group of two trajectories of ``source``."""
    out = [traj(f"{tag}-{i}", tag, version=version, seed=i) for i in range(2)]
    for t in out:
        t.data_source = source
    return out


MIX = {"math": 0.4, "qa": 0.3, "code": 0.3}  # 4/3/3 of 10


@pytest.mark.anyio
async def test_intake_steps_hold_the_exact_mix_whatever_the_arrival_order(
    tiny_model: Path, tmp_path: Path
) -> None:
    link = LearnerLink(make_config(tiny_model, buffer_batches=64, credits=64), tmp_path)
    link.intake.configure_mix(MIX, wait_s=30.0)
    rng = np.random.default_rng(0)
    # three steps' worth, 12/9/9, sent in clumps: all of math first, then the rest shuffled
    plan = ["math"] * 12 + list(rng.permutation(["qa"] * 9 + ["code"] * 9))
    async with serving(link) as address, sending(address, tiny_model, token=link.token) as s:
        for i, src in enumerate(plan):
            await s.client.submit(source_batch(f"b{i}", src))
        steps: list[Any] = []
        for _ in range(3):
            taken = await link.intake.next_batch(10, policy_version=0, max_staleness=4)
            steps.append(taken)
            link.intake.mark_trained(taken)
    for taken in steps:
        assert {src: taken.sources.count(src) for src in MIX} == {"math": 4, "qa": 3, "code": 3}
        assert taken.mix_shortfall == 0 and taken.mix == {"math": 4, "qa": 3, "code": 3}
        assert len(taken.trajectories) == 20 and taken.wait_s < 30.0
        assert all(
            t.data_source == src
            for t, src in zip(taken.trajectories[::2], taken.sources, strict=True)
        )
    # arrival order within a source (all version 0: equal deadlines)
    assert [
        int(u[1:])
        for u, s in zip(steps[0].group_uids, steps[0].sources, strict=True)
        if s == "math"
    ] == [
        0,
        1,
        2,
        3,
    ]


@pytest.mark.anyio
async def test_a_missing_source_delays_a_step_at_most_mix_wait_s(
    tiny_model: Path, tmp_path: Path
) -> None:
    wait_s = 1.0
    link = LearnerLink(make_config(tiny_model, buffer_batches=64, credits=64), tmp_path)
    link.intake.configure_mix(MIX, wait_s=wait_s)
    async with serving(link) as address, sending(address, tiny_model, token=link.token) as s:
        for i, src in enumerate(["math"] * 6 + ["qa"] * 6):  # no code at all
            await s.client.submit(source_batch(f"b{i}", src))
        await until_buffered(link, 12)
        t0 = time.monotonic()
        taken = await link.intake.next_batch(10, policy_version=0, max_staleness=4)
        elapsed = time.monotonic() - t0
        link.intake.mark_trained(taken)
        # waited for code, and no longer than the bound
        assert wait_s * 0.9 <= elapsed < wait_s + 2.0
        assert taken.mix_shortfall == 3 and len(taken.group_uids) == 10
        assert taken.sources.count("math") >= 4 and taken.sources.count("qa") >= 3
        # code arrives late: the next step has it again, in the exact mix
        for i in range(3):
            await s.client.submit(source_batch(f"c{i}", "code"))
        for i in range(5):
            await s.client.submit(source_batch(f"d{i}", "math" if i < 4 else "qa"))
        taken = await link.intake.next_batch(10, policy_version=0, max_staleness=4)
        assert taken.mix_shortfall == 0 and taken.wait_s < wait_s
        assert {src: taken.sources.count(src) for src in MIX} == {"math": 4, "qa": 3, "code": 3}


@pytest.mark.anyio
async def test_a_group_due_now_is_trained_even_beyond_its_source_count(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Five math groups of version 0 at version 1 with max_staleness 1: all due now. The mix wants
    only four; the fifth takes the place of a fresher group instead of being dropped."""
    link = LearnerLink(make_config(tiny_model, buffer_batches=64, credits=64), tmp_path)
    link.intake.configure_mix(MIX, wait_s=30.0)
    async with serving(link) as address, sending(address, tiny_model, token=link.token) as s:
        for i in range(5):
            await s.client.submit(source_batch(f"old{i}", "math", version=0))
        for i, src in enumerate(["math"] * 4 + ["qa"] * 3 + ["code"] * 3):
            await s.client.submit(source_batch(f"new{i}", src, version=1))
        await until_buffered(link, 15)
        taken = await link.intake.next_batch(10, policy_version=1, max_staleness=1)
        assert sum(u.startswith("old") for u in taken.group_uids) == 5
        assert taken.mix_shortfall == 1 and taken.dropped_stale == 0


async def until_buffered(link: LearnerLink, n: int, timeout: float = 10.0) -> None:
    import anyio

    with anyio.fail_after(timeout):
        while link.stats["buffered_groups"] < n:
            await anyio.sleep(0.01)


# -- a whole run under admission, mixed ---------------------------------------------------------------
def simulate_mixed(
    seed: int,
    ratios: list[int],
    batch: int,
    k: int,
    steps: int,
    n_servers: int,
    wait_ticks: int,
    chunk: int,
) -> list[int]:
    """``tests/learner/test_admission.py``'s discrete-time run (grants, heavy-tailed generation,
    versions reaching servers late), with prompts from each server's share of an exact-mix schedule
    (whole batches dealt round-robin, shuffled inside) and steps chosen by ``mixed_pick``: the step
    waits ``wait_ticks`` for a missing source once it could otherwise go, or not at all when
    nothing is generating; grants go to servers in runs of ``chunk``. Checks the admission
    guarantees; returns each step's shortfall."""
    import random

    from learner.admission import Admission
    from learner.buffer import GroupBuffer

    rng = random.Random(seed)
    quotas = quotas_of(ratios, batch)
    adm, buf = Admission(batch, k, chunk=chunk), GroupBuffer()
    names = [f"s{i}" for i in range(n_servers)]
    slots = {s: rng.randint(1, 2 * batch) for s in names}
    lag = {s: rng.randint(0, 4) for s in names}
    loaded = dict.fromkeys(names, 0)
    pending: dict[str, list[tuple[int, int]]] = {s: [] for s in names}
    grants: dict[str, dict[int, int]] = {s: {} for s in names}
    running: dict[str, list[tuple[str, str, list[int], list[int]]]] = {s: [] for s in names}
    prompts: dict[str, list[str]] = {s: [] for s in names}  # each server's schedule, in order
    for b in range((steps + 1) * n_servers):  # any server may run every group of the run
        mix = [s for s, q in quotas.items() for _ in range(q)]
        rng.shuffle(mix)
        prompts[names[b % n_servers]] += mix
    for s in names:
        adm.joined(s, slots[s])
    remaining, version, uid, record = steps * batch, 0, 0, 0
    training: tuple[int, list[Group]] | None = None
    ready_since: int | None = None
    shortfalls: list[int] = []

    def grant() -> None:
        for name, n in adm.grants(
            held=len(buf) + buf.in_flight, remaining=remaining, min_version=version
        ):
            grants[name][version] = grants[name].get(version, 0) + n

    def fits(left: list[Group]) -> bool:
        d = [g.oldest_version + k for g in left if g.oldest_version is not None]
        return not any(x <= version for x in d) and adm.can_take(d, version)

    grant()
    for tick in range(100_000):
        for s in names:
            while pending[s] and pending[s][0][0] <= tick:
                loaded[s] = pending[s].pop(0)[1]
            usable = sorted(m for m, n in grants[s].items() if n and m <= loaded[s])
            while usable and len(running[s]) < slots[s]:
                m = usable[0]
                grants[s][m] -= 1
                if not grants[s][m]:
                    usable.pop(0)
                length = min(400, max(1, int(rng.lognormvariate(2.0, 1.2))))
                running[s].append((f"g{uid}", prompts[s].pop(0), [length], []))
                uid += 1
            for g in list(running[s]):
                g[3].append(loaded[s])
                g[2][0] -= 1
                if not g[2][0]:
                    running[s].remove(g)
                    record += 1
                    n = len(g[3])
                    t = Trajectory(
                        f"{g[0]}-0",
                        g[0],
                        np.zeros(2, np.int32),
                        np.zeros(n, np.int32),
                        np.ones(n, np.uint8),
                        np.zeros(n, np.float32),
                        np.array(g[3], np.int32),
                        data_source=g[1],
                    )
                    added = buf.add(record, [t])
                    assert adm.received(s, added[0].oldest_version)
                    grant()
        if training is not None and training[0] <= tick:
            version += 1
            for s in names:
                pending[s].append((tick + lag[s], version))
            buf.finish([g.key for g in training[1]])
            remaining -= batch
            training = None
            grant()
        if training is None and len(shortfalls) < steps and len(buf) >= batch:
            left = [g.oldest_version + k for g in buf.by_deadline()[batch:]]
            if adm.can_take(left, version):
                ready_since = tick if ready_since is None else ready_since
                fill = tick - ready_since >= wait_ticks or not adm.generating
                pick = mixed_pick(buf.by_deadline(), quotas, fill=fill, fits=fits)
                if pick is not None:
                    assert not buf.drop_stale(version, k).dropped, f"tick {tick}: stale groups"
                    taken = buf.take_these(pick)
                    assert len(taken) == batch
                    for g in taken:
                        assert version - g.oldest_version <= k  # the per-token bound
                    shortfalls.append(mix_shortfall(taken, quotas))
                    training = (tick + rng.randint(1, 30), taken)
                    ready_since = None
        if len(shortfalls) == steps and training is None:
            break
    else:
        raise AssertionError(f"deadlock: {len(shortfalls)} of {steps} steps")
    assert buf.dropped_stale == 0
    assert uid == steps * batch, "groups were generated beyond what the run trains"
    return shortfalls


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    mix=mixes,
    k=st.integers(0, 3),
    steps=st.integers(1, 6),
    n_servers=st.integers(1, 3),
    wait_ticks=st.sampled_from([0, 10, 10**9]),
)
def test_mixed_steps_keep_admissions_guarantees(
    seed: int,
    mix: tuple[list[int], int],
    k: int,
    steps: int,
    n_servers: int,
    wait_ticks: int,
) -> None:
    """Mixing under admission: nothing dropped or generated beyond the run, no token too stale, no
    deadlock, whatever the wait. Grants go in whole batches (``chunk``) while the window holds one
    per server, so then, with ``max_staleness <= 1`` and the mix waited for, every step is the exact
    mix."""
    ratios, batch = mix
    shortfalls = simulate_mixed(seed, ratios, batch, k, steps, n_servers, wait_ticks, batch)
    whole = k + 1 >= n_servers  # the window holds a whole batch per server: grants in batches
    if whole and k <= 1 and wait_ticks == 10**9:
        assert shortfalls == [0] * steps
    if whole and k == 0:  # synchronous: every window is one whole schedule batch
        assert shortfalls == [0] * steps


def test_grants_without_chunks_split_schedule_batches() -> None:
    """Why grants come in whole batches: dealt one at a time over two servers, what arrives is
    parts of several servers' batches, and steps fall short of the mix although no deadline forces it."""
    shortfalls = [
        sum(simulate_mixed(seed, [4, 3, 3], 10, 1, 6, 2, 10**9, chunk=1)) for seed in range(5)
    ]
    assert sum(shortfalls) > 0
    assert not any(
        sum(simulate_mixed(seed, [4, 3, 3], 10, 1, 6, 2, 10**9, chunk=10)) for seed in range(5)
    )


def test_chunked_grants_start_whole_batches_per_server() -> None:
    from learner.admission import Admission

    a = Admission(batch_groups=4, max_staleness=1, chunk=4)
    a.joined("a", slots=3)
    a.joined("b")
    # a's batch is started within its slots, the rest of it kept for it; b gets a whole one
    assert sorted(a.grants(held=0, remaining=100, min_version=0)) == [("a", 3), ("b", 4)]
    a.received("a", 0)
    assert a.grants(held=1, remaining=100, min_version=0) == [("a", 1)]  # a finishes its batch
    assert a.left("b") == 4
    assert a.grants(held=1, remaining=100, min_version=0) == []  # a is at its slots
    a.received("a", 0)
    a.received("a", 0)
    assert a.grants(held=3, remaining=100, min_version=0) == [("a", 2)]  # a new one, in part
    a.received("a", 0)
    assert a.grants(held=4, remaining=100, min_version=0) == [("a", 1)]  # more as slots free up
    assert a.grants(held=5, remaining=100, min_version=0) == []  # the window (8) is full
    a = Admission(batch_groups=4, max_staleness=0, chunk=4)
    a.joined("a")
    assert a.grants(held=1, remaining=100, min_version=0) == [("a", 3)]  # fewer free: a part
    a.joined("b")  # the window (4) holds no batch per server: one at a time, as without a mix
    assert a.grants(held=0, remaining=100, min_version=0) == [("b", 1)]
