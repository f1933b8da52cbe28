"""Data and scripts as users have them, through bin/train unchanged (real files, real processes):
a verl-layout parquet, and AgentFly's GSM8K example (seed 002) on an AgentFly JSON list with only
the model and data paths changed; ``--check`` refusing a broken data file with exit 2."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "bin" / "train"
SYSTEM = "You are a math assistant. Use the calculator, then give the answer as \\boxed{N}."

# AgentFly's GSM8K example (seed 002, docs/rollout-server.md), its variables filled in; the model
# and data paths are placeholders the test fills.
AGENTFLY_GSM8K = """\
algorithm.adv_estimator=grpo
data.train_files={train}
data.val_files={val}
data.train_batch_size=32
agent.agent_type=hf
agent.tools=[calculator]
agent.template=qwen2.5
agent.model_name_or_path={model}
agent.max_turns=3
agent.backend=async_verl
agent.reward_name=math_reward_string_equal
agent.num_chains=8
agent.use_agent=True
actor_rollout_ref.actor.optim.lr=5e-7
actor_rollout_ref.model.use_remove_padding=False
actor_rollout_ref.model.path={model}
actor_rollout_ref.actor.ppo_mini_batch_size=32
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=mse
actor_rollout_ref.actor.entropy_coeff=0.001
actor_rollout_ref.model.enable_gradient_checkpointing=False
actor_rollout_ref.actor.fsdp_config.param_offload=True
actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.response_length=256
actor_rollout_ref.rollout.gpu_memory_utilization=0.5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
actor_rollout_ref.ref.fsdp_config.param_offload=True
critic.model.path={model}
critic.ppo_mini_batch_size=32
critic.ppo_micro_batch_size_per_gpu=2
algorithm.kl_ctrl.kl_coef=0.001
trainer.critic_warmup=0
trainer.logger=['console','wandb']
trainer.project_name=AgentRL
trainer.experiment_name=test_gsm8k
trainer.n_gpus_per_node=1
trainer.nnodes=1
trainer.save_freq=50
trainer.test_freq=10
trainer.total_training_steps=200
trainer.val_before_train=False
"""


def agentfly_gsm8k(model: Path, train: Path, val: Path) -> list[str]:
    args = AGENTFLY_GSM8K.format(model=model, train=train, val=val).splitlines()
    if importlib.util.find_spec("wandb") is None:  # the wandb sink needs its package installed
        args = [
            "trainer.logger=['console']" if a.startswith("trainer.logger=") else a for a in args
        ]
    return args


def cpu_size(tmp: Path) -> list[str]:
    """Appended to train a few steps on 2 CPU cores: fewer and shorter episodes, fewer steps. The
    data formats are under test, not the model: the rollout server runs the scripted engine (it
    reads, renders and scores the rows as with vLLM; rollout_service/engine/scripted.py)."""
    return [
        "rollout_server.engine=scripted",
        "trainer.total_training_steps=2",
        "trainer.resume_mode=disable",
        f"trainer.run_dir={tmp / 'run'}",
        "data.train_batch_size=2",
        "agent.num_chains=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "agent.max_tokens_per_turn=32",
        "actor_rollout_ref.rollout.response_length=96",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
        "actor_rollout_ref.rollout.max_staleness=1000",
        "rollout_server.max_concurrent_episodes=8",
        "launch.connect_timeout_s=300",
        "transport.heartbeat_timeout_s=5",
    ]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    from tools.make_tiny_data import make_tiny_data
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("assets")
    data = make_tiny_data(root / "data", train=32, val=4)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    return make_tiny_model(root / "model"), rows


def verl_parquet(path: Path, rows: list[dict[str, Any]], *, broken_at: int | None = None) -> Path:
    """verl's examples/data_preprocess layout, written with pyarrow as verl's scripts do."""
    out = []
    for i, r in enumerate(rows):
        truth: dict[str, Any] = {"style": "rule", "ground_truth": str(r["answer"])}
        if i == broken_at:
            truth = {"style": "rule", "ground_truth": None}
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": r["question"]},
                ],
                "ability": "math",
                "reward_model": truth,
                "extra_info": {"split": "train", "index": i},
            }
        )
    pq.write_table(pa.Table.from_pylist(out), path)
    return path


def agentfly_json(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps([{"question": r["question"], "answer": r["answer"]} for r in rows]))
    return path


def train(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TRAIN), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.integration
def test_check_refuses_a_broken_data_file_naming_file_row_and_field(
    assets: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    model, rows = assets
    broken = verl_parquet(tmp_path / "train.parquet", rows[:8], broken_at=5)
    out = train(
        "--check",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={broken}",
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"{broken}: row 5: field 'reward_model.ground_truth'" in out.stderr
    # bin/train itself refuses it before starting anything (no rollout server restarted on it).
    out = train(
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={broken}",
        f"trainer.run_dir={tmp_path / 'run'}",
        timeout=120,
    )
    assert out.returncode == 2 and f"{broken}: row 5" in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()
    good = verl_parquet(tmp_path / "good.parquet", rows[:8])
    out = train(
        "--check", f"actor_rollout_ref.model.path={model}", f"data.train_files={good}", timeout=120
    )
    assert out.returncode == 0, out.stderr


def verl_parquet_run(model: Path, data: Path) -> list[str]:
    """bin/train's arguments for 2 rollouts a prompt of a verl parquet on the default config."""
    return [
        "--config",
        str(REPO / "configs" / "default.yaml"),
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}",
        "data.val_files=[]",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[console]",
        "actor_rollout_ref.rollout.n=2",
    ]


