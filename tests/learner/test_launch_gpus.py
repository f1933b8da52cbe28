"""bin/train's GPU placement: each child's CUDA_VISIBLE_DEVICES from launch.learner_gpus /
launch.rollout_gpus, each rollout server's vLLM memory share from
launch.rollout_gpu_memory_utilization, the NVLink multicast switches every child (and the learner's
Ray workers) gets, each local rollout server's own cores for vLLM-CPU, and the config rules that
refuse a placement the learner or vLLM could not use (exit 2 naming the key)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import Config, ConfigError, load_config
from common.config.launch import launch_issues, rollout_gpus_of, rollout_memory_of
from common.multicast import multicast_env
from launcher.children import (
    LAUNCH_ID_ENV,
    MULTICAST_OFF,
    VLLM_CPU_BIND_ENV,
    child_env,
    cpu_share,
    yield_cpu,
)
from launcher.plan import check_launch, plan_run

REPO = Path(__file__).resolve().parents[2]
BASE = [
    "actor_rollout_ref.model.path=m",
    "data.train_files=t.jsonl",
    "trainer.total_training_steps=2",
]


def config(*overrides: str) -> Config:
    return load_config(None, [*BASE, *overrides], check_paths=False)


def test_child_env_sets_gpus_and_multicast_defaults() -> None:
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env = child_env("L", [2, 3], base=base)
    assert (
        env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["PATH"] == "/bin" and env[LAUNCH_ID_ENV] == "L"
    )
    assert env["PYTHONUNBUFFERED"] == "1"
    assert {k: env[k] for k in MULTICAST_OFF} == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    assert base == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # not modified
    assert child_env("L", None, base=base)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # None: inherited
    assert "CUDA_VISIBLE_DEVICES" not in child_env("L", None, base={})
    assert child_env("L", [], base=base)["CUDA_VISIBLE_DEVICES"] == ""  # []: no GPU
    # setdefault: a value the operator set wins
    assert child_env("L", None, base={"NCCL_NVLS_ENABLE": "1"})["NCCL_NVLS_ENABLE"] == "1"
    assert child_env("L")[LAUNCH_ID_ENV] == "L"  # default base: this process's environment


def test_each_local_rollout_server_gets_its_own_cores() -> None:
    assert [cpu_share(i, 2, [0, 1]) for i in range(2)] == [[0], [1]]
    assert [cpu_share(i, 2, [0, 1, 2, 3, 4]) for i in range(2)] == [[0, 1], [2, 3]]
    # fewer cores than servers: one each, round robin
    assert [cpu_share(i, 3, [4, 6]) for i in range(3)] == [[4], [6], [4]]
    assert cpu_share(0, 1, [3, 1, 2]) == [1, 2, 3]
    assert set(cpu_share(0, 1)) <= set(range(os.cpu_count() or 1))  # default: our affinity
    assert child_env("L", None, base={}, cpus=[2, 3])[VLLM_CPU_BIND_ENV] == "2,3"
    assert VLLM_CPU_BIND_ENV not in child_env("L", None, base={})
    # the operator's own binding (or "auto": vLLM's) wins
    assert (
        child_env("L", None, base={VLLM_CPU_BIND_ENV: "auto"}, cpus=[1])[VLLM_CPU_BIND_ENV]
        == "auto"
    )


@pytest.mark.integration
def test_local_rollout_servers_yield_the_cpu_to_the_learner_on_cpu_runs(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    cases = (("cpu", 19, 19), ("cuda", 19, 0), ("cpu", 0, 0))  # device, asked, got
    for device, asked, nice in cases:
        overrides = [
            *BASE,
            f"actor_rollout_ref.model.path={tmp_path / 'm'}",
            f"trainer.run_dir={tmp_path / device}",
            "launch.rollout_servers=2",
            f"launch.rollout_cpu_nice={asked}",
            f"trainer.device={device}",
        ]
        plan = plan_run(None, overrides, load_config(None, overrides, check_paths=False), None)
        assert [c.nice for c in plan.rollouts] == [nice, nice], device
        assert plan.learner.nice == 0
    # a child in its own session, as Child.start makes it: its niceness, and its session's where
    # the kernel groups by session
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        yield_cpu(proc.pid, 19)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == 19
        group = Path(f"/proc/{proc.pid}/autogroup")
        if group.exists():
            assert group.read_text().split()[-1] == "19"
    finally:
        proc.kill()
        proc.wait()


def test_rollout_gpus_wrap_around() -> None:
    cfg = config("launch.rollout_gpus=[[1],[2]]", "launch.rollout_servers=3")
    assert [rollout_gpus_of(cfg.launch, i) for i in range(3)] == [[1], [2], [1]]
    assert rollout_gpus_of(config().launch, 0) is None


def test_plan_gives_each_child_its_gpus(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    base = [*BASE, f"actor_rollout_ref.model.path={tmp_path / 'm'}"]
    overrides = [
        *base,
        f"trainer.run_dir={tmp_path / 'run'}",
        "launch.rollout_servers=3",
        "trainer.device=cuda",
        "trainer.n_gpus_per_node=2",
        "launch.learner_gpus=[0,1]",
        "launch.rollout_gpus=[[2],[3]]",
    ]
    cfg = load_config(None, overrides, check_paths=False)
    plan = plan_run(None, overrides, cfg, None)
    assert plan.learner.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in plan.rollouts] == ["2", "3", "2"]
    if VLLM_CPU_BIND_ENV not in os.environ:
        shares = [c.env[VLLM_CPU_BIND_ENV] for c in plan.rollouts]
        assert shares == [",".join(map(str, cpu_share(i, 3))) for i in range(3)]
        assert all(VLLM_CPU_BIND_ENV not in c.env for c in (plan.learner, plan.tool_server) if c)

    for c in plan.children:
        assert all(c.env[k] == os.environ.get(k, v) for k, v in MULTICAST_OFF.items())
        assert c.env[LAUNCH_ID_ENV] == plan.launch_id
    # unset: every child inherits bin/train's CUDA_VISIBLE_DEVICES (or lack of it)
    plain = [*base, f"trainer.run_dir={tmp_path / 'run2'}"]
    plan = plan_run(None, plain, load_config(None, plain, check_paths=False), None)
    for c in plan.children:
        assert c.env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_each_rollout_server_gets_its_memory_share(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    overrides = [
        *BASE,
        f"actor_rollout_ref.model.path={tmp_path / 'm'}",
        f"trainer.run_dir={tmp_path / 'run'}",
        "launch.rollout_servers=3",
        "launch.learner_gpus=[0]",
        "launch.rollout_gpus=[[0],[1]]",
        "launch.rollout_gpu_memory_utilization=[0.3,0.8]",
    ]
    plan = plan_run(None, overrides, load_config(None, overrides, check_paths=False), None)
    key = "actor_rollout_ref.rollout.gpu_memory_utilization="
    # the server's own share comes after every override of the run (the last one wins)
    assert [[a for a in c.argv if a.startswith(key)][-1] for c in plan.rollouts] == [
        f"{key}0.3",
        f"{key}0.8",
        f"{key}0.3",
    ]
    assert not any(a.startswith(key) for a in plan.learner.argv)
    for c in plan.rollouts:
        assert load_config(None, c.argv[2:], check_paths=False).launch.rollout_servers == 3
    assert [rollout_memory_of(plan.config.launch, i) for i in range(3)] == [0.3, 0.8, 0.3]
    assert rollout_memory_of(config().launch, 0) is None
    plain = [*overrides[:4], f"trainer.run_dir={tmp_path / 'run2'}"]
    plan = plan_run(None, plain, load_config(None, plain, check_paths=False), None)
    assert not any(a.startswith(key) for c in plan.rollouts for a in c.argv)


def test_servers_sharing_a_gpu_ask_at_most_all_of_it() -> None:
    shared = ("launch.rollout_servers=2", "launch.rollout_gpus=[[0],[0]]")
    ok = config(*shared, "launch.rollout_gpu_memory_utilization=[0.35,0.6]")
    assert launch_issues(ok) == []
    bad = launch_issues(config(*shared, "launch.rollout_gpu_memory_utilization=[0.5,0.6]"))
    assert [i.key for i in bad] == ["launch.rollout_gpu_memory_utilization"]
    assert "GPU 0" in bad[0].message and "rs0 0.5, rs1 0.6" in bad[0].message
    # without shares of their own, each takes the rollout section's
    bad = launch_issues(config(*shared, "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"))
    assert [i.key for i in bad] == ["actor_rollout_ref.rollout.gpu_memory_utilization"]
    assert launch_issues(config(*shared)) == []  # 2 x the default 0.3
    with pytest.raises(ConfigError):
        config("launch.rollout_gpu_memory_utilization=[]")
    with pytest.raises(ConfigError):
        config("launch.rollout_gpu_memory_utilization=[1.5]")


def test_learner_ray_workers_get_multicast_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers of a cluster joined by address do not inherit the learner's environment: the
    switches go in Ray's runtime_env too (an operator's own value wins)."""
    import ray

    from learner import workers

    seen: dict[str, object] = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    workers.init_ray("ray://elsewhere:10001", None)
    env_vars = seen["runtime_env"]["env_vars"]  # type: ignore[index]
    assert seen["address"] == "ray://elsewhere:10001"
    assert (
        {k: env_vars[k] for k in MULTICAST_OFF}
        == multicast_env()
        == {
            "NCCL_NVLS_ENABLE": "1",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ.get(
                "TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"
            ),
            "NVSHMEM_DISABLE_NVLS": "1",
        }
    )
    assert multicast_env({}) == MULTICAST_OFF


