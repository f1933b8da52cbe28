"""Loading, overrides and the error messages of invalid configurations."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError, load_config

BASE = """\
actor_rollout_ref:
  model:
    path: {model}
data:
  train_files: train.jsonl
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    path = tmp_path / "run.yaml"
    path.write_text(BASE.format(model=model))
    return path


def write(tmp_path: Path, text: str, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: Path | None, *overrides: str, check_paths: bool = True) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), check_paths=check_paths)
    return str(info.value)


def test_minimal_file_loads_with_defaults(config_file: Path) -> None:
    config = load_config(config_file, [])
    assert config.data.train_files == ["train.jsonl"]
    assert config.actor_rollout_ref.actor.strategy == "fsdp2"
    assert config.transport.max_message_bytes == 256 * 1024 * 1024


def test_override_value_types(config_file: Path) -> None:
    config = load_config(
        config_file,
        [
            "trainer.total_training_steps=7",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "trainer.logger=[console,jsonl]",
            "ray.address=null",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.max_model_len=null",
            "data.val_files=[a.jsonl, b.jsonl]",
            "algorithm.kl_ctrl.kl_coef=0.5",
        ],
    )
    assert config.trainer.total_training_steps == 7
    assert config.actor_rollout_ref.actor.optim.lr == 1e-6
    assert config.trainer.logger == ["console", "jsonl"]
    assert config.ray.address is None
    assert config.actor_rollout_ref.rollout.multi_turn.enable is True
    assert config.data.val_files == ["a.jsonl", "b.jsonl"]
    assert config.algorithm.kl_ctrl.kl_coef == 0.5


def test_override_of_a_string_key_keeps_the_text(config_file: Path) -> None:
    config = load_config(
        config_file, ["trainer.experiment_name=0042", "rollout_server.server_id=7"]
    )
    assert config.trainer.experiment_name == "0042"
    assert config.rollout_server.server_id == "7"


def test_override_list_item_and_new_section(config_file: Path, tmp_path: Path) -> None:
    datasets = "data.datasets=[{name: a, path: a.jsonl, ratio: 0.5}, {data_source: b, path: b.jsonl, ratio: 0.5}]"
    config = load_config(
        config_file, ["data.train_files=[]", datasets, "data.datasets.1.agent_type=code"]
    )
    assert [d.name for d in config.data.datasets] == ["a", "b"]
    assert config.data.datasets[1].agent_type == "code"
    assert config.data.datasets[0].path == ["a.jsonl"]


def test_unknown_key_in_file_suggests_the_right_one(tmp_path: Path, config_file: Path) -> None:
    path = write(tmp_path, config_file.read_text() + "trainer:\n  totl_training_steps: 3\n")
    message = error_of(path)
    assert message == (
        f"{path}: trainer.totl_training_steps: unknown key (did you mean total_training_steps?)"
    )


def test_unknown_key_override_names_the_override(config_file: Path) -> None:
    message = error_of(config_file, "trainer.totl_training_steps=3")
    assert message == (
        "command line override 'trainer.totl_training_steps=3': "
        "trainer.totl_training_steps: unknown key (did you mean total_training_steps?)"
    )
    assert "unknown key" in error_of(config_file, "nosuchsection.x=1")


def test_hydra_prefixes_of_verl_recipes(config_file: Path) -> None:
    """verl's DAPO recipe writes `+reward.reward_kwargs...` and users write `++key`: both set the
    key; an unknown one is still refused, naming the override as written; `~key` says why not."""
    config = load_config(
        config_file,
        [
            "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward.reward_kwargs.overlong_buffer_cfg.len=16",
            "++trainer.total_training_steps=9",
            "algorithm.filter_groups.enable=True",
        ],
    )
    assert config.reward.reward_kwargs.overlong_buffer_cfg.enable is True
    assert config.reward.reward_kwargs.overlong_buffer_cfg.len == 16
    assert config.trainer.total_training_steps == 9
    assert config.algorithm.filter_groups.enable is True
    message = error_of(config_file, "+trainer.totl_training_steps=3")
    assert message.startswith("command line override '+trainer.totl_training_steps=3': ")
    assert "unknown key (did you mean total_training_steps?)" in message
    message = error_of(config_file, "~trainer.total_training_steps")
    assert "trainer.total_training_steps" in message and "leave the override out" in message


