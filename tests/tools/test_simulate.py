"""bench/simulate.py: the simulator drives the project's own policy code (admission, the buffer's
stale drops, the rollout server's admission rule), the policy's knobs move its predictions the way
the policy says, and the validation table comes from the committed bench JSON."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import simulate  # noqa: E402
from bench.clustersim import model  # noqa: E402
from bench.clustersim.costs import GPU_DIR, GenCosts, e2e_runs, rollout_bound  # noqa: E402
from learner.admission import Admission  # noqa: E402
from rollout_service import server  # noqa: E402
from rollout_service.granting import GrantBook  # noqa: E402

H100 = GPU_DIR / "h100_bench_e2e_longtail_20steps_s0_s2.json"


def _setup(k: int, *, servers: int = 2, admission: bool = True, steps: int = 6) -> model.Setup:
    run = e2e_runs(H100)[0]
    gen = GenCosts(0.005, rollout_bound(GPU_DIR / "h200_bench_rollout.json"), 1.0)
    return replace(
        simulate.setup_for(run, servers, gen),
        max_staleness=k,
        steps=steps,
        admission=admission,
        shared_gpu=False,
    )


def test_the_rollout_server_rule_is_the_servers_own_grant_book(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert model.GrantBook is server.GrantBook is GrantBook
    calls = {"may_admit": 0, "start": 0}
    may_admit, start = GrantBook.may_admit, GrantBook.start

    def counting_may_admit(self: GrantBook, n: int, engine_version: int) -> bool:
        calls["may_admit"] += 1
        return may_admit(self, n, engine_version)

    def counting_start(self: GrantBook, n: int, engine_version: int) -> None:
        calls["start"] += 1
        start(self, n, engine_version)

    monkeypatch.setattr(GrantBook, "may_admit", counting_may_admit)
    monkeypatch.setattr(GrantBook, "start", counting_start)
    model.simulate(_setup(1, steps=3), seeds=1)
    assert calls["may_admit"] > calls["start"] > 0


def test_grants_and_feasibility_go_through_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"grants": 0, "can_take": 0}
    grants, can_take = Admission.grants, Admission.can_take

    def counting_grants(self: Admission, **kw: int) -> list[tuple[str, int]]:
        calls["grants"] += 1
        return grants(self, **kw)

    def counting_can_take(self: Admission, left: list[int], version: int) -> bool:
        calls["can_take"] += 1
        return can_take(self, left, version)

    monkeypatch.setattr(Admission, "grants", counting_grants)
    monkeypatch.setattr(Admission, "can_take", counting_can_take)
    model.simulate(_setup(1, steps=3), seeds=1)
    assert calls["grants"] > 0 and calls["can_take"] > 0


def test_max_staleness_moves_staleness_and_step_time_as_the_policy_says() -> None:
    sync = model.simulate(_setup(0), seeds=2)
    async2 = model.simulate(_setup(2), seeds=2)
    # sync is one batch per version on the newest weights; async overlaps generation with updates
    assert sync.staleness_max == 0 and sync.staleness_mean == 0
    assert 0 < async2.staleness_mean <= 2 and async2.staleness_max == 2
    assert sync.step_s > async2.step_s
    assert sync.wait_s > async2.wait_s
    # admission grants only what can be trained in time: nothing generated is wasted
    assert sync.waste_frac == 0 and async2.waste_frac == 0


def test_without_admission_servers_generate_ahead_and_stale_groups_are_wasted() -> None:
    free = model.simulate(_setup(0, admission=False, steps=3), seeds=1)
    assert free.waste_frac > 0  # the server's stale() and the buffer's drop_stale throw work away


def test_validation_table_comes_from_the_json_files() -> None:
    bound = rollout_bound(GPU_DIR / "h200_bench_rollout.json", 358356864)
    calib = simulate.Calibration(
        "NVIDIA H100 80GB HBM3 (one shared GPU)", 0.007, bound, 1.0, "test"
    )
    rows = simulate.validate([H100], {calib.machine: calib}, lambda _d: bound, seeds=1)
    assert [r["run"] for r in rows] == [
        "h100_bench_e2e_longtail_20steps_s0_s2:sync",
        "h100_bench_e2e_longtail_20steps_s0_s2:async-s2",
    ]
    assert [r["measured_step_s"] for r in rows] == [6.694, 3.844]  # the JSON's means
    for r in rows:
        assert r["role"] == "validation"
        assert r["predicted_step_s"] > 0
        expected = 100 * (r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"]
        assert r["error_pct"] == pytest.approx(expected, abs=0.2)
    assert "sync" in simulate.table(rows)


def test_at_1_plus_1_a_step_waits_exactly_for_the_groups_started_k_versions_before() -> None:
    """bench/sim_waits.py's explanation of the async waits on 2 H200s: the step of version V
    waits only for the last group started on V - k (it must train it), and exactly as long as
    that group arrives after V is published. The faster learner of issue 34 makes it wait."""
    from bench import sim_waits

    base, _tokens = sim_waits.base_setup(tau0_s=0.00463, prepare_s=0.45, update_s=0.85)
    k = 2
    sim = model.Simulation(replace(base, max_staleness=k, steps=20), seed=0).run()
    waits = [r.wait_s for r in sim.learner.steps][sim_waits.settled(k) :]
    late = sim_waits.lateness(sim)[sim_waits.settled(k) :]
    assert sum(w > 1.0 for w in waits) >= 3  # it does wait, and long
    assert waits == pytest.approx(late, abs=1e-9)
    s = model.summarize([sim])
    assert s.staleness_max == k and s.waste_frac == 0


def test_a_first_mini_batch_in_the_wait_shortens_the_waited_steps_and_wastes_nothing() -> None:
    """The learner of the 1+1 H200 run with ``early_update`` (learner/early_update.py's own rule
    says when the buffer fixes the first mini-batch): a step that waited spends less after its
    wait, so the mean step is shorter; the staleness bound and zero waste hold."""
    from bench import sim_waits

    base, _tokens = sim_waits.base_setup(tau0_s=0.00463, prepare_s=0.45, update_s=0.85)
    k = 2
    plain = model.Simulation(replace(base, max_staleness=k, steps=20), seed=0).run()
    early = model.Simulation(
        replace(base, max_staleness=k, steps=20, early_update=True), seed=0
    ).run()
    p, e = model.summarize([plain]), model.summarize([early])
    assert e.step_s < p.step_s
    assert e.staleness_max <= k and e.waste_frac == 0

    # after a long wait the learner's own time is shorter by the held mini-batch's
    def learn_after_waits(sim: model.Simulation) -> float:
        waited = [r.learn_s for r in sim.learner.steps[sim_waits.settled(k) :] if r.wait_s > 1.0]
        assert waited
        return sum(waited) / len(waited)

    assert learn_after_waits(early) < 0.8 * learn_after_waits(plain)