def test_placement_rules() -> None:
    assert launch_issues(config()) == []
    ok = config(
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "launch.rollout_gpus=[[0,1],[2,3]]",
        "trainer.device=cuda",
        "trainer.n_gpus_per_node=2",
        "launch.learner_gpus=[4,5,6]",
    )
    assert launch_issues(ok) == []
    bad = launch_issues(
        config(
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "launch.rollout_gpus=[[0,1],[2]]",
        )
    )
    assert [i.key for i in bad] == ["launch.rollout_gpus.1"]
    assert "tensor_model_parallel_size = 2" in bad[0].message
    bad = launch_issues(
        config("trainer.device=cuda", "trainer.n_gpus_per_node=2", "launch.learner_gpus=[0]")
    )
    assert [i.key for i in bad] == ["launch.learner_gpus"] and "n_gpus_per_node = 2" in bad[
        0
    ].message
    # auto with GPUs named needs enough of them; [] hides every GPU (auto then picks the CPU); cpu: anything
    assert launch_issues(
        config("trainer.device=auto", "trainer.n_gpus_per_node=2", "launch.learner_gpus=[0]")
    )
    assert not launch_issues(
        config("trainer.device=auto", "trainer.n_gpus_per_node=2", "launch.learner_gpus=[]")
    )
    assert not launch_issues(
        config("trainer.device=cpu", "trainer.n_gpus_per_node=2", "launch.learner_gpus=[0]")
    )
    bad = launch_issues(config("ray.address=auto", "trainer.device=cpu", "launch.learner_gpus=[0]"))
    assert [i.key for i in bad] == ["launch.learner_gpus"] and "ray.address" in bad[0].message


