"""Shared by the rollout server's tests: a config on the tiny model with a small data file, the
reward that looks for "42" (the ``echo`` tool is a fixture in conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.config import load_config
from rollout_service.rewards.base import REWARDS, EpisodeView, RewardResult


@REWARDS.register("test_mentions_42")
async def _mentions_42(ep: EpisodeView, row: dict[str, Any]) -> RewardResult:
    return RewardResult(float("42" in ep.response_text), {"turns": ep.num_turns})


def write_data(path: Path, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {"question": f"what is {i}*7?", "answer": str(7 * i), "data_source": "arith"}
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


def make_config(tmp: Path, model: Path, address: str, **over: Any) -> Any:
    overrides = {
        "actor_rollout_ref.model.path": str(model),
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.rollout.multi_turn.enable": True,
        "actor_rollout_ref.rollout.multi_turn.tools": ["echo"],
        "data.train_files": str(write_data(tmp / "train.jsonl", 5)),
        "data.agent_type": "tool_agent",
        "data.max_response_length": 200,
        "data.train_batch_size": 4,
        "rollout_server.learner_address": address,
        "trainer.run_dir": str(tmp / "run"),  # what the server shares with the learner (timeline)
        "rollout_server.server_id": "rs-test",
        "rollout_server.reward_fn": "test_mentions_42",
        "rollout_server.stats_interval_s": 0.2,
        "transport.heartbeat_interval_s": 0.2,
        "transport.heartbeat_timeout_s": 2.0,
        # The reference learner and bare ROUTERs these servers meet authenticate no one; a test
        # with the real intake sets transport.auth: token (the token file is the same for both).
        "transport.auth": "none",
        "transport.auth_token_file": str(tmp / "learner.token"),
        **over,
    }
    return load_config(
        None,
        [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()],
        check_paths=False,
    )


def serve_scripted(tmp: Path, model: Path, address: str, shm: Path, **over: Any) -> None:
    """Run a real RolloutServer on the scripted engine (answers "42", echo tool) until it is
    stopped: the child process of the hostile tests, whose weights by file are applied as a version
    without touching a model. ``over``: config overrides on top of make_config's."""
    import anyio
    from scripted import EchoTool, ScriptedEngine
    from transformers import AutoTokenizer

    from common.safetensors_buffers import model_manifest
    from rollout_service.server import RolloutServer
    from rollout_service.tools.base import TOOLS

    class Engine(ScriptedEngine):
        weight_manifest = model_manifest(model)

        async def load_weights_file(self, version: int, path: str, *, mode: str) -> float:
            self.version = version
            return 0.001

    TOOLS.register("echo")(lambda **_: EchoTool(text="42"))
    settings = {
        "learner.weights_file_dir": str(shm),
        "transport.heartbeat_timeout_s": 30.0,
        "rollout_server.stats_interval_s": 60.0,
        **over,
    }
    config = make_config(tmp, model, address, **settings)
    engine = Engine(AutoTokenizer.from_pretrained(str(model)), ["42"])
    engine.repeat_last = True
    anyio.run(RolloutServer(config, tmp / "run", engine=engine).run)