def test_wrong_type(config_file: Path) -> None:
    message = error_of(config_file, "trainer.total_epochs=abc")
    assert message == (
        "command line override 'trainer.total_epochs=abc': trainer.total_epochs: "
        "must be an integer (got 'abc')"
    )
    assert "must be true or false (got 3)" in error_of(config_file, "data.shuffle=3")
    assert "must be one of 'gae', 'grpo'" in error_of(config_file, "algorithm.adv_estimator=ppo")


def test_negative_batch_size_names_file_and_key(tmp_path: Path, config_file: Path) -> None:
    text = config_file.read_text() + "  train_batch_size: -1\n"  # under data:
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}: data.train_batch_size: must be greater than 0 (got -1)"


def test_mini_batch_must_divide_the_batch(config_file: Path) -> None:
    message = error_of(config_file, "actor_rollout_ref.actor.ppo_mini_batch_size=-1")
    assert message.endswith(
        "actor_rollout_ref.actor.ppo_mini_batch_size: must be greater than 0 (got -1)"
    )
    message = error_of(config_file, "actor_rollout_ref.actor.ppo_mini_batch_size=5")
    assert "actor_rollout_ref.actor.ppo_mini_batch_size: must divide" in message
    message = error_of(config_file, "data.train_batch_size=1", "actor_rollout_ref.rollout.n=2")
    assert "(got 8)" in message and message.startswith("command line override")


def test_value_ranges(config_file: Path) -> None:
    cases = {
        "actor_rollout_ref.rollout.top_p=0": "must be greater than 0",
        "actor_rollout_ref.rollout.top_p=1.5": "must be at most 1",
        "actor_rollout_ref.rollout.temperature=-0.1": "must be at least 0",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0": "must be greater than 0",
        "algorithm.gamma=1.1": "must be at most 1",
        "actor_rollout_ref.actor.clip_ratio_low=-0.2": "must be at least 0",
        "actor_rollout_ref.actor.clip_ratio_c=1": "must be greater than 1",
    }
    for override, expected in cases.items():
        key = override.split("=")[0]
        assert f"{key}: {expected}" in error_of(config_file, override), override


def test_lengths_must_fit_the_model_length(config_file: Path) -> None:
    message = error_of(config_file, "actor_rollout_ref.rollout.max_model_len=100")
    assert (
        "actor_rollout_ref.rollout.max_model_len: must hold prompt_length + response_length = 384"
        in message
    )


