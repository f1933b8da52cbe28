"""The rollout server end to end without vLLM: a scripted engine, the real tokenizer, real tools,
data files, spool and ZeroMQ over TCP loopback to the reference learner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from scripted import ScriptedEngine
from server_testkit import make_config

from protocol.reference import ReferenceLearner


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # zmq.asyncio


async def serve_groups(config: Any, run_dir: Path, engine: Any, groups: int) -> Any:
    from rollout_service.server import RolloutServer

    server = RolloutServer(config, run_dir, engine=engine)
    with anyio.fail_after(60):
        await server.run(max_groups=groups)
    return server


@pytest.mark.anyio
async def test_server_ships_whole_groups_and_commits_prompts(
    tmp_path: Path, tiny_model: Path, echo_tool: Any
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    learner = ReferenceLearner()
    async with anyio.create_task_group() as tg:
        address = await tg.start(learner.serve)
        config = make_config(tmp_path, tiny_model, address)
        call = '<tool_call>{"name": "echo", "arguments": {}}</tool_call>'
        engine = ScriptedEngine(tok, [])
        engine.respond = lambda context: "it is 42" if "<tool_response>" in context else call
        server = await serve_groups(config, tmp_path / "run", engine, groups=3)
        tg.cancel_scope.cancel()
    got = learner.received
    assert len(got) == 6 and len({t.trajectory_id for t in got}) == 6
    groups: dict[str, list] = {}
    for t in got:
        groups.setdefault(t.group_uid, []).append(t)
    assert sorted(len(v) for v in groups.values()) == [2, 2, 2]
    first = got[0]
    assert set(np.unique(first.response_mask)) == {0, 1}  # a tool span was masked out
    assert (
        first.source_server == "rs-test"
        and first.data_source == "arith"
        and first.agent_type == "tool_agent"
    )
    assert server.source.cursor[1] == 3  # the three acknowledged prompts are committed
    assert not list((tmp_path / "run" / "spool").glob("*.msgpack"))  # spool empty once acknowledged


@pytest.mark.anyio
async def test_pushed_weights_reach_the_engine_and_are_acknowledged(
    tmp_path: Path, tiny_model: Path, echo_tool: Any
) -> None:
    from transformers import AutoTokenizer

    from protocol.reference import reference_weights

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    learner = ReferenceLearner()
    async with anyio.create_task_group() as tg:
        address = await tg.start(learner.serve)
        config = make_config(
            tmp_path, tiny_model, address, **{"actor_rollout_ref.rollout.on_weight_update": "drain"}
        )
        engine = ScriptedEngine(tok, ["no tools, 42"])
        engine.repeat_last = True
        from rollout_service.server import RolloutServer

        server = RolloutServer(config, tmp_path / "run", engine=engine)
        tg.start_soon(server.run)
        with anyio.fail_after(20):
            while not learner.received:
                await anyio.sleep(0.05)
            learner.server.publish_weights(1, reference_weights(seed=1), chunk_bytes=16 << 10)
            while engine.version != 1:
                await anyio.sleep(0.05)
            n_before = len(learner.received)
            while len(learner.received) < n_before + 4:  # generation goes on with the new weights
                await anyio.sleep(0.05)
            # WEIGHTS_APPLIED reached the learner: it records the peer's version from it
            while not any(p.policy_version == 1 for p in learner.server.proto.peers.values()):
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    version, tensors, mode = engine.loaded[0]
    assert version == 1 and mode == "keep"  # drain = keep once nothing is running
    expected = {b.name: bytes(b.data) for b in reference_weights(seed=1)}
    assert tensors == expected
    assert max(int(t.versions.max()) for t in learner.received) == 1
    # Its timeline: the load as a span, the generation as counters (tools/timeline.py draws them).
    from tools.timeline_read import level, read_timeline

    (timeline,) = read_timeline(tmp_path / "run").servers
    assert timeline.name == "rs-test"
    assert [(r.name, r.args["version"], r.args["outcome"]) for r in timeline.spans] == [
        ("apply", 1, "ok")
    ]
    _, tokens = level(timeline.samples, "sampled_tokens")
    assert tokens and tokens[-1] > 0


@pytest.mark.parametrize("bad", [float("nan"), 0.5, float("inf"), float("-inf")])
def test_a_logprob_no_policy_could_give_is_named(bad: float) -> None:
    from rollout_service.engine.base import EngineOutputError, check_logprobs

    check_logprobs([-0.0, -1.5, -30.0], "ok")
    with pytest.raises(
        EngineOutputError, match=rf"request r7: .*logprob {bad} for sampled token 1 of 3"
    ):
        check_logprobs([-0.1, bad, -0.2], "request r7")


@pytest.mark.anyio
async def test_a_corrupt_engine_stops_the_server_with_one_clear_error(
    tmp_path: Path, tiny_model: Path, echo_tool: Any
) -> None:
    """What a corrupt vLLM raises (VllmEngine checks every output) ends the server as one error,
    not a task tree, and before anything is shipped: the learner never sees the batch."""
    from transformers import AutoTokenizer

    from rollout_service.engine.base import EngineOutputError, check_logprobs

    class Corrupt(ScriptedEngine):
        async def generate(self, request_id: str, prompt_ids: Any, sampling: Any) -> Any:
            gen = await super().generate(request_id, prompt_ids, sampling)
            check_logprobs([float("nan"), *gen.logprobs[1:]], f"request {request_id}")
            return gen

    learner = ReferenceLearner()
    async with anyio.create_task_group() as tg:
        address = await tg.start(learner.serve)
        config = make_config(tmp_path, tiny_model, address)
        engine = Corrupt(AutoTokenizer.from_pretrained(str(tiny_model)), ["it is 42"])
        with pytest.raises(EngineOutputError, match="logprob nan for sampled token 0"):
            await serve_groups(config, tmp_path / "run", engine, groups=1)
        tg.cancel_scope.cancel()
    assert not learner.received


def test_unknown_names_are_refused_before_the_engine_starts(
    tmp_path: Path, tiny_model: Path
) -> None:
    from rollout_service.errors import StartupError
    from rollout_service.server import RolloutServer

    config = make_config(
        tmp_path,
        tiny_model,
        "tcp://127.0.0.1:1",
        **{
            "actor_rollout_ref.rollout.multi_turn.tools": ["calc"],
            "rollout_server.reward_fn": "mathh",
            "data.agent_type": "tool_agnet",
        },
    )
    with pytest.raises(StartupError) as e:
        RolloutServer(config, tmp_path / "run")
    msg = str(e.value)
    assert "multi_turn.tools: unknown tool 'calc'" in msg and "known: answer, calculator" in msg
    assert "rollout_server.reward_fn: unknown reward function 'mathh'" in msg
    assert "agent type 'tool_agnet'" in msg


def test_a_second_server_on_the_same_shard_is_refused(
    tmp_path: Path, tiny_model: Path, echo_tool: Any
) -> None:
    from rollout_service.errors import StartupError
    from rollout_service.server import RolloutServer

    config = make_config(tmp_path, tiny_model, "tcp://127.0.0.1:1")
    first = RolloutServer(config, tmp_path / "run")
    with pytest.raises(StartupError, match="shard 0 of 1 is in use"):
        RolloutServer(config, tmp_path / "run")
    first._state_lock.release()


def test_stale_groups_are_dropped_whole() -> None:
    from protocol.reference import synthetic_trajectory
    from protocol.staleness import group_too_old as stale

    rng = np.random.default_rng(0)
    fresh = [synthetic_trajectory(rng, server="s", version=4) for _ in range(2)]
    old = synthetic_trajectory(rng, server="s", version=2)
    assert not stale(fresh, newest_version=5, max_staleness=1)
    assert stale([*fresh, old], newest_version=5, max_staleness=2) is True  # 5 - 2 > 2
    assert not stale([*fresh, old], newest_version=5, max_staleness=3)
    # Only sampled tokens count: a tool span tagged with an older version does not make it stale.
    old.versions[old.response_mask == 1] = 5
    assert not stale([old], newest_version=5, max_staleness=0)


@pytest.mark.anyio
async def test_admission_waits_while_weights_lag_and_stale_groups_are_not_shipped(
    tmp_path: Path, tiny_model: Path, echo_tool: Any
) -> None:
    from transformers import AutoTokenizer

    from protocol.reference import reference_weights
    from rollout_service.server import RolloutServer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    learner = ReferenceLearner()
    async with anyio.create_task_group() as tg:
        address = await tg.start(learner.serve)
        config = make_config(
            tmp_path,
            tiny_model,
            address,
            **{
                "actor_rollout_ref.rollout.max_staleness": 0,
                "rollout_server.max_concurrent_episodes": 2,
            },
        )
        engine = ScriptedEngine(tok, ["answer 42"])
        engine.repeat_last, engine.delay_s, engine.load_gate = True, 0.3, anyio.Event()
        server = RolloutServer(config, tmp_path / "run", engine=engine)
        tg.start_soon(server.run)
        with anyio.fail_after(20):
            while not learner.received:
                await anyio.sleep(0.02)
            learner.server.publish_weights(1, reference_weights(seed=1), chunk_bytes=16 << 10)
            while server.newest_version != 1:  # announced, still loading (the gate is closed)
                await anyio.sleep(0.02)
            calls = len(engine.calls)
            await anyio.sleep(1.0)
            assert len(engine.calls) <= calls + 2, "episodes were admitted while the weights lagged"
            shipped = len(learner.received)
            engine.load_gate.set()
            while len(learner.received) < shipped + 4:
                await anyio.sleep(0.02)
        tg.cancel_scope.cancel()
    assert server.stats.counters.staleness_drops >= 2  # the group in flight finished on version 0
    assert all(int(t.versions.min()) == 1 for t in learner.received[shipped:])


@pytest.mark.anyio
async def test_prompts_uniform_last_time_are_skipped_for_an_epoch(
    tmp_path: Path, tiny_model: Path, echo_tool: Any
) -> None:
    """rollout_server.prompt_memory: every episode of every prompt scores 1, so with last_k=1 each
    prompt rests the epoch after: 10 groups are epochs 0 and 2 of the 5 rows, none of epoch 1."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    learner = ReferenceLearner()
    async with anyio.create_task_group() as tg:
        address = await tg.start(learner.serve)
        config = make_config(
            tmp_path,
            tiny_model,
            address,
            **{
                "rollout_server.prompt_memory.last_k": 1,
                "rollout_server.max_concurrent_episodes": 2,  # one group at a time
            },
        )
        engine = ScriptedEngine(tok, [])
        engine.respond = lambda context: "it is 42"
        server = await serve_groups(config, tmp_path / "run", engine, groups=10)
        tg.cancel_scope.cancel()
    epochs = sorted({t.group_uid.split("-")[0] for t in learner.received})
    assert epochs == ["e0", "e2"] and len(learner.received) == 20
    assert server.memory.skipped == 5 and server.stats.counters.prompts_skipped == 5
    assert server.source.cursor == (3, 0)  # the skipped prompts are done, not pending
