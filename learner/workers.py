"""The group of training workers as Ray actors: placement, rendezvous and collective calls.

Design: the trainer talks to one `WorkerGroup`; each collective step is "call the same method on
every rank with that rank's arguments and await all of them", and a failure of any rank fails the
step with that rank's error. Ray is started locally or joined (`ray.address`); each worker gets one
GPU on GPU runs, or a share of the CPUs on CPU runs, and sets its torch thread count to that share
so the ranks do not oversubscribe the cores.

The group is a typed facade over `learner.worker.TrainWorker`: each method takes and returns the
dataclasses of `learner.worker_api`, and ``_call`` is the one place that names a worker method for
Ray (taken from the method itself, so a rename is a type error, not a runtime one). `forward` runs
a forward-only pass over whole samples and puts each sample's result into the named field.

Ray keeps an actor it cannot place pending without a word, so `start` watches the placement:
a cluster that could never hold a worker fails at the first look, and one whose free resources
stay short (taken by rollout servers placed on it, or by other jobs) fails after
``place_timeout_s``, with a warning naming the resource every ``PLACE_CHECK_S`` meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from common.logging import get_logger
from common.multicast import multicast_env
from common.ray_auth import join, start_local
from learner.samples import Batching, Sample, TokenField, split_forward
from learner.worker import TrainWorker
from learner.worker_api import (
    AdapterFileRequest,
    AdapterRequest,
    ForwardRequest,
    ForwardResult,
    Role,
    UpdateRequest,
    UpdateResult,
    WeightArray,
    WeightsFileRequest,
    WeightsFileResult,
    WeightsRequest,
    WorkerInfo,
)
from learner.worker_settings import WorkerSettings

R = TypeVar("R")

_RESOURCE = {"num_cpus": "CPU", "num_gpus": "GPU"}  # ray.remote's options -> resource names
PLACE_CHECK_S = 5.0
"""How often a worker group that has not started looks at why."""


class PlacementError(RuntimeError):
    """The learner's workers cannot be placed on the Ray cluster."""


