"""A checkpoint resumes only under the LoRA adapters it was trained with (`learner.trainer`): the
state records them, and a run asking for others is refused naming the key, both settings and the
checkpoint, before any worker starts."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from common.config.errors import ConfigError
from learner.run_settings import check_lora_resume, lora_record
from learner.worker_settings import LoraSettings

PATH = Path("/runs/r/checkpoints/global_step_3")


def saved(lora: LoraSettings | None) -> dict[str, object]:
    """The state as a checkpoint's file brings it back (msgpack: tuples come back as lists)."""
    state = {"step": 3, "lora": lora_record(lora)}
    return msgpack.unpackb(msgpack.packb(state), raw=False)


@pytest.mark.parametrize(
    "lora",
    [None, LoraSettings(rank=8), LoraSettings(rank=4, target_modules=("q_proj", "v_proj"))],
)
def test_the_same_adapters_resume(lora: LoraSettings | None) -> None:
    check_lora_resume(saved(lora), lora, PATH)


def test_a_checkpoint_from_before_the_record_is_not_checked() -> None:
    check_lora_resume({"step": 3}, LoraSettings(rank=8), PATH)


@pytest.mark.parametrize(
    ("then", "now", "key"),
    [
        (LoraSettings(rank=8), None, "lora_rank"),
        (None, LoraSettings(rank=8), "lora_rank"),
        (LoraSettings(rank=8), LoraSettings(rank=16), "lora_rank"),
        (LoraSettings(rank=8), LoraSettings(rank=8, alpha=32), "lora_alpha"),
        (LoraSettings(rank=8), LoraSettings(rank=8, target_modules=("q_proj",)), "target_modules"),
    ],
)
def test_other_adapters_are_refused_naming_both(
    then: LoraSettings | None, now: LoraSettings | None, key: str
) -> None:
    with pytest.raises(ConfigError) as e:
        check_lora_resume(saved(then), now, PATH)
    text = str(e.value)
    assert f"actor_rollout_ref.model.{key}" in text and str(PATH) in text
    assert "resume_mode=disable" in text
