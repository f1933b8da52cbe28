"""The simulator's inputs, read from the JSON that the benches wrote (``docs/gpu/*.json``).

Nothing here is a step time. Each figure is a cost that a bench measured:

- episode lengths: the ``lengths.all`` quantiles of a ``bench/e2e.py`` run (median, p90, p99 and
  max of turns, model tokens and response tokens per episode). They come from the recordings.
- learner costs: the learner's own timers in that run, per token of the batch. ``prepare_s`` is
  divided by the tokens of a step, ``perf/update_tokens_per_s`` is taken as is, and the publish time
  is ``weights/publish_s``. The tokens of a step are ``update_tokens_per_s * update_s``, both
  learner timers, with one PPO epoch.
- weight hand-over: ``weights/applied_s`` is the time from the gather to the engine generating with
  the new version. ``weights/apply_s`` is the part during which the engine is paused.
- generation: the bound at high concurrency is ``bench/rollout.py``'s engine tok/s at its
  concurrency (``h200_bench_rollout.json``). The latency of one decode step at low concurrency
  (``tau0``) has no bench of its own for this model, so ``calibrate_tau0`` derives it from the
  sync wait of a calibration run. That run is never one of the runs the table validates against.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
GPU_DIR = ROOT / "docs" / "gpu"


@dataclass(frozen=True)
class Quantiles:
    """Per-episode quantiles of one length: median, p90, p99 and max over ``episodes`` episodes."""

    median: float
    p90: float
    p99: float
    max: float
    episodes: int

    @classmethod
    def from_json(cls, d: dict[str, Any], episodes: int) -> Quantiles:
        return cls(float(d["median"]), float(d["p90"]), float(d["p99"]), float(d["max"]), episodes)

    def at(self, z: np.ndarray) -> np.ndarray:
        """The value at standard-normal scores ``z``. Below p90 this is a lognormal through the
        median and p90. Above p90 it is log-linear in z through p99 and the max, the max sitting at
        the quantile ``1 - 1/(episodes + 1)``. Nothing is drawn above the max."""
        zs = [0.0, 1.2816, 2.3263, _z(1.0 - 1.0 / (self.episodes + 1))]
        logs = [math.log(max(v, 1e-9)) for v in (self.median, self.p90, self.p99, self.max)]
        sigma = (logs[1] - logs[0]) / zs[1]
        out = np.where(z <= zs[1], logs[0] + sigma * z, np.interp(z, zs[1:], logs[1:]))
        return np.exp(np.minimum(out, logs[3]))

    def mean(self) -> float:
        """The mean of the distribution ``at`` draws from (midpoint rule over 2,000 quantiles)."""
        nd = statistics.NormalDist()
        z = np.array([nd.inv_cdf((i + 0.5) / 2000) for i in range(2000)])
        return float(self.at(z).mean())


def _z(q: float) -> float:
    return statistics.NormalDist().inv_cdf(q)


@dataclass(frozen=True)
class Lengths:
    """One episode's length: ``turns``, ``model_tokens`` (the tokens the engine decodes) and
    ``response_tokens`` (plus the tool output: what the learner trains on). All three are drawn
    from one normal score, so long episodes are long in every sense. ``group_corr`` is the
    correlation of the scores of the ``n`` episodes of one prompt."""

    turns: Quantiles
    model_tokens: Quantiles
    response_tokens: Quantiles
    prompt_tokens: float
    group_corr: float = 0.0

    def draw(self, rng: np.random.Generator, groups: int, n: int) -> np.ndarray:
        """An array of shape (groups, n, 3): the turns, model tokens and response tokens."""
        c = self.group_corr
        z = math.sqrt(c) * rng.standard_normal((groups, 1)) + math.sqrt(
            1 - c
        ) * rng.standard_normal((groups, n))
        turns = np.maximum(1, np.rint(self.turns.at(z)))
        model = np.maximum(turns, np.rint(self.model_tokens.at(z)))
        resp = np.maximum(model, np.rint(self.response_tokens.at(z)))
        return np.stack([turns, model, resp], axis=-1)


@dataclass(frozen=True)
class LearnerCosts:
    prepare_s_per_token: float
    update_tokens_per_s: float  # per learner GPU
    publish_s: float  # the learner's broadcast phase (gather, copy, announce)


@dataclass(frozen=True)
class WeightCosts:
    applied_s: float  # gather to "the engine generates with it"
    apply_s: float  # the engine is paused this long (reload)


@dataclass(frozen=True)
class GenCosts:
    tau0_s: float  # one decode step at concurrency -> 0
    max_tok_s: float  # generated tok/s of one engine at high concurrency (the throughput bound)
    shared_gpu_share: float = 1.0  # the engine's share of the GPU while the learner computes on it
    tool_latency_s: float = 0.0  # per tool call, beyond the per-token cost

    def step_s(self, concurrency: int) -> float:
        """One decode step of ``concurrency`` sequences: a fixed latency plus a per-sequence cost
        that reaches ``max_tok_s`` at high concurrency."""
        return self.tau0_s + concurrency / self.max_tok_s


@dataclass(frozen=True)
class Run:
    """One measured run of bench/e2e.py: what the simulator takes from it, and what it is
    compared with (``measured``: means over the steps after the first)."""

    name: str
    source: str
    max_staleness: int
    steps: int
    batch_groups: int
    n: int
    max_concurrent_episodes: int
    shared_gpu: bool
    lengths: Lengths
    learner: LearnerCosts
    weights: WeightCosts
    measured: dict[str, float]


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object of a bench output: the whole file, or its last line (a summary line and
    then the JSON)."""
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.strip().splitlines()[-1])


