"""The group of training workers as Ray actors: placement, rendezvous and collective calls.

Design: the trainer talks to one `WorkerGroup`; each collective step is "call the same method on
every rank with that rank's arguments and await all of them", and a failure of any rank fails the
step with that rank's error. Ray is started locally or joined (`ray.address`); each worker gets one
GPU on GPU runs, or a share of the CPUs on CPU runs, and sets its torch thread count to that share
so the ranks do not oversubscribe the cores. `forward` runs a forward-only pass over whole samples
and puts each sample's result back into its ``tokens``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from common.logging import get_logger
from learner.samples import Batching, Sample, split_forward
from learner.worker import TrainWorker, WorkerSettings


def init_ray(address: str | None, num_cpus: int | None, *, log_to_driver: bool = True) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p),
                        "TOKENIZERS_PARALLELISM": "false"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=log_to_driver)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=log_to_driver)


class WorkerGroup:
    def __init__(self, settings: WorkerSettings, world_size: int) -> None:
        import ray

        self.world = world_size
        self.log = get_logger("learner.workers")
        self.can_pack = True  # packed micro-batches pay on these workers (known after start)
        if settings.device == "cuda":
            opts: dict[str, Any] = {"num_gpus": 1, "num_cpus": 1}
        else:
            cpus = max(1.0, float(ray.cluster_resources().get("CPU", 1)))
            share = cpus / world_size
            opts = {"num_cpus": min(1.0, share)}
            if not settings.threads:
                settings = _with_threads(settings, max(1, int(share)))
        actor_cls = ray.remote(**opts)(TrainWorker)
        self.actors = [actor_cls.remote(r, world_size, settings) for r in range(world_size)]

    async def start(self) -> list[dict[str, Any]]:
        addr, port = await self.actors[0].rendezvous.remote()
        infos = await self.all("setup", [(addr, port)] * self.world)
        self.can_pack = all(await self.all("can_pack"))
        if not self.can_pack:
            self.log.warning("no varlen attention kernel on the workers' GPUs (flash-attn, or torch's "
                             "torch.nn.attention.varlen): model.use_remove_padding falls back to padded micro-batches")
        return infos

    async def all(self, method: str, args: Sequence[tuple[Any, ...]] | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank (rank r gets ``args[r]``) and wait for all of them."""
        import asyncio

        args = args or [()] * self.world
        refs = [getattr(a, method).remote(*args[r], **kwargs) for r, a in enumerate(self.actors)]
        return list(await asyncio.gather(*refs))

    async def forward(self, role: str, samples: Sequence[Sample], key: str, batching: Batching, *,
                      with_entropy: bool = False) -> None:
        """Forward-only pass of ``role`` over ``samples`` on every rank; each sample's logprobs
        (values for the critic) land in ``sample.tokens[key]``."""
        plan = split_forward(samples, ranks=self.world, batching=batching)
        per_rank = [[[samples[i] if i >= 0 else None for i in chunk] for chunk in rank] for rank in plan]
        results = await self.all("forward", [(role, chunks, with_entropy, batching.packed) for chunks in per_rank])
        out_key = "values" if role == "critic" else "logprobs"
        for rank, res in zip(plan, results, strict=True):
            real = [i for chunk in rank for i in chunk if i >= 0]
            flat = [r for chunk in res for r in chunk]
            for i, r in zip(real, flat, strict=True):
                samples[i].tokens[key] = r[out_key]

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
