"""Admission end to end: the learner's real intake (ZeroMQ on loopback, journal, protocol 1.3
grants) and a real rollout server (real tokenizer, tools and shipping) whose scripted engine samples
token by token, stamping each token with the weights loaded at that moment, so weight updates land
in the middle of long generations exactly as vLLM's partial rollouts do. A small loop plays the
trainer: take a batch, "train" for a while, publish the next version, mark the batch trained.

What must hold, for a workload of long and short episodes:
- nothing generated is wasted: no group dropped as stale, on either side, and no group generated
  beyond what the run trains;
- the per-token bound: no trained token is more than ``max_staleness`` versions older than the
  policy that trains it, although episodes straddle updates (partial rollouts really happen);
- ``max_staleness: 0`` is a synchronous trainer: each version generates exactly one batch, every
  token of it on that version.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from scripted import ScriptedEngine
from server_testkit import make_config

from protocol.reference import reference_weights

pytestmark = pytest.mark.anyio

B, N, STEPS = 4, 2, 6  # groups per step, episodes per group, steps


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # zmq.asyncio


def long_or_short(episode: str) -> list[str]:
    """One in three episodes answers at length (a long tail), the others briefly."""
    if zlib.crc32(episode.encode()) % 3 == 0:
        return ["the answer, after a long and winding derivation that goes on and on, is 42 " * 3]
    return ["42"]


async def play_trainer(link: Any, max_staleness: int, train_s: float) -> list[tuple[int, Any]]:
    steps = []
    for version in range(STEPS):
        taken = await link.intake.next_batch(B, version, max_staleness)
        steps.append((version, taken))
        await anyio.sleep(train_s)  # the update; generation goes on meanwhile
        link.weights.announce(version + 1, reference_weights(seed=version + 1))
        link.intake.mark_trained(taken)
    return steps


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
async def test_admission_wastes_nothing_and_bounds_every_token(
    tmp_path: Path, tiny_model: Path, echo_tool: Any, max_staleness: int
) -> None:
    from transformers import AutoTokenizer

    from learner.link import LearnerLink
    from rollout_service.server import RolloutServer

    config = make_config(
        tmp_path,
        tiny_model,
        "tcp://127.0.0.1:0",
        **{
            "learner.bind_address": "tcp://127.0.0.1:0",
            "transport.auth": "token",  # the real link, as a run has it
            "actor_rollout_ref.rollout.n": N,
            "actor_rollout_ref.rollout.max_staleness": max_staleness,
            "actor_rollout_ref.rollout.on_weight_update": "abort",
            "data.train_batch_size": B,
            "data.train_files": str(_data(tmp_path / "train.jsonl", 64)),
            "learner.weights_file_dir": None,
        },
    )
    link = LearnerLink(config, tmp_path / "learner", fresh=True)
    link.weights.announce(0, reference_weights(seed=0))
    link.admission.configure(B, max_staleness, STEPS * B)
    config.rollout_server.learner_address = link.address
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(str(tiny_model)), [])
    engine.per_request, engine.token_s = long_or_short, 0.004
    server = RolloutServer(config, tmp_path / "run", engine=engine)
    async with anyio.create_task_group() as tg:
        await tg.start(link.run)
        tg.start_soon(server.run)
        with anyio.fail_after(90):
            steps = await play_trainer(link, max_staleness, train_s=0.15)
        waste = link.intake.waste_metrics()
        await anyio.sleep(0.5)  # anything generated beyond the run would arrive now
        stats = link.stats
        link.close()
        tg.cancel_scope.cancel()

    assert stats["dropped_stale_groups"] == 0 and server.stats.counters.staleness_drops == 0
    assert waste["rollout/waste_frac"] == 0.0 and waste["rollout/generated_tokens"] > 0
    assert stats["trajectories"] == STEPS * B * N, (
        "groups were generated beyond what the run trains"
    )
    straddled = 0
    for version, taken in steps:
        assert len(taken.group_uids) == B
        for t in taken.trajectories:
            sampled = t.versions[np.asarray(t.response_mask) == 1]
            assert version - int(sampled.min()) <= max_staleness, (version, sampled)
            assert int(sampled.max()) <= version
            straddled += len(set(sampled.tolist())) > 1
            if max_staleness == 0:
                assert set(sampled.tolist()) == {version}
    if max_staleness:
        assert straddled, "no episode was interrupted by a weight update: partial rollouts untested"


async def test_a_refused_batchs_grants_go_to_other_prompts(
    tmp_path: Path, tiny_model: Path, echo_tool: Any
) -> None:
    """The learner refuses a batch (a logprob above 0 in one episode): it still counts that batch's
    grants as generating, so a synchronous run would wait for them forever. The server holds them
    again and starts other prompts on them, and every step is trained."""
    from transformers import AutoTokenizer

    from learner.link import LearnerLink
    from rollout_service.server import RolloutServer

    class OneBadEpisode(ScriptedEngine):
        bad = 1

        async def generate(self, request_id: str, prompt_ids: Any, sampling: Any) -> Any:
            gen = await super().generate(request_id, prompt_ids, sampling)
            if self.bad:
                self.bad -= 1
                gen.logprobs[0] = 0.5
            return gen

    config = make_config(
        tmp_path,
        tiny_model,
        "tcp://127.0.0.1:0",
        **{
            "learner.bind_address": "tcp://127.0.0.1:0",
            "actor_rollout_ref.rollout.n": N,
            "actor_rollout_ref.rollout.max_staleness": 0,
            "data.train_batch_size": B,
            "data.train_files": str(_data(tmp_path / "train.jsonl", 64)),
            "learner.weights_file_dir": None,
        },
    )
    link = LearnerLink(config, tmp_path / "learner", fresh=True)
    link.weights.announce(0, reference_weights(seed=0))
    link.admission.configure(B, 0, STEPS * B)
    config.rollout_server.learner_address = link.address
    engine = OneBadEpisode(AutoTokenizer.from_pretrained(str(tiny_model)), ["42"])
    server = RolloutServer(config, tmp_path / "run", engine=engine)
    async with anyio.create_task_group() as tg:
        await tg.start(link.run)
        tg.start_soon(server.run)
        with anyio.fail_after(60):
            steps = await play_trainer(link, 0, train_s=0.05)
        stats = link.stats
        link.close()
        tg.cancel_scope.cancel()

    assert [len(taken.group_uids) for _, taken in steps] == [B] * STEPS
    refused = list((tmp_path / "run").rglob("rejected/*"))
    assert refused and stats["trajectories"] == STEPS * B * N  # none of the refused batch


def _data(path: Path, n: int) -> Path:
    import json

    path.write_text(
        "".join(
            json.dumps({"question": f"what is {i}*6?", "answer": str(6 * i)}) + "\n"
            for i in range(n)
        )
    )
    return path