def placement_problem(need: dict[str, float], world: int) -> tuple[str, bool] | None:
    """Why ``world`` actors needing ``need`` each may not be placed, and whether it is final (the
    cluster could never hold one); None when the free resources would hold them."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    for key, each in need.items():
        if each <= 0:
            continue
        if total.get(key, 0.0) < each:
            return (
                f"the Ray cluster has {key}={total.get(key, 0.0):g} in all, and each of the "
                f"learner's {world} workers needs {key}={each:g}",
                True,
            )
        if free.get(key, 0.0) < each:
            return (
                f"the learner's {world} workers wait for {key}: each needs {each:g}, "
                f"{free.get(key, 0.0):g} of {total.get(key, 0.0):g} are free (rollout servers "
                "placed on the cluster, launch.ray_server_cpus/gpus, or other jobs hold the rest)",
                False,
            )
    return None


def init_ray(address: str | None, num_cpus: int | None, *, log_to_driver: bool = True) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {
        "env_vars": {
            "PYTHONPATH": os.pathsep.join(
                p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p
            ),
            "TOKENIZERS_PARALLELISM": "false",
            # a cluster joined by address started its workers from its own environment
            **multicast_env(),
            # Ray starts workers at niceness 15; these are the learner's critical path, and on a
            # CPU run the rollout servers beside them yield instead (launch.rollout_cpu_nice).
            "RAY_worker_niceness": "0",
        }
    }
    address = address or os.environ.get("RAY_ADDRESS") or None  # an explicit choice of cluster
    if address:
        join(address, runtime_env=env, log_to_driver=log_to_driver)  # `ray start`'s token too
    else:
        # "local": a cluster of our own. Without it ray.init() joins whatever cluster `ray start`
        # last left running on this machine (someone else's job), and then refuses num_cpus.
        start_local(
            num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=log_to_driver
        )


class WorkerGroup:
    def __init__(
        self, settings: WorkerSettings, world_size: int, *, place_timeout_s: float = 120.0
    ) -> None:
        import ray

        self.world, self.place_timeout_s = world_size, place_timeout_s
        self.log = get_logger("learner.workers")
        self.can_pack = True  # packed micro-batches pay on these workers (known after start)
        self.can_share_prefix = True  # and may share their prefix (known after start)
        if settings.device == "cuda":
            opts: dict[str, Any] = {"num_gpus": 1, "num_cpus": 1}
        else:
            cpus = max(1.0, float(ray.cluster_resources().get("CPU", 1)))
            share = cpus / world_size
            opts = {"num_cpus": min(1.0, share)}
            if not settings.threads:
                settings = _with_threads(settings, max(1, int(share)))
        # Ray's actor handles are built at run time (method.remote(...)): typed here as Any, and
        # used only by _call and shutdown.
        self.need = {_RESOURCE[k]: float(v) for k, v in opts.items()}
        actor_cls: Any = ray.remote(**opts)(TrainWorker)
        self.actors: list[Any] = [
            actor_cls.remote(r, world_size, settings) for r in range(world_size)
        ]

    async def start(self) -> list[WorkerInfo]:
        machines = await self._placed(asyncio.gather(*(a.machine.remote() for a in self.actors)))
        method = await self.actors[0].rendezvous.remote(len(set(machines)) == 1)
        infos = await self._call(TrainWorker.setup, [(method,)] * self.world)
        self.can_pack = all(await self._call(TrainWorker.can_pack))
        self.can_share_prefix = all(await self._call(TrainWorker.can_share_prefix))
        if not self.can_pack:
            self.log.warning(
                "no varlen attention kernel on the workers' GPUs (flash-attn, or torch's "
                "torch.nn.attention.varlen): model.use_remove_padding falls back to padded micro-batches"
            )
        return infos

    async def _placed(self, ref: Any) -> Any:
        """``ref``'s result once the workers run; PlacementError when they cannot be placed."""
        started, pending = time.monotonic(), asyncio.ensure_future(ref)
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(pending), PLACE_CHECK_S)
            except TimeoutError:
                found = placement_problem(self.need, self.world)
                if found is None:
                    continue  # placed, still starting (importing torch takes a while)
                problem, final = found
                waited = time.monotonic() - started
                if final or waited >= self.place_timeout_s:
                    pending.cancel()
                    raise PlacementError(
                        problem if final else f"{problem}; gave up after {waited:.0f} s"
                    ) from None
                self.log.warning(f"workers not placed yet: {problem}", waited_s=round(waited))

    async def _call(
        self, method: Callable[..., R], args: Sequence[tuple[Any, ...]] | None = None
    ) -> list[R]:
        """Call ``method`` (a `TrainWorker` method) on every rank, rank r with ``args[r]``, and wait
        for all of them; any rank's error fails the call."""
        args = args or [()] * self.world
        refs = [getattr(a, method.__name__).remote(*args[r]) for r, a in enumerate(self.actors)]
        return list(await asyncio.gather(*refs))

    # -- the typed calls -------------------------------------------------------------------------
    async def forward_per_rank(self, requests: Sequence[ForwardRequest]) -> list[ForwardResult]:
        """Rank r runs ``requests[r]``; every request must hold as many micro-batches."""
        return await self._call(TrainWorker.forward, [(r,) for r in requests])

    async def forward(
        self,
        role: Role,
        samples: Sequence[Sample],
        key: TokenField,
        batching: Batching,
        *,
        with_entropy: bool = False,
        parts: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Forward-only pass of ``role`` over ``samples`` (only those of ``parts``, each part cut
        on its own: `split_forward`) on every rank; each sample's logprobs (values for the critic)
        land in its field ``key``. The samples travel without their per-token fields
        (`Sample.tokens_only`): a forward reads none of them."""
        plan = split_forward(samples, ranks=self.world, batching=batching, parts=parts)
        requests = [
            ForwardRequest(
                role,
                [[samples[i].tokens_only() if i >= 0 else None for i in chunk] for chunk in rank],
                with_entropy=with_entropy,
                packed=batching.packed,
                share_prefix=batching.share_prefix,
            )
            for rank in plan
        ]
        results = await self.forward_per_rank(requests)
        for rank, res in zip(plan, results, strict=True):
            real = [i for chunk in rank for i in chunk if i >= 0]
            for i, out in zip(real, res.outputs, strict=True):
                samples[i].set(key, out)

    async def update(self, requests: Sequence[UpdateRequest]) -> list[UpdateResult]:
        """One update on every rank, rank r on ``requests[r]`` (its share of each mini-batch)."""
        return await self._call(TrainWorker.update, [(r,) for r in requests])

    async def full_weights(self, req: WeightsRequest) -> list[WeightArray]:
        """The full policy, gathered to rank 0 and sent back through Ray (the chunked path)."""
        parts = await self._call(TrainWorker.full_weights, [(req,)] * self.world)
        assert parts[0] is not None  # rank 0 answers
        return parts[0]

    async def adapter_weights(self, req: AdapterRequest) -> list[WeightArray]:
        """The actor's LoRA adapter alone, gathered to rank 0 and sent back through Ray."""
        parts = await self._call(TrainWorker.adapter_weights, [(req,)] * self.world)
        assert parts[0] is not None  # rank 0 answers
        return parts[0]

    async def write_weights_file(self, req: WeightsFileRequest) -> WeightsFileResult:
        """The full policy written into a slot file by rank 0 (the file hand-over)."""
        parts = await self._call(TrainWorker.write_weights_file, [(req,)] * self.world)
        assert parts[0] is not None  # rank 0 answers
        return parts[0]

    async def write_adapter_file(self, req: AdapterFileRequest) -> WeightsFileResult:
        """The LoRA adapter alone written into a slot file by rank 0 (the file hand-over)."""
        parts = await self._call(TrainWorker.write_adapter_file, [(req,)] * self.world)
        assert parts[0] is not None  # rank 0 answers
        return parts[0]

    async def save_checkpoint(self, directory: str) -> None:
        await self._call(TrainWorker.save_checkpoint, [(directory,)] * self.world)

    async def load_checkpoint(self, directory: str) -> None:
        await self._call(TrainWorker.load_checkpoint, [(directory,)] * self.world)

    async def export_hf(self, directory: str, source_dir: str) -> None:
        """The policy as a Hugging Face model directory (written by rank 0)."""
        await self._call(TrainWorker.export_hf, [(directory, source_dir)] * self.world)

    async def stop_workers(self) -> None:
        """Leave the process group on every rank (before ``shutdown`` kills the actors)."""
        await self._call(TrainWorker.shutdown)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception as exc:  # already dead: nothing left to stop
                self.log.debug("worker already gone", error=str(exc))
        self.actors = []


def _with_threads(settings: WorkerSettings, threads: int) -> WorkerSettings:
    from dataclasses import replace

    return replace(settings, threads=threads)