def test_dataset_ratios_must_sum_to_one(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    path = write(
        tmp_path,
        f"""\
actor_rollout_ref: {{model: {{path: {model}}}}}
data:
  datasets:
    - {{name: taco, path: t.jsonl, ratio: 0.4}}
    - {{name: nq, path: n.jsonl, ratio: 0.3}}
    - {{name: math, path: m.jsonl, ratio: 0.2}}
""",
    )
    message = error_of(path)
    assert message.startswith(f"{path}: data.datasets: ratios must sum to 1 (got 0.9")
    assert "math=0.2" in message
    assert "data.datasets.0.ratio: must be greater than 0" in error_of(
        path, "data.datasets.0.ratio=0"
    )


def test_missing_model_path(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {train_files: x.jsonl}\n")
    assert error_of(path) == f"{path}: actor_rollout_ref.model.path: required key is missing"
    missing = tmp_path / "nope"
    message = error_of(path, f"actor_rollout_ref.model.path={missing}")
    assert message == (
        f"command line override 'actor_rollout_ref.model.path={missing}': "
        f"actor_rollout_ref.model.path: directory does not exist: {missing}"
    )
    # The same config is fine when the filesystem is not checked.
    load_config(path, [f"actor_rollout_ref.model.path={missing}"], check_paths=False)


def test_curve_enabled_needs_key_files(config_file: Path, tmp_path: Path) -> None:
    message = error_of(config_file, "transport.curve.enabled=true")
    for key in ("secret_key_file", "server_public_key_file", "allowed_keys_dir"):
        assert f"transport.curve.{key}: required when transport.curve.enabled is true" in message
    key_file = tmp_path / "k.key_secret"
    key_file.write_text("x")
    config = load_config(
        config_file,
        [
            "transport.curve.enabled=true",
            f"transport.curve.secret_key_file={key_file}",
            f"transport.curve.server_public_key_file={key_file}",
            f"transport.curve.allowed_keys_dir={tmp_path}",
        ],
    )
    assert config.transport.curve.enabled


def test_all_problems_are_listed(config_file: Path) -> None:
    message = error_of(
        config_file,
        "trainer.total_epochs=0",
        "data.train_batch_size=x",
        "trainer.logger=[console,mlflow]",
        "bad-override",
    )
    lines = message.splitlines()
    assert len(lines) == 4, message
    assert any("trainer.total_epochs: must be greater than 0" in line for line in lines)
    assert any("trainer.logger.1: must be one of" in line for line in lines)
    assert any(line.startswith("command line override 'bad-override'") for line in lines)


def test_cross_field_rules(config_file: Path) -> None:
    assert "critic.enable: must be true when algorithm.adv_estimator is gae" in error_of(
        config_file, "algorithm.adv_estimator=gae"
    )
    load_config(config_file, ["algorithm.adv_estimator=gae", "critic.enable=true"])
    assert "trainer.resume_from_path: required" in error_of(
        config_file, "trainer.resume_mode=resume_path"
    )
    assert "transport.heartbeat_timeout_s: must exceed" in error_of(
        config_file, "transport.heartbeat_timeout_s=0.5"
    )
    assert "trainer.run_dir: unknown placeholder {date}" in error_of(
        config_file, "trainer.run_dir=runs/{date}"
    )
    assert "rollout_server.learner_address: must be a ZeroMQ endpoint" in error_of(
        config_file, "rollout_server.learner_address=localhost:5555"
    )


def test_bad_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "trainer:\n  total_epochs: 1\n  logger: [console\n")
    message = error_of(path)
    assert message.startswith(f"{path}:4:") and "invalid YAML" in message
    path = write(tmp_path, "trainer:\n  total_epochs: 1\n  total_epochs: 2\n", "dup.yaml")
    assert error_of(path).startswith(f"{path}:3:") and "duplicate key 'total_epochs'" in error_of(
        path
    )
    path = write(tmp_path, "- a\n- b\n", "list.yaml")
    assert error_of(path) == f"{path}: must be a mapping of sections (got a list)"
    assert "cannot read config file" in error_of(tmp_path / "absent.yaml")
    assert "invalid YAML" in error_of(None, "trainer.logger=[a,")


def test_override_into_a_value_is_an_error(config_file: Path) -> None:
    message = error_of(config_file, "actor_rollout_ref.model.path.x=1")
    assert "actor_rollout_ref.model.path: is a value, not a section" in message
    # A key the file does not set is created; its type is then checked like any value.
    message = error_of(config_file, "trainer.total_epochs.x=1")
    assert "trainer.total_epochs: must be an integer" in message
    assert "data.datasets: has no item '0'" in error_of(config_file, "data.datasets.0.ratio=1")


def test_lora_keys_as_verl_names_them(config_file: Path) -> None:
    """verl's LoRA keys with verl 0.9.1's defaults (off, alpha 16, all linears); a list or a regular
    expression of modules is taken, and what peft would refuse or match nothing with is refused
    here, naming the override and the key."""
    from learner.run_settings import lora_settings
    from learner.worker_settings import LoraSettings

    model = load_config(config_file, []).actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (0, 16, "all-linear")
    assert model.exclude_modules is None and lora_settings(model) is None
    key = "actor_rollout_ref.model"
    model = load_config(
        config_file,
        [f"{key}.lora_rank=8", f"{key}.lora_alpha=32", f"{key}.target_modules=[q_proj, v_proj]"],
    ).actor_rollout_ref.model
    assert lora_settings(model) == LoraSettings(8, 32, ("q_proj", "v_proj"))
    assert lora_settings(model).scaling == 4.0  # type: ignore[union-attr]
    regex = r".*\.(q|v)_proj"
    model = load_config(config_file, [f"+{key}.target_modules={regex}"]).actor_rollout_ref.model
    assert model.target_modules == regex
    cases = {
        f"{key}.lora_rank=-1": "must be at least 0",
        f"{key}.lora_alpha=0": "must be greater than 0",
        f"{key}.target_modules=[]": "must be a non-empty list of module names",
        f"{key}.target_modules=(q_proj": 'must be "all-linear", a list of module names or a regular',
        f"{key}.exclude_modules=[lm_head, '']": "must be a non-empty list of module names",
    }
    for override, expected in cases.items():
        message = error_of(config_file, override)
        assert message.startswith(f"command line override {override!r}"), message
        assert f"{override.split('=')[0]}: {expected}" in message, message
    assert "did you mean lora_rank?" in error_of(config_file, f"{key}.lora_rnak=8")
