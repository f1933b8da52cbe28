"""Validation runs on a rollout server, without vLLM: the runner on a scripted engine (sharding,
greedy val sampling, metrics per data source, local ids) and the server answering the reference
learner's VALIDATE_REQUEST over ZeroMQ (waiting for the requested weights, never shipping a
validation episode)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from scripted import ScriptedEngine

from common.config import load_config
from protocol.reference import ReferenceLearner, reference_weights
from rollout_service.agents.base import AgentDeps
from rollout_service.engine.base import SamplingSettings
from rollout_service.groups import RewardChoice
from rollout_service.rewards.base import REWARDS, EpisodeView, RewardResult
from rollout_service.server import agent_limits
from rollout_service.validation import ValidationRunner, load_val_rows, val_sampling


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # zmq.asyncio


@REWARDS.register("test_val_says_yes")
async def _says_yes(ep: EpisodeView, row: dict[str, Any]) -> RewardResult:
    ok = "yes" in ep.response_text
    return RewardResult(float(ok), {"correct": ok, "note": "text extras are not averaged"})


def write_rows(path: Path, sources: list[str]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"question": f"q{i}?", "answer": "yes", "data_source": s}) + "\n"
            for i, s in enumerate(sources)
        )
    )
    return path


def make_config(tmp: Path, model: Path, **over: Any) -> Any:
    overrides = {
        "actor_rollout_ref.model.path": str(model),
        "actor_rollout_ref.rollout.n": 2,
        "data.train_files": str(write_rows(tmp / "train.jsonl", ["train"] * 4)),
        "data.max_response_length": 64,
        "data.train_batch_size": 4,
        "rollout_server.reward_fn": "test_val_says_yes",
        "rollout_server.server_id": "rs-val",
        "trainer.run_dir": str(tmp / "run"),
        "rollout_server.stats_interval_s": 0.2,
        "transport.heartbeat_interval_s": 0.2,
        "transport.heartbeat_timeout_s": 2.0,
        "transport.auth": "none",  # the reference learner authenticates no one
        **over,
    }
    return load_config(
        None,
        [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()],
        check_paths=False,
    )


def test_rows_are_this_shards_in_file_order(tmp_path: Path, tiny_model: Path) -> None:
    a = write_rows(tmp_path / "a.jsonl", ["math", "math", "qa"])
    b = tmp_path / "b.jsonl"
    b.write_text(json.dumps({"question": "q?", "answer": "1", "agent": "tool_agent"}) + "\n")
    config = make_config(tmp_path, tiny_model, **{"data.val_files": [str(a), str(b)]})
    rows = load_val_rows(config.data, shard_index=1, shard_count=2)
    assert [(r.index, r.data_source, r.agent_type) for r in rows] == [
        (1, "math", "single_turn"),
        (3, "b", "tool_agent"),
    ]
    assert [r.index for r in load_val_rows(config.data, shard_index=0, shard_count=2)] == [0, 2]
    assert load_val_rows(make_config(tmp_path, tiny_model).data, shard_index=0, shard_count=1) == []


def test_val_sampling_is_greedy_unless_do_sample(tmp_path: Path, tiny_model: Path) -> None:
    config = make_config(
        tmp_path, tiny_model, **{"actor_rollout_ref.rollout.val_kwargs.temperature": 0.7}
    )
    assert val_sampling(config) == SamplingSettings(
        max_tokens=64, temperature=0.0, top_p=1.0, top_k=-1
    )
    config = make_config(
        tmp_path,
        tiny_model,
        **{
            "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
            "actor_rollout_ref.rollout.val_kwargs.temperature": 0.7,
            "actor_rollout_ref.rollout.val_kwargs.top_p": 0.9,
            "actor_rollout_ref.rollout.val_kwargs.top_k": 5,
        },
    )
    assert val_sampling(config) == SamplingSettings(
        max_tokens=64, temperature=0.7, top_p=0.9, top_k=5
    )


@pytest.mark.anyio
async def test_runner_plays_every_row_n_times_and_reports_per_source(
    tmp_path: Path, tiny_model: Path, renderer: Any, tokenizer: Any
) -> None:
    val = write_rows(tmp_path / "val.jsonl", ["math", "qa", "math"])
    config = make_config(
        tmp_path,
        tiny_model,
        **{"data.val_files": str(val), "actor_rollout_ref.rollout.val_kwargs.n": 3},
    )
    engine = ScriptedEngine(tokenizer, [])
    engine.respond = lambda context: "yes" if "q0?" in context or "q1?" in context else "no"
    seen = spy_on_ids(engine)
    deps = {
        "single_turn": AgentDeps(
            engine=engine,
            renderer=renderer,
            sampling=SamplingSettings(max_tokens=64),
            limits=agent_limits(config),
        )
    }
    from rollout_service.agents import load_builtin_agents

    load_builtin_agents()
    runner = ValidationRunner.from_config(config, server_id="rs-val")
    assert runner.problem == "" and runner.agent_types == {"single_turn"}
    result = await runner.run("r1", 0, deps=deps, rewards=RewardChoice("test_val_says_yes"))
    assert result.ok and result.request_id == "r1" and result.prompts == 3 and result.count == 9
    math_m, qa_m = result.sources
    assert (math_m.data_source, math_m.count, math_m.reward_mean) == ("math", 6, 0.5)
    assert (qa_m.data_source, qa_m.count, qa_m.reward_mean) == ("qa", 3, 1.0)
    assert math_m.extras_mean == {"correct": 0.5} and math_m.extras_count == {"correct": 6}
    assert sum(math_m.terminations.values()) == 6 and math_m.turns_mean == 1.0
    # greedy: val_kwargs.do_sample is false
    assert {s.temperature for _, s in engine.calls} == {0.0}
    # local ids, never e{epoch}-...
    assert len(seen) == 9 and all(r.startswith("val-r1-") for r in seen)


def spy_on_ids(engine: ScriptedEngine) -> list[str]:
    """Record the request id of every generate call (the scripted engine records only prompts)."""
    seen: list[str] = []
    generate = engine.generate

    async def spy(request_id: str, prompt_ids: Any, sampling: SamplingSettings) -> Any:
        seen.append(request_id)
        return await generate(request_id, prompt_ids, sampling)

    engine.generate = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.anyio
async def test_unusable_or_missing_validation_data_is_answered_not_raised(
    tmp_path: Path, tiny_model: Path
) -> None:
    missing = make_config(tmp_path, tiny_model, **{"data.val_files": str(tmp_path / "nope.jsonl")})
    runner = ValidationRunner.from_config(missing, server_id="rs-val")
    assert "nope.jsonl" in runner.problem and runner.agent_types == set()
    result = await runner.run("r", 3, deps={}, rewards=RewardChoice())
    assert not result.ok and "nope.jsonl" in result.error and result.policy_version == 3
    empty = ValidationRunner.from_config(make_config(tmp_path, tiny_model), server_id="rs-val")
    result = await empty.run("r", 0, deps={}, rewards=RewardChoice())
    assert result.ok and result.sources == [] and result.count == 0 and result.prompts == 0
    unknown = write_rows(tmp_path / "u.jsonl", ["x"])
    unknown.write_text(
        json.dumps({"question": "q?", "answer": "1", "agent": "no_such_agent"}) + "\n"
    )
    runner = ValidationRunner.from_config(
        make_config(tmp_path, tiny_model, **{"data.val_files": str(unknown)}), server_id="rs-val"
    )
    runner.check_agents(lambda a: a == "single_turn")
    assert "no_such_agent" in runner.problem


@pytest.mark.anyio
async def test_server_answers_validation_and_never_ships_it(
    tmp_path: Path, tiny_model: Path, tokenizer: Any
) -> None:
    from rollout_service.server import RolloutServer

    val = write_rows(tmp_path / "val.jsonl", ["math", "math"])
    learner = ReferenceLearner(validate_on_join=True)
    async with anyio.create_task_group() as tg:
        address = await tg.start(learner.serve)
        config = make_config(
            tmp_path,
            tiny_model,
            **{"data.val_files": str(val), "rollout_server.learner_address": address},
        )
        engine = ScriptedEngine(tokenizer, [])
        engine.respond = lambda context: "yes"
        seen = spy_on_ids(engine)
        server = RolloutServer(config, tmp_path / "run", engine=engine)
        tg.start_soon(server.run)
        with anyio.fail_after(30):
            while not learner.validations:
                await anyio.sleep(0.05)
            peer, first = learner.validations[0]
            assert peer == "rs-val" and first.ok and first.count == 2 and first.policy_version == 0
            assert first.sources[0].data_source == "math" and first.sources[0].reward_mean == 1.0
            # A request for a version the engine does not run yet waits for those weights.
            learner.server.request_validation("later", 1, timeout_s=20.0)
            await anyio.sleep(0.5)
            assert len(learner.validations) == 1
            learner.server.publish_weights(1, reference_weights(seed=1), chunk_bytes=16 << 10)
            while len(learner.validations) < 2:
                await anyio.sleep(0.05)
            while len(learner.received) < 4:
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    later = learner.validations[1][1]
    assert (
        later.request_id == "later" and later.ok and later.policy_version == 1 and later.count == 2
    )
    val_requests = [r for r in seen if r.startswith("val-")]
    assert val_requests and all(r.startswith(("val-ref-", "val-later-")) for r in val_requests)
    assert not [t for t in learner.received if t.group_uid.startswith("val-")]
    assert {t.data_source for t in learner.received} == {"train"}