def e2e_runs(
    path: Path, *, batch_groups: int = 16, n: int = 8, max_concurrent_episodes: int = 256
) -> list[Run]:
    """The runs of one bench/e2e.py JSON. ``batch_groups``, ``n`` and the concurrency cap are
    configs/longtail_e2e.yaml's, the config those runs used."""
    d = read_json(path)
    shared = d.get("gpus_used", "") == "one shared GPU" or len(d.get("gpus", [])) == 1
    out = []
    for r in d["runs"]:
        m = r["means"]
        lens = r["lengths"]["all"]
        eps = int(lens["episodes"])
        tokens_step = m["perf/update_tokens_per_s"] * m["timing/update_s"]
        per_episode = tokens_step / (batch_groups * n)
        response = Quantiles.from_json(lens["response_tokens"], eps)
        lengths = Lengths(
            turns=Quantiles.from_json(lens["turns"], eps),
            model_tokens=Quantiles.from_json(lens["model_tokens"], eps),
            response_tokens=response,
            # the measured tokens per step on average: the prompt takes what the drawn responses
            # leave (their mean is not exactly response/length_mean)
            prompt_tokens=max(1.0, per_episode - response.mean()),
        )
        w = r["weights"]
        out.append(
            Run(
                name=f"{path.stem}:{r['label']}",
                source=path.name,
                max_staleness=int(r["max_staleness"]),
                steps=int(r["steps_done"]),
                batch_groups=batch_groups,
                n=n,
                max_concurrent_episodes=max_concurrent_episodes,
                shared_gpu=shared,
                lengths=lengths,
                learner=LearnerCosts(
                    prepare_s_per_token=m["timing/prepare_s"] / tokens_step,
                    update_tokens_per_s=m["perf/update_tokens_per_s"],
                    publish_s=w["weights/publish_s"],
                ),
                weights=WeightCosts(applied_s=w["weights/applied_s"], apply_s=w["weights/apply_s"]),
                measured={
                    "step_s": m["timing/step_s"],
                    "wait_s": m["timing/wait_s"],
                    "tokens_per_s": m["perf/tokens_per_s"],
                    "staleness_mean": m.get("staleness/mean", 0.0),
                    "waste_frac": m.get("rollout/waste_frac", 0.0),
                },
            )
        )
    return out


def rollout_bound(path: Path, parameters: int | None = None) -> float:
    """Generated tok/s of the engine at the bench's concurrency (``bench/rollout.py``). With
    ``parameters`` (the simulated run's model), the rate is scaled by the bench model's parameters
    over those: the per-sequence cost of a decode step goes with the weights each token uses."""
    d = read_json(path)
    tok_s = float(d["throughput"]["engine_tok_s"])
    bench_params = next(
        (
            int(v["parameters"])
            for k, v in d.items()
            if k.startswith("update_") and isinstance(v, dict)
        ),
        None,
    )
    if parameters and bench_params:
        tok_s *= bench_params / parameters
    return tok_s


def learner_tok_s(path: Path) -> float:
    """PPO-update tok/s per GPU of ``bench/learner.py`` (its ``update_tok_s`` over ``world``)."""
    d = read_json(path)
    return float(d["update_tok_s"]) / int(d.get("world", 1))


def with_group_corr(run: Run, corr: float) -> Run:
    return replace(run, lengths=replace(run.lengths, group_corr=corr))