@pytest.mark.e2e
def test_a_verl_parquet_trains(assets: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    model, rows = assets
    data = verl_parquet(tmp_path / "train.parquet", rows)
    out = train(
        *verl_parquet_run(model, data),
        *cpu_size(tmp_path),
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    assert steps(tmp_path / "run") == [1, 2]


@pytest.mark.e2e
def test_the_agentfly_gsm8k_example_checks_and_trains(
    assets: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    model, rows = assets
    args = agentfly_gsm8k(
        model,
        agentfly_json(tmp_path / "gsm8k_train.json", rows),
        agentfly_json(tmp_path / "gsm8k_test.json", rows[:4]),
    )
    check = train("--check", *args, timeout=120)
    assert check.returncode == 0, check.stderr
    assert "alias: agent.num_chains=8 -> actor_rollout_ref.rollout.n=8" in check.stderr
    assert "alias: agent.agent_type=hf -> data.agent_type=tool_agent" in check.stderr
    assert "-> rollout_server.reward_fn=math" in check.stderr
    out = train(*args, *cpu_size(tmp_path), timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    assert steps(tmp_path / "run") == [1, 2]


@pytest.mark.e2e
def test_verls_dapo_keys_train_together(
    assets: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """verl's keys of over-long shaping, rollout correction, dynamic sampling and LoRA, written as
    verl's DAPO recipe writes them (hydra's `+` where the recipe adds a key), pass `bin/train
    --check` and train 3 steps through one bin/train, and their metrics reach metrics.jsonl.

    The scripted engine answers in rotation with an answer, the same answer and no answer, so of a
    prompt's 2 episodes some agree on has_answer (the group is filtered) and some do not (trained).
    Its answers are longer than 4 tokens: a buffer of 8 before max_resp_len 12 penalises them."""
    model, rows = assets
    data = verl_parquet(tmp_path / "train.parquet", rows)
    overlong = "reward.reward_kwargs.overlong_buffer_cfg"
    correction = "algorithm.rollout_correction"
    recipe = [
        *verl_parquet_run(model, data),
        "reward.reward_manager.name=dapo",
        f"+{overlong}.enable=True",
        f"+{overlong}.len=8",
        f"+{overlong}.penalty_factor=0.5",
        f"+{overlong}.log=False",
        "+reward.reward_kwargs.max_resp_len=12",
        f"{correction}.rollout_is=token",
        f"{correction}.rollout_is_threshold=2.0",
        f"{correction}.rollout_rs=seq_max_k3",
        f"{correction}.rollout_rs_threshold=1000.0",
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=has_answer",
        "algorithm.filter_groups.max_num_gen_batches=0",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        "+actor_rollout_ref.model.target_modules=all-linear",
        "rollout_server.scripted_turns=['\\boxed{0}','\\boxed{0}','No answer.']",
        *cpu_size(tmp_path),
        "trainer.total_training_steps=3",
    ]
    checked = train("--check", *recipe, timeout=120)
    assert checked.returncode == 0, (checked.stdout + checked.stderr)[-5000:]
    out = train(*recipe, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["reward/overlong_frac"] > 0 and r["reward/overlong_penalty_mean"] < 0
        assert r["reward/shaped_mean"] < r["reward/mean"]
        for key in ("kl", "k3_kl", "chi2_token", "rollout_is_mean", "rollout_rs_masked_fraction"):
            assert f"rollout_corr/{key}" in r, key
        # LoRA: adapters alone are trained, and each weight update moves the adapter alone
        assert 0 < r["actor/lora_trainable_frac"] < 0.05
        assert r["weights/bytes"] == r["weights/adapter_bytes"]
        assert 0 < r["weights/bytes"] * 20 <= r["weights/full_bytes"]
    last = records[-1]
    assert last["rollout/filtered_groups"] > 0 and 0 < last["rollout/filtered_frac"] < 1
    assert last["rollout/filtered_frac/openai/gsm8k"] == last["rollout/filtered_frac"]
    assert last["rollout/waste_frac"] == 0.0  # filtered groups are not waste
    assert "filtered " in out.stdout + out.stderr  # the console's step line
