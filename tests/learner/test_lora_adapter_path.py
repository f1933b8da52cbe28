"""verl's ``actor_rollout_ref.model.lora_adapter_path``: the actor's adapters start from a saved peft
adapter (`learner.lora.load_adapter`), and the run's first version is that adapter
(`learner.trainer.initial_weights`). An adapter that does not fit the run is refused naming the
file and what differs; the config refuses the key where it cannot apply, naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import ConfigError, load_config
from learner import lora
from learner.trainer import initial_weights
from learner.worker_settings import LoraSettings
from protocol.adapters import ADAPTER_FILE

LORA = LoraSettings(rank=4, alpha=8)
KEY = "actor_rollout_ref.model.lora_adapter_path"


def _adapted(model: Path, s: LoraSettings, seed: int) -> torch.nn.Module:
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    lora.add_adapters(lm, s)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if lora.is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return lm


@pytest.fixture
def saved(tiny_model: Path, tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A trained-looking adapter saved as the export saves one, and the model it came from."""
    lm = _adapted(tiny_model, LORA, seed=3)
    folder = tmp_path / "adapter"
    lora.save_adapter(folder, lora.adapter_state(lm.state_dict()), LORA, str(tiny_model))
    return folder, lm


def test_adapters_start_from_the_saved_adapter(
    tiny_model: Path, saved: tuple[Path, torch.nn.Module]
) -> None:
    folder, source = saved
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    lora.add_adapters(lm, LORA)
    lora.load_adapter(lm, LoraSettings(rank=4, alpha=8, adapter_path=str(folder)))
    want = dict(source.named_parameters())
    loaded = [n for n, _ in lm.named_parameters() if lora.is_adapter(n)]
    assert loaded
    for name, p in lm.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=0, atol=0, msg=name)
        assert p.requires_grad == lora.is_adapter(name), name
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        torch.testing.assert_close(lm(ids).logits, source(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        (LoraSettings(rank=8, alpha=8), "r is 4, the run's is 8"),
        (LoraSettings(rank=4, alpha=16), "lora_alpha is 8, the run's is 16"),
        (LoraSettings(rank=4, alpha=8, target_modules=("q_proj",)), "no adapter of the model"),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_naming_the_file(
    tiny_model: Path, saved: tuple[Path, torch.nn.Module], run: LoraSettings, expected: str
) -> None:
    folder, _ = saved
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    lora.add_adapters(lm, run)
    s = LoraSettings(run.rank, run.alpha, run.target_modules, adapter_path=str(folder))
    with pytest.raises(ValueError, match=expected) as e:
        lora.load_adapter(lm, s)
    assert str(folder) in str(e.value)


def test_an_adapter_lacking_tensors_is_refused(
    tiny_model: Path, saved: tuple[Path, torch.nn.Module]
) -> None:
    folder, _ = saved
    small = _adapted(tiny_model, LoraSettings(rank=4, alpha=8, target_modules=("q_proj",)), 1)
    # only q_proj's tensors now
    lora.save_adapter(folder, lora.adapter_state(small.state_dict()), LORA, str(tiny_model))
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    lora.add_adapters(lm, LORA)
    with pytest.raises(ValueError, match=r"lacks \d+ adapter tensors"):
        lora.load_adapter(lm, LoraSettings(4, 8, adapter_path=str(folder)))


def test_the_first_version_is_the_adapter(saved: tuple[Path, torch.nn.Module]) -> None:
    folder, source = saved
    publisher = cast(Any, None)  # a fresh start does not ask the publisher
    first = initial_weights([], None, publisher, str(folder))
    want = lora.adapter_state(source.state_dict())
    assert [t.name for t in first] == list(want)
    for t in first:
        assert bytes(t.data) == want[t.name].numpy().tobytes(), t.name


def test_the_config_refuses_the_key_where_it_cannot_apply(
    tmp_path: Path, saved: tuple[Path, torch.nn.Module]
) -> None:
    folder, _ = saved
    model = tmp_path / "model"
    model.mkdir()
    base = [f"actor_rollout_ref.model.path={model}", "data.train_files=train.jsonl"]

    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(None, [*base, *overrides])
        return str(e.value)

    assert "needs actor_rollout_ref.model.lora_rank > 0" in error(f"+{KEY}={folder}")
    rank = "actor_rollout_ref.model.lora_rank=4"
    merge = "actor_rollout_ref.model.lora.merge=true"
    assert "cannot be combined with lora.merge true" in error(f"{KEY}={folder}", rank, merge)
    assert f"no {ADAPTER_FILE} in {tmp_path}" in error(f"{KEY}={tmp_path}", rank)
    config = load_config(
        None, [*base, f"{KEY}={folder}", rank, "actor_rollout_ref.model.lora_alpha=8"]
    )
    assert config.actor_rollout_ref.model.lora_adapter_path == str(folder)
