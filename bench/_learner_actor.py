"""What bench/learner.py runs inside the ``TrainWorker`` actors: the bound (a plain Hugging Face
model and AdamW beside the worker's FSDP model), the update as the trainer calls it, and the
``--profile`` views of both (per-phase laps, an ablation, torch.profiler tables).

Design: each function that takes the ``TrainWorker`` instance first is sent to every rank with
``actor.__ray_call__`` (`ray_all`), so it runs in the rank's own process, threads and device;
`ray_all` and `ablation` drive them from the bench's process. Ray pickles this module by value
(`ray_all` registers it), so the actors need not import it.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from bench._common import Progress
from learner.worker_api import UpdateRequest

progress = Progress("bench/learner")


async def ray_all(group: Any, fn: Any, args: list[tuple[Any, ...]] | None = None) -> list[Any]:
    """Run ``fn(worker, *args[r])`` inside every rank's actor and wait for all of them."""
    # lazy: ray (the bench's --help must not load it)
    import ray.cloudpickle

    # By value: the actors' interpreters need not find bench/ on their path.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    args = args or [()] * len(group.actors)
    return list(
        await asyncio.gather(
            *(a.__ray_call__.remote(fn, *args[r]) for r, a in enumerate(group.actors))
        )
    )


def _full(t: Any) -> Any:
    """A gradient norm as one tensor (FSDP2 returns a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def bare_setup(worker: Any) -> dict[str, Any]:
    """Load the plain HF model and its AdamW next to the worker's FSDP model."""
    import torch

    # lazy: learner.model imports torch, verl
    from learner.model import load_causal_lm

    s = worker.s
    # The learner's loader: the same checkpoint, dtype and attention function (plain SDPA on padded
    # micro-batches, one SDPA call per sequence on packed ones), no FSDP.
    lm = load_causal_lm(
        s.model_path, trust_remote_code=False, gradient_checkpointing=s.gradient_checkpointing
    )
    lm = lm.to(worker.device).train()
    opt = torch.optim.AdamW(lm.parameters(), lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)
    worker.bench_bare = (lm, opt)
    return {"threads": torch.get_num_threads(), "device": str(worker.device)}


def bare_micro_loss(lm: Any, b: Any, num_tokens: int, bf16: bool) -> Any:
    """Token-mean cross-entropy of the response tokens (bf16 autocast on CUDA, as FSDP's policy);
    ``b`` is a ``learner.model.MicroBatch``, packed or padded."""
    import torch

    # lazy: learner.model imports torch, verl
    from learner.model import hidden_states

    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        hidden = hidden_states(lm.get_decoder(), b.input_ids, b.attention_mask, b.packing)
        logits = lm.get_output_embeddings()(hidden[b.hidden_idx]).float()
    ce = torch.nn.functional.cross_entropy(logits, b.labels, reduction="none")
    return (ce * b.response_mask[b.response_valid]).sum() / max(num_tokens, 1)


