"""Exact mixed batches end to end: the learner's real intake (ZeroMQ, journal, admission grants,
``configure_mix``) and a real rollout server running a three-source mix (``data.datasets``, 4/3/3 of
10) on a scripted engine whose episodes are long or short at random, so groups of different
sources arrive out of their schedule's order (with ``max_staleness: 1`` the learner's steps taken in
arrival order were 3/3/4 and 5/3/2 here), also with two servers sharing the data at different
speeds (grants then go in whole batches, ``learner.admission``). Every step the learner takes must hold exactly the
configured groups per source, with nothing dropped and no shortfall. With ``max_staleness <= 1`` no
deadline can force a swap: a step at version ``w`` finds due only groups granted by version
``w - 1``, whole schedule batches, and the earlier steps took exactly each source's count of those.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import anyio
import pytest
from scripted import ScriptedEngine
from server_testkit import make_config

from protocol.reference import reference_weights

pytestmark = pytest.mark.anyio

B, N, STEPS = 10, 2, 5
MIX = {"math": 0.4, "qa": 0.3, "code": 0.3}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # zmq.asyncio


def long_or_short(episode: str) -> list[str]:
    """One in three episodes answers at length (a long tail), the others briefly."""
    if zlib.crc32(episode.encode()) % 3 == 0:
        return ["the answer, after a long and winding derivation that goes on and on, is 42 " * 3]
    return ["42"]


def _source(path: Path, name: str, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"question": f"{name}: what is {i}*6?", "answer": str(6 * i)}) + "\n"
            for i in range(n)
        )
    )
    return path


@pytest.mark.parametrize(("max_staleness", "n_servers"), [(0, 1), (1, 1), (1, 2)])
async def test_every_learner_step_holds_the_exact_mix(
    tmp_path: Path, tiny_model: Path, echo_tool: Any, max_staleness: int, n_servers: int
) -> None:
    from transformers import AutoTokenizer

    from learner.link import LearnerLink
    from rollout_service.server import RolloutServer

    datasets = [
        {"name": name, "path": [str(_source(tmp_path / f"{name}.jsonl", name, 40))], "ratio": r}
        for name, r in MIX.items()
    ]
    configs = [
        make_config(
            tmp_path,
            tiny_model,
            "tcp://127.0.0.1:0",
            **{
                "learner.bind_address": "tcp://127.0.0.1:0",
                "transport.auth": "token",  # the real link, as a run has it
                "actor_rollout_ref.rollout.n": N,
                "actor_rollout_ref.rollout.max_staleness": max_staleness,
                "data.train_batch_size": B,
                "actor_rollout_ref.actor.ppo_mini_batch_size": B * N,
                "data.train_files": [],
                "data.datasets": datasets,
                "learner.weights_file_dir": None,
                "rollout_server.server_id": f"rs-{i}",
                "rollout_server.shard_index": i,
                "rollout_server.shard_count": n_servers,
            },
        )
        for i in range(n_servers)
    ]
    config = configs[0]
    link = LearnerLink(config, tmp_path / "learner", fresh=True)
    link.weights.announce(0, reference_weights(seed=0))
    link.admission.configure(B, max_staleness, STEPS * B)
    link.intake.configure_mix({d.name: d.ratio for d in config.data.datasets}, wait_s=60.0)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    servers = []
    for i, c in enumerate(configs):
        c.rollout_server.learner_address = link.address
        engine = ScriptedEngine(tokenizer, [])
        engine.per_request, engine.token_s = long_or_short, 0.004 * (i + 1)  # unequal speeds
        servers.append(RolloutServer(c, tmp_path / f"run{i}", engine=engine))
    steps = []
    async with anyio.create_task_group() as tg:
        await tg.start(link.run)
        for server in servers:
            tg.start_soon(server.run)
        with anyio.fail_after(120):
            for version in range(STEPS):
                taken = await link.intake.next_batch(B, version, max_staleness)
                steps.append(taken)
                await anyio.sleep(0.1)
                link.weights.announce(version + 1, reference_weights(seed=version + 1))
                link.intake.mark_trained(taken)
        stats = link.stats
        link.close()
        tg.cancel_scope.cancel()

    assert stats["dropped_stale_groups"] == 0
    for taken in steps:
        counts = {s: taken.sources.count(s) for s in MIX}
        assert counts == {"math": 4, "qa": 3, "code": 3}, counts
        assert taken.mix_shortfall == 0 and taken.wait_s < 60.0
        assert {t.data_source for t in taken.trajectories} <= set(MIX)
