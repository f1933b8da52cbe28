"""The scripted engine as ``rollout_server.engine: scripted`` builds it: the model's tokenizer, a
fixed answer on every turn, weights taken as chunks or as the learner's file (read, recorded by
version, never applied); and the config key that chooses it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.config import ConfigError, load_config
from rollout_service.engine.base import SamplingSettings, WeightUpdateError
from rollout_service.engine.scripted import DEFAULT_TURN, ScriptedEngine

pytestmark = pytest.mark.anyio


def engine_for(model: Path) -> ScriptedEngine:
    overrides = [f"actor_rollout_ref.model.path={model}", "data.train_files=t.jsonl"]
    config = load_config(None, overrides, check_paths=False)
    return ScriptedEngine.from_config(config.actor_rollout_ref)


async def test_every_turn_is_the_default_answer_ending_with_eos(tiny_model: Path) -> None:
    engine = engine_for(tiny_model)
    for turn in range(3):
        gen = await engine.generate(f"e0-t{turn}", [1, 2, 3], SamplingSettings(max_tokens=64))
        assert gen.token_ids[-1] == engine.tok.eos_token_id and gen.finish_reason == "stop"
        assert engine.tok.decode(gen.token_ids[:-1]) == DEFAULT_TURN
        assert gen.versions == [0] * len(gen.token_ids) and len(gen.logprobs) == len(gen.token_ids)
    short = await engine.generate("e1-t0", [1], SamplingSettings(max_tokens=2))
    assert len(short.token_ids) == 2 and short.finish_reason == "length"
    assert engine.calls == []  # a server's engine keeps no prompts


async def test_weights_as_chunks_or_a_file_set_the_version(
    tiny_model: Path, tmp_path: Path
) -> None:
    from safetensors.numpy import save_file

    engine = engine_for(tiny_model)
    await engine.load_weights(1, [("w", np.ones(3, np.float32))], mode="keep")
    path = tmp_path / "model.safetensors"
    save_file({"a": np.zeros(2, np.float32), "b": np.ones(1, np.float32)}, str(path))
    await engine.load_weights_file(2, str(path), mode="abort")
    assert engine.policy_version == 2
    assert [(v, sorted(t), m) for v, t, m in engine.loaded] == [
        (1, ["w"], "keep"),
        (2, ["a", "b"], "abort"),
    ]
    with pytest.raises(WeightUpdateError, match="cannot read weights file"):
        await engine.load_weights_file(3, str(path.with_name("absent.safetensors")), mode="keep")
    assert engine.policy_version == 2


def test_the_config_chooses_the_engine_and_refuses_others() -> None:
    base = ["actor_rollout_ref.model.path=m", "data.train_files=t.jsonl"]
    assert load_config(None, base, check_paths=False).rollout_server.engine == "vllm"
    chosen = load_config(None, [*base, "rollout_server.engine=scripted"], check_paths=False)
    assert chosen.rollout_server.engine == "scripted"
    with pytest.raises(ConfigError, match=r"rollout_server\.engine"):
        load_config(None, [*base, "rollout_server.engine=sglang"], check_paths=False)