def bare_update(worker: Any, plans: list[Any], epochs: int, packed: bool | None = None) -> float:
    """The bound: the same micro-batches, forward + backward + AdamW, nothing else, laid out as the
    plans say (``packed`` None) or as ``packed`` says (``--bound padded``). Returns the seconds
    spent inside the actor."""
    import torch

    # lazy: learner.model imports torch, verl
    from learner.model import collate

    lm, opt = worker.bench_bare
    bf16 = worker.device.type == "cuda"
    t0 = time.perf_counter()
    for _ in range(epochs):
        for plan in plans:
            opt.zero_grad(set_to_none=True)
            for micro in plan.micro_batches:
                b = collate(micro, worker.device, packed=plan.packed if packed is None else packed)
                bare_micro_loss(lm, b, plan.num_tokens, bf16).backward()
            opt.step()
    opt.zero_grad(set_to_none=True)
    if bf16:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def profile_update(
    worker: Any, plans: list[Any], epochs: int, old_from_forward: Any = None
) -> dict[str, dict[str, float]]:
    """Seconds per phase of one update: a copy of TrainWorker._update's loop (actor role), the
    PolicyHead's forward split with forward hooks on its decoder and LM head, and the same for the
    bound. Wall-clock laps, with a device sync at each boundary on CUDA."""
    import math

    import torch

    # lazy: learner.model imports torch, verl; learner.update imports torch, verl
    from learner.model import collate, set_micro_batch
    from learner.update import actor_micro_loss

    dev = worker.device

    class Clock:
        def __init__(self) -> None:
            self.parts: dict[str, float] = {}
            self.t = time.perf_counter()

        def lap(self, name: str) -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.parts[name] = self.parts.get(name, 0.0) + now - self.t
            self.t = now

    model, opt, s = worker.models["actor"], worker.optims["actor"], worker.s
    clock = Clock()
    decoder, head = model.lm.get_decoder(), model.lm.get_output_embeddings()
    hooks = [
        decoder.register_forward_pre_hook(
            lambda m, a: clock.lap("fwd: to the decoder (FSDP root pre-forward)")
        ),
        decoder.register_forward_hook(
            lambda m, a, o: clock.lap("fwd: decoder layers (incl. FSDP unshard)")
        ),
        head.register_forward_hook(lambda m, a, o: clock.lap("fwd: gather + LM head")),
    ]
    try:
        model.train()
        for _ in range(epochs):
            for p, plan in enumerate(plans):
                off_policy = mini_batch_off_policy(old_from_forward, p)
                opt.zero_grad(set_to_none=True)
                clock.lap("zero_grad")
                for i, micro in enumerate(plan.micro_batches):
                    set_micro_batch(model, i, len(plan.micro_batches))
                    b = collate(micro, dev, packed=plan.packed)
                    clock.lap("collate")
                    loss, _metrics = actor_micro_loss(model, b, plan, s, worker.world, off_policy)
                    clock.lap("fwd: logprobs + entropy + PPO loss + metrics")
                    loss.backward()
                    clock.lap("backward (incl. FSDP re-unshard, reduce-scatter)")
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
                norm = float(_full(norm))
                clock.lap("clip_grad_norm")
                if math.isfinite(norm):
                    opt.step()
                clock.lap("optimizer step")
        worker.scheds["actor"].step()
        opt.zero_grad(set_to_none=True)
        clock.lap("zero_grad")
    finally:
        for h in hooks:
            h.remove()
    ours = clock.parts

    bare_lm, bare_opt = worker.bench_bare
    bf16 = dev.type == "cuda"
    clock = Clock()
    for _ in range(epochs):
        for plan in plans:
            bare_opt.zero_grad(set_to_none=True)
            clock.lap("zero_grad")
            for micro in plan.micro_batches:
                b = collate(micro, dev, packed=plan.packed)
                clock.lap("collate")
                loss = bare_micro_loss(bare_lm, b, plan.num_tokens, bf16)
                clock.lap("forward + loss")
                loss.backward()
                clock.lap("backward")
            bare_opt.step()
            clock.lap("optimizer step")
    bare_opt.zero_grad(set_to_none=True)
    clock.lap("zero_grad")
    return {
        "update": {k: round(v, 4) for k, v in ours.items()},
        "bare": {k: round(v, 4) for k, v in clock.parts.items()},
    }


def ablation_setup(worker: Any) -> bool:
    """A second FSDP2 copy of the policy, as ``learner.model.shard`` builds it but with the other
    resharding choice (``keep_gathered``: parameters gathered from forward to backward and across
    the micro-batches of a step, or resharded after each forward and backward)."""
    import torch

    # lazy: learner.model imports torch, verl
    from learner.model import PolicyHead, load_causal_lm, shard

    s = worker.s
    lm = load_causal_lm(
        s.model_path,
        trust_remote_code=s.trust_remote_code,
        gradient_checkpointing=s.gradient_checkpointing,
    ).to(worker.device)
    head = shard(
        PolicyHead(lm, s.temperature),
        lm,
        device=worker.device,
        param_offload=False,
        bf16=worker.device.type == "cuda",
        world_size=worker.world,
        keep_gathered=not worker.models["actor"].keep_gathered,
    )
    opt = torch.optim.AdamW(head.parameters(), lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)
    worker.bench_other_reshard = (head, opt)
    return bool(head.keep_gathered)


ABLATION = {
    "update": "TrainWorker.update (actor), as timed above",
    "fsdp_ce": "the worker's FSDP PolicyHead, loss = the bound's cross-entropy (no entropy, PPO loss, "
    "metric syncs or grad clipping)",
    "other_reshard_update": "the update loop (PPO loss, entropy, metrics, clipping) on an FSDP copy "
    "with the other resharding choice (learner.model.keep_unsharded)",
    "other_reshard_ce": "that copy with the bound's cross-entropy",
    "bare": "the bound",
}