@pytest.mark.parametrize(
    "override, key",
    [
        ("launch.rollout_gpus=[[0,0]]", "launch.rollout_gpus"),
        ("launch.rollout_gpus=[[]]", "launch.rollout_gpus.0"),
        ("launch.rollout_gpus=[]", "launch.rollout_gpus"),
        ("launch.learner_gpus=[1,1]", "launch.learner_gpus"),
        ("launch.learner_gpus=[-1]", "launch.learner_gpus.0"),
        ("launch.rollout_gpus=[0]", "launch.rollout_gpus.0"),
    ],
)
def test_field_rules(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config(override)
    assert any(i.key == key for i in exc.value.issues), exc.value


def test_check_launch_blames_the_override() -> None:
    args = [*BASE, "trainer.device=cuda", "trainer.n_gpus_per_node=2", "launch.learner_gpus=[0]"]
    with pytest.raises(ConfigError) as exc:
        check_launch(load_config(None, args, check_paths=False), "job.yaml", args)
    (issue,) = exc.value.issues
    assert issue.source == "command line override 'launch.learner_gpus=[0]'"
    args = [*BASE, "trainer.device=cuda", "launch.learner_gpus=[]"]
    with pytest.raises(ConfigError) as exc:
        # overrides without launch.learner_gpus=[]: as if set in the file
        check_launch(load_config(None, args, check_paths=False), "job.yaml", BASE)
    assert exc.value.issues[0].source == "job.yaml"


@pytest.mark.integration
def test_bin_train_check_refuses_a_bad_placement(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bin" / "train"),
            "--config",
            str(REPO / "configs" / "default.yaml"),
            f"actor_rollout_ref.model.path={model}",
            "launch.rollout_gpus=[[0,1]]",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert "launch.rollout_gpus.0" in out.stderr and "tensor_model_parallel_size = 1" in out.stderr
