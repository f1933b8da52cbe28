"""bench/_placement.py: the --placement syntax, what it refuses (and why, in words), the default vLLM
shares, the bin/train overrides on a GPU and on the CPU, and bench/e2e.py's --gpus shorthands and
checks of a placement against the machine and the overrides."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import _placement as pl  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
import e2e  # noqa: E402


def test_four_gpus_two_learner_ranks_two_servers() -> None:
    p = pl.parse("learner=0,1;rollout=2;rollout=3")
    assert p.learner == (0, 1) and [s.gpus for s in p.servers] == [(2,), (3,)]
    assert p.gpus == [0, 1, 2, 3] and not p.colocated and p.slug == "l0-1_r2_r3"
    assert p.fractions() == [pl.OWN_FRACTION, pl.OWN_FRACTION]
    assert p.overrides("cuda") == [
        "trainer.n_gpus_per_node=2",
        "launch.rollout_servers=2",
        "launch.learner_gpus=[0,1]",
        "launch.rollout_gpus=[[2],[3]]",
        "launch.rollout_gpu_memory_utilization=[0.8,0.8]",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    ]
    # on the CPU the same string rehearses the shape: 2 gloo ranks, 2 rollout servers
    assert p.overrides("cpu") == ["trainer.n_gpus_per_node=2", "launch.rollout_servers=2"]
    assert p.describe() == (
        "learner on GPUs 0,1 (2 ranks); rollout rs0 on GPU 2 (vLLM 0.8), rs1 on GPU 3 (vLLM 0.8); "
        "split"
    )
    j = p.as_json()
    assert j["spec"] == "learner=0,1;rollout=2;rollout=3" and j["learner_ranks"] == 2
    assert j["rollout_gpus"] == [[2], [3]] and j["colocated"] is False


def test_default_shares_follow_the_learner_and_the_crowd() -> None:
    shared = pl.parse("learner=0;rollout=0")  # --gpus 1
    assert shared.colocated and shared.fractions() == [pl.SHARED_FRACTION]
    extra = pl.parse("learner=0;rollout=0;rollout=1")  # a second server on the learner's GPU
    assert extra.colocated and extra.fractions() == [pl.SHARED_FRACTION, pl.OWN_FRACTION]
    assert "launch.rollout_gpu_memory_utilization=[0.35,0.8]" in extra.overrides("cuda")
    two_on_one = pl.parse("learner=0;rollout=1;rollout=1")  # two servers share GPU 1
    assert two_on_one.fractions() == [pl.OWN_FRACTION / 2] * 2
    own = pl.parse(" learner = 0 ; rollout = 0@0.25 ; rollout = 1@0.9 ")
    assert own.fractions() == [0.25, 0.9] and own.spec == "learner=0;rollout=0@0.25;rollout=1@0.9"
    assert pl.parse(own.spec) == own  # the spec parses back to the same placement
    assert own.slug == "l0_r0at0.25_r1at0.9"
    tp2 = pl.parse("learner=0;rollout=1,2;rollout=3,4")
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=2" in tp2.overrides("cuda")


@pytest.mark.parametrize(
    "text, words",
    [
        ("learner=0", "no rollout=GPUS entry"),
        ("rollout=1", "no learner=GPUS entry"),
        ("learner=0;learner=1;rollout=2", "one learner entry only"),
        ("learner=0;gpu=1", "each entry is learner=GPUS or rollout=GPUS[@FRACTION]"),
        ("learner=0;rollout=", "each entry is"),
        ("learner=0;rollout=x", "comma-separated CUDA ordinals (got 'x')"),
        ("learner=-1;rollout=1", "a GPU ordinal is >= 0"),
        ("learner=0,0;rollout=1", "names a GPU twice"),
        ("learner=0;rollout=1@half", "@FRACTION is a number"),
        ("learner=0;rollout=1@1.5", "in (0, 1)"),
        ("learner=0;rollout=1;rollout=2,3", "as many GPUs (its tensor parallelism; got [1, 2])"),
        (
            "learner=0;rollout=0@0.5;rollout=0@0.4",
            "GPU 0: the rollout servers ask vLLM for rs0 0.5 + rs1 0.4",
        ),
        (
            "learner=0;rollout=1@0.6;rollout=1@0.6",
            "GPU 1: the rollout servers ask vLLM for rs0 0.6 + rs1 0.6",
        ),
    ],
)
def test_refusals_name_the_fault(text: str, words: str) -> None:
    with pytest.raises(pl.PlacementError) as exc:
        pl.parse(text)
    assert words in str(exc.value)


def test_gpus_the_machine_lacks_and_contradicting_overrides() -> None:
    p = pl.parse("learner=0,1;rollout=2;rollout=3")
    pl.check_gpus(p, 4)
    with pytest.raises(pl.PlacementError, match="names GPU 2, 3: this machine has GPUs 0-1"):
        pl.check_gpus(p, 2)
    with pytest.raises(pl.PlacementError, match="this machine has no GPU"):
        pl.check_gpus(pl.parse("learner=0;rollout=0"), 0)
    mine = [
        "launch.rollout_servers=3",
        "trainer.seed=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
    ]
    assert pl.conflicts(p, mine, "cuda") == [mine[0], mine[2]]
    assert pl.conflicts(p, mine, "cpu") == [mine[0]]  # the CPU's vLLM share is not the placement's
    with pytest.raises(pl.PlacementError, match="set what the placement decides"):
        e2e.check_placement(p, mine, "cpu")
    e2e.check_placement(p, ["trainer.seed=1"], "cpu")  # no GPU to count on the CPU


def test_e2e_arguments_take_a_placement_or_a_shorthand() -> None:
    assert e2e.parse_args([]).placement == pl.parse("learner=0;rollout=0")
    assert e2e.parse_args(["--gpus", "2"]).placement.spec == "learner=0;rollout=1"
    a = e2e.parse_args(["--placement", "learner=0,1;rollout=2;rollout=3", "--repeats", "3"])
    assert a.placement.learner == (0, 1) and a.repeats == 3
    for bad in (
        ["--gpus", "2", "--placement", "learner=0;rollout=1"],  # one or the other
        ["--placement", "learner=0"],
        ["--repeats", "0"],
        ["--min-probe", "2"],
    ):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)


def test_simulate_reads_the_servers_of_a_placement() -> None:
    from bench import simulate

    two = pl.parse("learner=0;rollout=0;rollout=1").as_json()
    d = {"config": "/x/configs/longtail_e2e.yaml", "device": "cuda", "placement": two}
    assert simulate.run_settings(d)["servers"] == 2
    older = {"config": d["config"], "device": "cuda", "overrides": ["launch.rollout_servers=3"]}
    assert simulate.run_settings(older)["servers"] == 3