def ablation_step(
    worker: Any, plans: list[Any], epochs: int, variant: str, old_from_forward: Any = None
) -> tuple[float, float]:
    """One update of ``variant`` (see ABLATION); returns (wall, process CPU) seconds in the actor."""
    import math

    import torch

    # lazy: learner.model imports torch, verl; learner.update imports torch, verl
    from learner.model import collate, policy_outputs, set_micro_batch
    from learner.update import actor_micro_loss

    t0, c0 = time.perf_counter(), time.process_time()
    if variant == "update":
        update_step(worker, plans, epochs, old_from_forward)
    elif variant == "bare":
        bare_update(worker, plans, epochs)
    else:  # a copy of TrainWorker._update's loop (actor role)
        fsdp, opt = (
            worker.bench_other_reshard
            if variant.startswith("other_reshard")
            else (worker.models["actor"], worker.optims["actor"])
        )
        fsdp.train()
        for _ in range(epochs):
            for p, plan in enumerate(plans):
                off_policy = mini_batch_off_policy(old_from_forward, p)
                opt.zero_grad(set_to_none=True)
                for i, micro in enumerate(plan.micro_batches):
                    set_micro_batch(fsdp, i, len(plan.micro_batches))
                    b = collate(micro, worker.device, packed=plan.packed)
                    if variant.endswith("_ce"):
                        logp, _ = policy_outputs(fsdp, b)
                        loss = -(logp * b.response_mask).sum() / max(plan.num_tokens, 1)
                    else:
                        loss, _ = actor_micro_loss(
                            fsdp, b, plan, worker.s, worker.world, off_policy
                        )
                    loss.backward()
                if variant.endswith("_ce"):
                    opt.step()
                    continue
                norm = torch.nn.utils.clip_grad_norm_(fsdp.parameters(), worker.s.grad_clip)
                if math.isfinite(float(_full(norm))):
                    opt.step()
        opt.zero_grad(set_to_none=True)
    if worker.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


async def ablation(
    group: Any, plan_refs: list[Any], epochs: int, rounds: int, old_from_forward: Any = None
) -> dict[str, Any]:
    """Median wall and CPU seconds (slowest rank) of each ABLATION variant, rounds alternating."""
    await ray_all(group, ablation_setup)
    names = list(ABLATION)
    got: dict[str, list[tuple[float, float]]] = {v: [] for v in names}
    for r in range(rounds + 1):  # round 0 warms up the new copy
        for v in names if r % 2 else names[::-1]:
            res = await ray_all(
                group, ablation_step, [(ref, epochs, v, old_from_forward) for ref in plan_refs]
            )
            if r:
                got[v].append((max(w for w, _ in res), max(c for _, c in res)))
    out = {}
    for v in names:
        wall, cpu = statistics.median(w for w, _ in got[v]), statistics.median(c for _, c in got[v])
        out[v] = {
            "wall_s": round(wall, 3),
            "cpu_s": round(cpu, 3),
            "vs_bare": round(
                statistics.median(b[0] / x[0] for x, b in zip(got[v], got["bare"], strict=True)), 3
            ),
        }
        progress(
            f"ablation {v:18s} {wall:7.3f} s wall, {cpu:7.3f} s CPU, bare/this {out[v]['vs_bare']:.3f}: "
            f"{ABLATION[v]}"
        )
    return out


def cpu_seconds(worker: Any) -> float:
    """This rank's process CPU seconds, after the device has finished the work queued so far (an
    update may return with its last optimizer step still running on a GPU)."""
    if worker.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.process_time()


def torch_profile(
    worker: Any, plans: list[Any], epochs: int, bare: bool, old_from_forward: Any = None
) -> str:
    """torch.profiler table (top ops by self time) of one update, or of one bare step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = worker.device.type == "cuda"
    with profile(
        activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    ) as prof:
        if bare:
            bare_update(worker, plans, epochs)
        else:
            update_step(worker, plans, epochs, old_from_forward)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60)


def mini_batch_off_policy(old_from_forward: Any, p: int) -> Any:
    """What mini-batch ``p`` of a copied update loop passes as ``old_from_forward``, by the rule of
    ``TrainWorker._update``: only the first takes its old logprobs from its own forward."""
    if old_from_forward is None or p == 0:
        return old_from_forward
    return replace(old_from_forward, from_own_forward=False)


def update_step(worker: Any, plans: list[Any], epochs: int, old_from_forward: Any = None) -> Any:
    """TrainWorker.update of the actor, inside the actor (``plans`` arrive resolved from their
    object refs, which Ray does for top-level arguments only, not inside an UpdateRequest)."""

    return worker.update(UpdateRequest("actor", plans, epochs, old_from_forward))
