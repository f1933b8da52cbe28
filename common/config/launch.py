"""The `launch` section: how bin/train runs a whole job (learner + rollout servers), on one machine
or with its rollout servers placed on a Ray cluster's nodes (`placement: ray`).

Design: only bin/train reads it; the learner and the rollout servers it starts get the same file and
ignore it, so one config describes the job and every process in it. The GPU placement keys become
each child's ``CUDA_VISIBLE_DEVICES``, and `rollout_gpu_memory_utilization` one override on each
rollout server's command line; the rules that compare them with other sections (a rollout server's
GPUs against its tensor parallelism, the servers sharing a GPU against its memory, the learner's
GPUs against its workers) are in
`launch_issues`, which bin/train runs before anything starts (``--check`` included).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from common.config.base import Section
from common.config.errors import Issue

GpuList = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
"""CUDA ordinals of this machine (as nvidia-smi numbers them), at least one."""


class LaunchConfig(Section):
    """bin/train: the processes of one training job and how they are supervised."""

    placement: Literal["local", "ray"] = "local"
    """Where the rollout servers run. local: child processes of bin/train on this machine. ray:
    each in a placement-group bundle of the Ray cluster (ray.address, else RAY_ADDRESS, else a
    local cluster bin/train starts; the learner is pointed at the same one), started, restarted
    and stopped by bin/train through one small Ray actor per server; RUN_DIR and the checkout must
    be at the same path on every node (a shared filesystem)."""
    ray_server_cpus: float = Field(default=1.0, ge=0)
    """placement: ray. Ray CPUs of each rollout server's bundle."""
    ray_server_gpus: float | None = Field(default=None, ge=0)
    """placement: ray. Ray GPUs of each rollout server's bundle (Ray sets its CUDA_VISIBLE_DEVICES).
    null: actor_rollout_ref.rollout.tensor_model_parallel_size when the cluster has GPUs, else 0."""
    ray_server_resources: dict[str, float] = Field(default_factory=dict)
    """placement: ray. Custom Ray resources each rollout server's bundle also takes (e.g. one
    `{rollout_host: 1}` per node to allow one server per node)."""
    ray_strategy: Literal["SPREAD", "STRICT_SPREAD", "PACK"] = "SPREAD"
    """placement: ray. The placement group's strategy: SPREAD puts the servers on as many nodes as
    it can, STRICT_SPREAD on distinct nodes only, PACK on as few as possible."""
    rollout_servers: int = Field(default=2, gt=0)
    """Rollout servers to start (each gets shard i of N of the data and server id rs<i>)."""
    tool_server: bool = False
    """Also start bin/tool-server with the same config; tools.remote.url is pointed at it when it
    is null or names this machine."""
    connect_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds to wait for every rollout server to connect to the learner before the run fails."""
    max_restarts: int = Field(default=2, ge=0)
    """Restarts of each rollout server that dies (it resumes its shard) and of the tool server (on
    its port); 0: any death stops the run."""
    rollout_cpu_nice: int = Field(default=0, ge=0, le=19)
    """CPU runs (trainer.device: cpu): the niceness of each local rollout server and of its session's
    autogroup (launcher.children.yield_cpu). 19 gives the learner, the run's critical path, the cores
    whenever it computes, and the servers the rest; 0 (the default) leaves every process equal."""
    stop_timeout_s: float = Field(default=60.0, gt=0)
    """Grace between SIGTERM and SIGKILL when the processes are stopped."""
    auto_port: bool = True
    """The learner (and the tool server) bind port 0 when they bind a loopback address and report
    the port they got in RUN_DIR/events.jsonl, so two runs on one machine never collide; other
    addresses are used as configured."""
    learner_gpus: list[Annotated[int, Field(ge=0)]] | None = None
    """GPUs of the learner (CUDA ordinals of this machine), its CUDA_VISIBLE_DEVICES: its local Ray
    cluster sees only these and places one worker on each. At least trainer.n_gpus_per_node of them
    unless trainer.device is cpu; [] hides every GPU. null: inherit bin/train's environment (on one
    GPU the learner and the rollout servers share it)."""
    rollout_gpus: list[GpuList] | None = None
    """GPUs of each rollout server, its CUDA_VISIBLE_DEVICES: server i gets rollout_gpus[i % len],
    a list of exactly actor_rollout_ref.rollout.tensor_model_parallel_size GPUs; servers may share
    GPUs. null: inherit bin/train's environment (every server on the GPUs it sees, vLLM taking
    actor_rollout_ref.rollout.gpu_memory_utilization of each)."""

    rollout_gpu_memory_utilization: list[Annotated[float, Field(gt=0, le=1)]] | None = None
    """vLLM's gpu_memory_utilization of each rollout server: server i gets entry i % len, in place of
    actor_rollout_ref.rollout.gpu_memory_utilization (e.g. a small share for a server beside the
    learner on its GPU, most of the GPU for a server alone on its own). null: that key, for every
    server."""

    @field_validator("rollout_gpu_memory_utilization")
    @classmethod
    def _some_fraction(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and not value:
            raise ValueError(
                "must list at least one fraction (null: every server takes "
                "actor_rollout_ref.rollout.gpu_memory_utilization)"
            )
        return value

    @field_validator("learner_gpus")
    @classmethod
    def _distinct_learner(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError(f"must not name a GPU twice (got {value})")
        return value

    @field_validator("rollout_gpus")
    @classmethod
    def _distinct_rollout(cls, value: list[list[int]] | None) -> list[list[int]] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("must list at least one GPU list (null: inherit)")
        for i, gpus in enumerate(value):
            if len(set(gpus)) != len(gpus):
                raise ValueError(f"entry {i} names a GPU twice (got {gpus})")
        return value


def rollout_gpus_of(launch: LaunchConfig, index: int) -> list[int] | None:
    """The GPUs of rollout server `index` (None: it inherits the environment)."""
    if launch.rollout_gpus is None:
        return None
    return launch.rollout_gpus[index % len(launch.rollout_gpus)]


def rollout_memory_of(launch: LaunchConfig, index: int) -> float | None:
    """vLLM's gpu_memory_utilization of rollout server `index` (None: the rollout section's)."""
    fractions = launch.rollout_gpu_memory_utilization
    return None if fractions is None else fractions[index % len(fractions)]


def _memory_issues(config: Any) -> list[Issue]:
    """A GPU whose rollout servers together ask vLLM for more than all of its memory."""
    launch = config.launch
    if launch.rollout_gpus is None:
        return []
    default = config.actor_rollout_ref.rollout.gpu_memory_utilization
    asked: dict[int, list[tuple[int, float]]] = {}
    for i in range(launch.rollout_servers):
        fraction = rollout_memory_of(launch, i) or default
        for gpu in rollout_gpus_of(launch, i) or []:
            asked.setdefault(gpu, []).append((i, fraction))
    key = (
        "launch.rollout_gpu_memory_utilization"
        if launch.rollout_gpu_memory_utilization is not None
        else "actor_rollout_ref.rollout.gpu_memory_utilization"
    )
    issues = []
    for gpu, servers in sorted(asked.items()):
        total = sum(f for _, f in servers)
        if total > 1.0 + 1e-9:
            names = ", ".join(f"rs{i} {f:g}" for i, f in servers)
            issues.append(
                Issue(
                    key,
                    f"the rollout servers on GPU {gpu} ask vLLM for {total:g} of its memory "
                    f"({names}); together they must ask at most 1",
                    related=("launch.rollout_gpus", "launch.rollout_servers"),
                )
            )
    return issues


def launch_issues(config: Any) -> list[Issue]:
    """Every rule the `launch` section breaks against the other sections of `config` (a root
    `Config`); bin/train refuses to start on any (exit 2, like any other config error)."""
    launch, trainer, ray = config.launch, config.trainer, config.ray
    tp = config.actor_rollout_ref.rollout.tensor_model_parallel_size
    issues: list[Issue] = []
    if launch.rollout_gpus is not None:
        for i, gpus in enumerate(launch.rollout_gpus):
            if len(gpus) != tp:
                issues.append(
                    Issue(
                        f"launch.rollout_gpus.{i}",
                        f"a rollout server needs exactly actor_rollout_ref.rollout.tensor_model_parallel_size = {tp} "
                        f"GPUs (got {len(gpus)}: {gpus})",
                        related=("actor_rollout_ref.rollout.tensor_model_parallel_size",),
                    )
                )
    issues += _memory_issues(config)
    if launch.placement == "ray":
        for key in ("rollout_gpus", "learner_gpus"):
            if getattr(launch, key) is not None:
                issues.append(
                    Issue(
                        f"launch.{key}",
                        "has no effect with launch.placement = ray: Ray assigns the GPUs "
                        "(launch.ray_server_gpus per rollout server); remove it",
                        related=("launch.placement",),
                    )
                )
    gpus = launch.learner_gpus
    if gpus is not None:
        if ray.address:
            issues.append(
                Issue(
                    "launch.learner_gpus",
                    f"has no effect when the learner joins an existing Ray cluster (ray.address = {ray.address!r}): "
                    "that cluster's nodes decide the GPUs; remove it",
                    related=("ray.address",),
                )
            )
        needed = trainer.n_gpus_per_node
        if (trainer.device == "cuda" or (trainer.device == "auto" and gpus)) and len(gpus) < needed:
            workers = "trainer.n_gpus_per_node" + (" (per node)" if trainer.nnodes > 1 else "")
            issues.append(
                Issue(
                    "launch.learner_gpus",
                    f"needs at least {workers} = {needed} GPUs, one per learner worker (got {len(gpus)}: {gpus})",
                    related=("trainer.n_gpus_per_node", "trainer.device"),
                )
            )
    return issues
