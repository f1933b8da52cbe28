"""The rollout server's prompt memory (rollout_service/prompt_memory.py): prompts whose last groups
were uniform are skipped for a number of epochs, then run again; sans-IO, and the config rule."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import load_config
from common.config.errors import ConfigError
from protocol.trajectory import Trajectory
from rollout_service.prompt_memory import PromptMemory

pytestmark = pytest.mark.unit


def group(*rewards: float) -> list[Trajectory]:
    z = np.zeros(2, np.int32)
    return [
        Trajectory("t", "g", z, z, np.ones(2, np.uint8), np.zeros(2, np.float32), z, reward=r)
        for r in rewards
    ]


def test_a_prompt_uniform_its_last_k_times_rests_for_skip_epochs() -> None:
    m = PromptMemory(last_k=2, skip_epochs=2)
    assert not m.record(7, 0, group(1, 1))  # all passed, once
    assert not m.skips(7, 1)
    assert m.record(7, 1, group(0, 0))  # all failed: twice uniform in a row
    assert m.skips(7, 2) and m.skips(7, 3) and m.skipped == 2 and m.resting == 1
    assert not m.skips(7, 4) and m.resting == 0  # runs again, with a clean record
    assert not m.record(7, 4, group(1, 1))


def test_a_mixed_or_unjudged_group_clears_the_record() -> None:
    m = PromptMemory(last_k=2)
    m.record(3, 0, group(0, 0))
    m.record(3, 1, group(0, 1))  # mixed: the model can learn from it
    assert not m.record(3, 2, group(0, 0)) and not m.skips(3, 3)
    acc = PromptMemory(last_k=1, metric="acc")
    assert not acc.record(3, 0, group(0, 0))  # no acc in the extras: no verdict
    assert not PromptMemory(last_k=0).record(3, 0, group(0, 0))  # off


def test_config_refuses_the_memory_with_mixed_data_sets() -> None:
    base = ["actor_rollout_ref.model.path=m", "rollout_server.prompt_memory.last_k=2"]
    cfg = load_config(None, [*base, "data.train_files=t.jsonl"], check_paths=False)
    assert cfg.rollout_server.prompt_memory.skip_epochs == 1
    with pytest.raises(ConfigError, match=r"prompt_memory\.last_k"):
        load_config(
            None,
            [*base, "data.datasets=[{name: a, path: a.jsonl, ratio: 1}]"],
            check_paths=False,
        )
