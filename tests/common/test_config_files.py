"""Every shipped config validates, round-trips through its YAML dump, and every key is documented."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from common.config import Config, dump_config, load_config
from common.config.loader import parse_yaml

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.yaml"))


def test_the_expected_configs_exist() -> None:
    names = {p.name for p in CONFIG_FILES}
    assert {
        "default.yaml",
        "demo.yaml",
        "gsm8k_tool_agent_gpu.yaml",
        "statelm_longdoc.yaml",
        "mixed_dataset.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_file_validates(path: Path) -> None:
    config = load_config(path, check_paths=False)
    assert isinstance(config, Config)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_resolved_dump_loads_back_equal(path: Path, tmp_path: Path) -> None:
    config = load_config(path, check_paths=False)
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_config(config))
    assert load_config(dumped, check_paths=False) == config


def test_mixed_dataset_ratios_sum_to_one() -> None:
    config = load_config(CONFIG_DIR / "mixed_dataset.yaml", check_paths=False)
    assert len(config.data.datasets) > 1
    assert sum(d.ratio for d in config.data.datasets) == pytest.approx(1.0)


def test_rollout_lengths_default_to_the_data_lengths() -> None:
    config = load_config(CONFIG_DIR / "default.yaml", check_paths=False)
    rollout = config.actor_rollout_ref.rollout
    assert rollout.prompt_length == config.data.max_prompt_length
    assert rollout.response_length == config.data.max_response_length


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        stack: list[Any] = [field.annotation]
        while stack:
            annotation = stack.pop()
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                _models(annotation, seen)
            stack.extend(get_args(annotation))


def test_every_field_is_documented_and_closed() -> None:
    models: set[type[BaseModel]] = set()
    _models(Config, models)
    assert len(models) > 15
    for model in models:
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_yaml_reads_exponent_floats() -> None:
    # YAML 1.1 reads `1e-6` as a string; configs write learning rates that way.
    assert parse_yaml("lr: 1e-6", "x") == {"lr": 1e-6}
    assert parse_yaml("lr: 5.0e-7", "x") == {"lr": 5e-7}
    assert parse_yaml("v: 1", "x") == {"v": 1}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
@pytest.mark.integration
def test_config_passes_check_on_this_machine(path: Path, tmp_path: Path) -> None:
    """`bin/train --check` (the learner's and the rollout server's loader too) accepts every shipped
    config once its model path points at a model directory that exists here."""
    import subprocess
    import sys

    model = tmp_path / "model"
    model.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            str(CONFIG_DIR.parent / "bin" / "train"),
            "--config",
            str(path),
            f"actor_rollout_ref.model.path={model}",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "actor_rollout_ref:" in out.stdout
