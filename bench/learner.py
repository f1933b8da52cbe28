#!/usr/bin/env python3
"""PPO update throughput of the learner's FSDP2 workers against a bare training step, and the time
to publish weights to rollout servers against memcpy.

Phase 1 (update): a ``WorkerGroup`` of ``--world`` Ray actors (``TrainWorker``, FSDP2, gloo on CPU,
NCCL and bf16 on CUDA) runs the actor update (``TrainWorker.update``) on ``split_for_ranks`` plans of synthetic samples
(prompt + response tokens, ``old_logprobs`` and ``advantages``; ``--lengths longtail`` for the
mixed lengths of agentic batches) for a Qwen2 model written locally by ``tools.make_tiny_model``
(``--shape``), in packed or padded micro-batches (``--layout``) of ``--micro-size`` samples or of at
most ``--max-tokens`` tokens. ``--old-logprobs`` and ``--ref`` add what a training step's prepare
spends before the update (`learner.step_forwards.forward_passes`): the old-logprob forward of
every sample, or of the mini-batches after the first when the update takes the first's from its own
forward; the reference forward (with a KL loss in the update). Prepare is then timed on its own and
reported against the update (``prepare_over_update``, the trainer's ``timing/prepare_s`` over
``timing/update_s``). The bound runs inside the same actors (same process, CPU share, torch threads and device), through
Ray's ``__ray_call__``: a plain Hugging Face model loaded from the same directory with the
learner's loader (no FSDP, no PPO loss), doing forward, backward and AdamW on exactly the same
micro-batches (same ``collate``: the same packing or padding; ``--bound padded`` pads them, as a
plain trainer would) with a token-mean cross-entropy on the response tokens (hidden states of the
response positions only through the LM head, as the policy head does). Tokens are prompt + response tokens of the samples, times ``--epochs``. Rounds
alternate between the two after a warm-up round of each; the median of the per-round ratios is
reported (target >= 0.8), with the CPU seconds of the busiest rank per side (wall well above CPU:
the ranks waited, for each other or for cores other processes took). ``--profile`` then finds
where a gap comes from, inside the real workers: an ablation (the worker's FSDP model with the
bound's loss; an FSDP copy with the other resharding choice), per-phase laps of a copy of
``TrainWorker._update``'s loop, and torch.profiler tables of both sides.

Phase 2 (publish): a ``LearnerServer`` process publishes the same model's weights (or
``--publish-mb`` of synthetic float32) with ``publish_weights`` to 1, 2 and 4 ``RolloutClient``
processes over ZeroMQ on TCP loopback. Timed: from the call (the learner holds the weights as numpy
arrays) to the last receiver's ``WeightsReceived`` (chunks assembled and every xxh3 checksum
verified), on the machine-wide monotonic clock; also until the learner has every WEIGHTS_APPLIED.
The bound, in the learner process of the same run: the same bytes copied N times with numpy into
preallocated buffers, one per receiver. Ratio = bound time / publish time.

Progress lines go to stderr; the last line of stdout is one JSON object with all figures.
Run: ``.venv/bin/python bench/learner.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.safetensors_buffers import load_dir
from learner.samples import (
    Batching,
    OldFromForward,
    Sample,
    even_chunks,
    split_for_ranks,
)
from learner.worker_api import UpdateRequest
from learner.worker_settings import WorkerSettings
from protocol.driver import (
    LearnerServer,
    RolloutClient,
)
from protocol.events import (
    PeerClosed,
    PeerJoined,
    PeerWeightsApplied,
    WeightsReceived,
)
from protocol.messages import Identity
from protocol.receiver import LearnerProtocol
from protocol.sender import RolloutConnection
from protocol.weights import NamedBuffer
from protocol.zmq_transport import (
    ZmqServerChannel,
    client_factory,
)
from tools.make_tiny_model import TinyModelSpec, make_tiny_model


# TinyModelSpec fields per --shape; vocab_size 512 is the tiny tokenizer's.
def _full(t: Any) -> Any:
    """A gradient norm as one tensor (FSDP2 returns a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


SHAPES: dict[str, dict[str, Any]] = {  # TinyModelSpec keyword arguments
    "tiny": {},  # TinyModelSpec's defaults: hidden 128, 2 layers, ~0.4M parameters
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 2,
    },
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "vocab_multiple": 151936,
    },  # Qwen2.5-0.5B's shape, as bench/rollout.py
}


LONGTAIL_SIGMA = (
    1.2  # lognormal sigma of --lengths longtail: p99 / median = exp(2.33 sigma) ~ 16 in theory
)


def progress(msg: str) -> None:
    print(f"[bench/learner {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/learner.py", description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="small", help="model shape (default %(default)s)"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="worker device (cuda: bf16 compute)",
    )
    p.add_argument("--world", type=int, default=1, help="training ranks (default %(default)s)")
    p.add_argument(
        "--cpus", type=int, default=os.cpu_count() or 1, help="CPUs of the local Ray cluster"
    )
    p.add_argument("--samples", type=int, default=32, help="samples per update call")
    p.add_argument(
        "--prompt-len", type=int, default=64, help="mean prompt tokens (uniform in [L/2, 3L/2])"
    )
    p.add_argument(
        "--response-len",
        type=int,
        default=192,
        help="mean response tokens (uniform in [L/2, 3L/2])",
    )
    p.add_argument(
        "--lengths",
        choices=("uniform", "longtail"),
        default="uniform",
        help="response lengths: uniform in [L/2, 3L/2], or longtail: lognormal (sigma 1.2, mean "
        "L, p99/median ~8, clipped to [8, 16L]) like agentic and reasoning batches",
    )
    p.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per epoch")
    p.add_argument(
        "--micro-size", type=int, default=4, help="samples per micro-batch (without --max-tokens)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="token-capped micro-batches of at most this many tokens (actor.use_dynamic_bsz with "
        "ppo_max_token_len_per_gpu); 0: --micro-size samples each",
    )
    p.add_argument(
        "--layout",
        choices=("packed", "padded"),
        default="packed",
        help="micro-batch layout (model.use_remove_padding true / false)",
    )
    p.add_argument(
        "--bound",
        choices=("same", "padded"),
        default="same",
        help="the bound's micro-batches: laid out as the update's, or padded (a plain padded "
        "training step: the ratio then includes what packing saves)",
    )
    p.add_argument(
        "--old-logprobs",
        choices=("none", "forward", "from-update"),
        default="none",
        help="also time the old logprobs as a training step gets them: none (the update only), "
        "forward (a separate forward pass of every sample first), from-update (the first "
        "mini-batch's from the update's own forward, a forward of the later mini-batches first; "
        "needs --epochs 1)",
    )
    p.add_argument(
        "--ref",
        action="store_true",
        help="a reference model's forward before the update and a KL loss in it (actor.use_kl_loss)",
    )
    p.add_argument("--epochs", type=int, default=1, help="PPO epochs per update call")
    p.add_argument(
        "--repeat", type=int, default=5, help="timed update rounds per side (median taken)"
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass, on both sides (as the GPU bound was measured)",
    )
    p.add_argument(
        "--profile", action="store_true", help="time the phases of one update inside the worker"
    )
    p.add_argument("--receivers", default="1,2,4", help="receiver counts for the publish phase")
    p.add_argument(
        "--publish-mb",
        type=float,
        default=0.0,
        help="publish this many MB of synthetic float32 instead of the model's weights",
    )
    p.add_argument(
        "--chunk-mb", type=float, default=64.0, help="publish_weights chunk_bytes, in MiB"
    )
    p.add_argument(
        "--publish-repeat", type=int, default=5, help="timed publishes per receiver count"
    )
    p.add_argument("--skip-update", action="store_true", help="skip phase 1")
    p.add_argument("--skip-publish", action="store_true", help="skip phase 2")
    args = p.parse_args(argv)
    if args.world < 1 or args.samples < args.world * args.mini_batches:
        p.error("need --world >= 1 and --samples >= world * mini-batches")
    if args.old_logprobs == "from-update" and args.epochs != 1:
        p.error("--old-logprobs from-update needs --epochs 1 (the trainer's rule)")
    return args


def make_model(workdir: Path, shape: str) -> tuple[Path, dict[str, Any]]:

    spec = TinyModelSpec(**SHAPES[shape])
    path = make_tiny_model(workdir / shape, spec)
    meta = json.loads((path / "tiny_model.json").read_text())
    cfg = json.loads((path / "config.json").read_text())
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    )
    return path, {"name": shape, "parameters": meta["num_parameters"], **{k: cfg[k] for k in keys}}


# -- phase 1: PPO update vs a bare training step -------------------------------------------------


def make_samples(args: argparse.Namespace, seed: int = 0) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    first = -(-args.samples // args.mini_batches)  # the first mini-batch (`even_chunks`)
    for i in range(args.samples):
        p = int(rng.integers(max(1, args.prompt_len // 2), args.prompt_len * 3 // 2 + 1))
        if args.lengths == "longtail":
            r = int(
                np.clip(
                    rng.lognormal(
                        np.log(args.response_len) - LONGTAIL_SIGMA**2 / 2, LONGTAIL_SIGMA
                    ),
                    8,
                    16 * args.response_len,
                )
            )
        else:
            r = int(rng.integers(max(1, args.response_len // 2), args.response_len * 3 // 2 + 1))
        ids = rng.integers(0, 500, p + r).astype(np.int64)
        mask = (rng.random(r) > 0.1).astype(np.float32)  # holes: tool-result tokens
        s = Sample(ids, p, mask)
        old = (-rng.random(r) * 3).astype(np.float32) * mask
        if args.old_logprobs == "from-update":  # the workers compare their own with the rollout's
            s.rollout_logprobs = old
        if args.old_logprobs != "from-update" or i >= first:  # the first's come from the update
            s.old_logprobs = old
        if args.ref:
            s.ref_logprobs = old - 0.1 * mask
        s.advantages = rng.normal(size=r).astype(np.float32) * mask
        out.append(s)
    return out


# The functions below run inside the TrainWorker actors (``actor.__ray_call__``; cloudpickle ships
# them by value). ``worker`` is the TrainWorker instance: its process, threads and device.


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


def profile_update(worker: Any, plans: list[Any], epochs: int) -> dict[str, dict[str, float]]:
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
            for plan in plans:
                opt.zero_grad(set_to_none=True)
                clock.lap("zero_grad")
                for i, micro in enumerate(plan.micro_batches):
                    set_micro_batch(model, i, len(plan.micro_batches))
                    b = collate(micro, dev, packed=plan.packed)
                    clock.lap("collate")
                    loss, _metrics = actor_micro_loss(model, b, plan, s, worker.world)
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


def ablation_step(worker: Any, plans: list[Any], epochs: int, variant: str) -> tuple[float, float]:
    """One update of ``variant`` (see ABLATION); returns (wall, process CPU) seconds in the actor."""
    import math

    import torch

    # lazy: learner.model imports torch, verl; learner.update imports torch, verl
    from learner.model import collate, policy_outputs, set_micro_batch
    from learner.update import actor_micro_loss

    t0, c0 = time.perf_counter(), time.process_time()
    if variant == "update":
        update_step(worker, plans, epochs)
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
            for plan in plans:
                opt.zero_grad(set_to_none=True)
                for i, micro in enumerate(plan.micro_batches):
                    set_micro_batch(fsdp, i, len(plan.micro_batches))
                    b = collate(micro, worker.device, packed=plan.packed)
                    if variant.endswith("_ce"):
                        logp, _ = policy_outputs(fsdp, b)
                        loss = -(logp * b.response_mask).sum() / max(plan.num_tokens, 1)
                    else:
                        loss, _ = actor_micro_loss(fsdp, b, plan, worker.s, worker.world)
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


async def ablation(group: Any, plan_refs: list[Any], epochs: int, rounds: int) -> dict[str, Any]:
    """Median wall and CPU seconds (slowest rank) of each ABLATION variant, rounds alternating."""
    await ray_all(group, ablation_setup)
    names = list(ABLATION)
    got: dict[str, list[tuple[float, float]]] = {v: [] for v in names}
    for r in range(rounds + 1):  # round 0 warms up the new copy
        for v in names if r % 2 else names[::-1]:
            res = await ray_all(group, ablation_step, [(ref, epochs, v) for ref in plan_refs])
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


def torch_profile(worker: Any, plans: list[Any], epochs: int, bare: bool) -> str:
    """torch.profiler table (top ops by self time) of one update, or of one bare step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = worker.device.type == "cuda"
    with profile(
        activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    ) as prof:
        if bare:
            bare_update(worker, plans, epochs)
        else:
            update_step(worker, plans, epochs)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60)


async def update_phase(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    import ray

    # lazy: learner.workers imports torch
    from learner.workers import WorkerGroup, init_ray

    init_ray(None, args.cpus, log_to_driver=False)
    samples = make_samples(args)
    batching = Batching(
        micro_size=args.micro_size, max_tokens=args.max_tokens, packed=args.layout == "packed"
    )
    plans = split_for_ranks(
        samples, mini_batches=args.mini_batches, ranks=args.world, batching=batching
    )
    tokens = sum(len(s.input_ids) for s in samples) * args.epochs
    # what these micro-batches would hold padded (dummies included): the cost without packing
    padded = args.epochs * sum(
        len(micro) * max(len(s.input_ids) for s in micro)
        for rank in plans
        for plan in rank
        for micro in plan.micro_batches
    )
    old_from_forward = (
        OldFromForward(is_level="token", is_cap=2.0) if args.old_logprobs == "from-update" else None
    )
    bound_packed = False if args.bound == "padded" else None
    settings = WorkerSettings(
        model_path=str(model),
        device=args.device,
        seed=1,
        gradient_checkpointing=args.gradient_checkpointing,
        need_ref=args.ref,
        use_kl_loss=args.ref,
    )
    progress(f"starting {args.world} worker(s) on {args.device}")
    t0 = time.perf_counter()
    group = WorkerGroup(settings, args.world)
    try:
        await group.start()
        bare_info = await ray_all(group, bare_setup)
        keep_gathered = bool((await ray_all(group, lambda w: w.models["actor"].keep_gathered))[0])
        start_s = time.perf_counter() - t0
        threads = [i["threads"] for i in bare_info]
        progress(
            f"workers ready in {start_s:.1f} s (torch threads per rank {threads}); "
            f"{tokens:,} tokens per update call ({padded:,} with padding)"
        )
        # Ship the plans once: both sides then read them from Ray's object store.
        plan_refs = [ray.put(p) for p in plans]

        async def timed(call: Any) -> tuple[float, float]:
            """Wall seconds seen by the driver, and the CPU seconds of the busiest rank's process
            (all its threads): wall well above CPU means the ranks waited (for each other, or for
            cores taken by other processes)."""
            c0 = await ray_all(group, cpu_seconds)
            t = time.perf_counter()
            await call()
            c1 = await ray_all(group, cpu_seconds)  # waits for the device: part of the wall time
            return time.perf_counter() - t, max(b - a for a, b in zip(c0, c1, strict=True))

        prepare_s: list[float] = []  # the prepare part of each call of `ours`

        async def ours() -> Any:
            t = time.perf_counter()
            await prepare_passes(group, args, samples, batching)
            prepare_s.append(time.perf_counter() - t)
            return await ray_all(
                group, update_step, [(ref, args.epochs, old_from_forward) for ref in plan_refs]
            )

        def bare() -> Any:
            return ray_all(
                group, bare_update, [(ref, args.epochs, bound_packed) for ref in plan_refs]
            )

        warm = (await timed(ours), await timed(bare))
        progress(
            f"warm-up: update {tokens / warm[0][0]:,.0f} tok/s, bare {tokens / warm[1][0]:,.0f} tok/s"
        )
        upd: list[tuple[float, float]] = []
        bnd: list[tuple[float, float]] = []
        for r in range(args.repeat):
            # Alternate which side goes first: a round after another runs on a warmer machine.
            if r % 2 == 0:
                upd.append(await timed(ours))
                bnd.append(await timed(bare))
            else:
                bnd.append(await timed(bare))
                upd.append(await timed(ours))
            progress(
                f"round {r}: update {tokens / upd[-1][0]:,.0f} tok/s ({upd[-1][1]:.2f} CPU s/rank), "
                f"bare {tokens / bnd[-1][0]:,.0f} tok/s ({bnd[-1][1]:.2f} CPU s/rank), "
                f"ratio {bnd[-1][0] / upd[-1][0]:.3f}"
            )
        result: dict[str, Any] = {
            "tokens_per_call": tokens,
            "padded_tokens_per_call": padded,
            "samples": args.samples,
            "prompt_len_mean": args.prompt_len,
            "response_len_mean": args.response_len,
            "mini_batches": args.mini_batches,
            "micro_size": args.micro_size,
            "epochs": args.epochs,
            "lengths": args.lengths,
            "layout": args.layout,
            "max_tokens": args.max_tokens,
            "bound": args.bound,
            "old_logprobs": args.old_logprobs,
            "keep_gathered": keep_gathered,
            # False on a GPU without a varlen attention kernel: packed micro-batches then run one
            # SDPA call per sequence (the trainer would fall back to padded ones)
            "can_pack": group.can_pack,
            "micro_batches_per_rank": len(plans[0][0].micro_batches) * len(plans[0]),
            "worker_start_s": round(start_s, 1),
            "torch_threads": threads,
            "update_tok_s": round(tokens / statistics.median(w for w, _ in upd), 1),
            "bare_tok_s": round(tokens / statistics.median(w for w, _ in bnd), 1),
            # median of per-round ratios: adjacent runs share the machine's state
            "update_ratio": round(
                statistics.median(b[0] / u[0] for u, b in zip(upd, bnd, strict=True)), 4
            ),
            "update_s_rounds": [round(w, 3) for w, _ in upd],
            "bare_s_rounds": [round(w, 3) for w, _ in bnd],
            "update_cpu_s_rounds": [round(c, 3) for _, c in upd],
            "bare_cpu_s_rounds": [round(c, 3) for _, c in bnd],
        }
        if args.old_logprobs != "none" or args.ref:
            result |= prepare_figures(args, prepare_s[1:], [w for w, _ in upd])
        if args.profile:
            result["ablation"] = await ablation(group, plan_refs, args.epochs, args.repeat)
            parts = await ray_all(group, profile_update, [(ref, args.epochs) for ref in plan_refs])
            result["profile_s"] = parts[0]
            for side in ("update", "bare"):
                total = sum(parts[0][side].values())
                progress(
                    f"phases, {side} (rank 0, {total:.2f} s): "
                    + ", ".join(
                        f"{k} {v:.3f}"
                        for k, v in sorted(parts[0][side].items(), key=lambda kv: -kv[1])
                    )
                )
            for bare_side in (False, True):
                table = (
                    await ray_all(
                        group, torch_profile, [(ref, args.epochs, bare_side) for ref in plan_refs]
                    )
                )[0]
                print(
                    f"torch.profiler, {'bare' if bare_side else 'update'} (rank 0):\n{table}",
                    file=sys.stderr,
                    flush=True,
                )
        return result
    finally:
        group.shutdown()
        ray.shutdown()


async def prepare_passes(
    group: Any, args: argparse.Namespace, samples: list[Any], batching: Any
) -> None:
    """The forwards `learner.step_forwards.forward_passes` runs before the update for these
    flags (samples shipped each time, as there): the old logprobs of every sample (``forward``) or
    of the mini-batches after the first (``from-update``), then the reference's (``--ref``)."""

    if args.old_logprobs == "forward":
        await group.forward("actor", samples, "old_logprobs", batching)
    elif args.old_logprobs == "from-update" and args.mini_batches > 1:
        parts = even_chunks(range(len(samples)), args.mini_batches)[1:]
        await group.forward("actor", samples, "old_logprobs", batching, parts=parts)
    if args.ref:
        await group.forward("ref", samples, "ref_logprobs", batching)


def prepare_figures(
    args: argparse.Namespace, prepare_s: list[float], step_s: list[float]
) -> dict[str, Any]:
    """Prepare against the update, per timed round (``step_s``: prepare + update, as timed)."""
    update_s = [s - p for p, s in zip(prepare_s, step_s, strict=True)]
    ratio = statistics.median(p / u for p, u in zip(prepare_s, update_s, strict=True))
    progress(
        f"prepare {statistics.median(prepare_s):.3f} s vs update {statistics.median(update_s):.3f} s "
        f"(median ratio {ratio:.3f}; old logprobs {args.old_logprobs}, reference {args.ref})"
    )
    return {
        "ref": args.ref,
        "prepare_s_rounds": [round(p, 3) for p in prepare_s],
        "update_only_s_rounds": [round(u, 3) for u in update_s],
        # the trainer's timing/prepare_s over timing/update_s; median of per-round ratios
        "prepare_over_update": round(ratio, 4),
    }


def update_step(worker: Any, plans: list[Any], epochs: int, old_from_forward: Any = None) -> Any:
    """TrainWorker.update of the actor, inside the actor (``plans`` arrive resolved from their
    object refs, which Ray does for top-level arguments only, not inside an UpdateRequest)."""

    return worker.update(UpdateRequest("actor", plans, epochs, old_from_forward))


async def ray_all(group: Any, fn: Any, args: list[tuple[Any, ...]] | None = None) -> list[Any]:
    """Run ``fn(worker, *args[r])`` inside every rank's actor and wait for all of them."""
    import asyncio

    args = args or [()] * len(group.actors)
    return list(
        await asyncio.gather(
            *(a.__ray_call__.remote(fn, *args[r]) for r, a in enumerate(group.actors))
        )
    )


# -- phase 2: weight publish vs memcpy ------------------------------------------------------------


def synthetic_tensor(i: int, n: int) -> Any:
    import numpy as np

    return np.random.default_rng(i).random(n, dtype=np.float32)


def synthetic_sizes(mb: float) -> list[int]:
    total, step = int(mb * 1e6) // 4, 4 << 20  # 16 MB tensors, like a model's large matrices
    return [min(step, total - start) for start in range(0, total, step)]


def publish_arrays(model: Path | None, mb: float) -> list[tuple[str, Any]]:
    """The weights to publish as numpy arrays in memory (as the workers' ``full_weights`` hands
    them over): the model's, or ``mb`` MB of deterministic synthetic float32."""
    if mb > 0:
        return [
            (f"synthetic.{i:05d}", synthetic_tensor(i, n))
            for i, n in enumerate(synthetic_sizes(mb))
        ]
    from safetensors.numpy import load_file

    assert model is not None
    return sorted(load_file(str(model / "model.safetensors")).items())


def expected_bytes(model: Path | None, mb: float) -> Any:
    """(name, bytes) of what ``publish_arrays`` holds, one tensor at a time (a receiver checks its
    copy without holding a second one): the model file memory-mapped, or regenerated."""
    if mb > 0:
        for i, n in enumerate(synthetic_sizes(mb)):
            yield f"synthetic.{i:05d}", memoryview(synthetic_tensor(i, n)).cast("B")
        return

    assert model is not None
    for t in load_dir(model):
        yield t.name, t.data


def publish_learner(
    model: Path | None, mb: float, n: int, rounds: int, chunk: int, pipe: Any
) -> None:
    import anyio
    import numpy as np

    arrays = publish_arrays(model, mb)
    buffers = [NamedBuffer(k, str(a.dtype), a.shape, memoryview(a).cast("B")) for k, a in arrays]
    nbytes = sum(a.nbytes for _, a in arrays)
    # The bound's destination: one preallocated buffer per receiver, touched once so that page
    # faults are not timed.
    dests = [np.ones(nbytes, np.uint8) for _ in range(n)]

    def memcpy() -> float:
        t = time.perf_counter()
        for d in dests:
            off = 0
            for _, a in arrays:
                flat = a.reshape(-1).view(np.uint8)
                np.copyto(d[off : off + flat.size], flat)
                off += flat.size
        return time.perf_counter() - t

    async def main() -> None:
        channel = ZmqServerChannel("tcp://127.0.0.1:0")
        # Heartbeats must survive a peer busy verifying gigabytes on a crowded machine.
        proto = LearnerProtocol(tokenizer=Identity("bench", "", 512), heartbeat_timeout_s=120.0)
        server = LearnerServer(proto, channel)
        pipe.send(channel.address)
        joined, closed = anyio.Event(), anyio.Event()
        done = {v: anyio.Event() for v in range(1, rounds + 1)}
        applied = dict.fromkeys(done, 0)
        starts: dict[int, float] = {}
        calls: dict[int, float] = {}
        acked: dict[int, float] = {}
        bound: list[float] = []

        async def watch() -> None:
            peers = gone = 0
            async for ev in server.events:
                if isinstance(ev, PeerJoined):
                    peers += 1
                    if peers == n:
                        joined.set()
                elif isinstance(ev, PeerWeightsApplied):
                    v = ev.applied.version
                    if not ev.applied.ok:
                        raise RuntimeError(f"{ev.peer_id} refused version {v}: {ev.applied.error}")
                    applied[v] += 1
                    if applied[v] == n:
                        acked[v] = time.monotonic()
                        done[v].set()
                elif isinstance(ev, PeerClosed):
                    gone += 1
                    if gone == n:
                        closed.set()

        try:
            async with anyio.create_task_group() as tg:
                await tg.start(server.run)
                tg.start_soon(watch)
                await joined.wait()  # readiness barrier: every receiver has its session
                for v in range(1, rounds + 1):
                    if v % 2:  # alternate which of the two goes first
                        bound.append(memcpy())
                    starts[v] = time.monotonic()
                    server.publish_weights(v, buffers, chunk_bytes=chunk)
                    calls[v] = (
                        time.monotonic() - starts[v]
                    )  # checksums + encoding, on the event loop
                    await done[v].wait()
                    if not v % 2:
                        bound.append(memcpy())
                await closed.wait()  # every receiver said BYE
                server.close("bench done")
                tg.cancel_scope.cancel()
        finally:
            await channel.aclose()
        pipe.send(
            {
                "starts": starts,
                "calls": calls,
                "acked": acked,
                "bound_s": bound,
                "bytes": nbytes,
                "tensors": len(buffers),
            }
        )

    anyio.run(main)


def publish_receiver(
    model: Path | None, mb: float, address: str, idx: int, rounds: int, pipe: Any
) -> None:
    import anyio

    async def main() -> None:
        conn = RolloutConnection(
            peer_id=f"bench-receiver-{idx}",
            epoch=uuid.uuid4().hex,
            model=Identity("bench", "0" * 64, 512),
            tokenizer=Identity("bench", "", 512),
            heartbeat_timeout_s=120.0,
        )
        client = RolloutClient(conn, client_factory(address))
        received: dict[int, float] = {}
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            async for ev in client.events:
                if not isinstance(ev, WeightsReceived):
                    continue
                w = ev.weights
                received[w.version] = time.monotonic()  # assembled, every checksum verified
                if w.version == 1:  # once, outside the clock: byte-compare with an independent copy
                    got = {spec.name: buf for spec, buf in w.tensors}
                    names = set()
                    for name, want in expected_bytes(model, mb):
                        assert got[name] == want, f"tensor {name} differs"
                        names.add(name)
                    assert names == set(got), sorted(names ^ set(got))
                client.weights_applied(w.version, w.transfer_id, ok=True)
                if len(received) == rounds:
                    await client.close("bench done")
        pipe.send(received)

    anyio.run(main)


def publish_round(model: Path | None, mb: float, n: int, rounds: int, chunk: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    lp, lc = ctx.Pipe()
    learner = ctx.Process(
        target=publish_learner, args=(model, mb, n, rounds, chunk, lc), daemon=True
    )
    learner.start()
    procs, pipes = [], []
    try:
        address = lp.recv()
        for i in range(n):
            rp, rc = ctx.Pipe()
            procs.append(
                ctx.Process(
                    target=publish_receiver, args=(model, mb, address, i, rounds, rc), daemon=True
                )
            )
            procs[-1].start()
            pipes.append(rp)
        got = [p.recv() for p in pipes]
        res = lp.recv()
    finally:
        for p in [*procs, learner]:
            p.join(15)
            if p.is_alive():
                p.kill()
    # Version 1 is the warm-up (connections, first-touch allocations, byte-compare).
    versions = range(2, rounds + 1)
    publish = [max(g[v] for g in got) - res["starts"][v] for v in versions]
    acked = [res["acked"][v] - res["starts"][v] for v in versions]
    bound = res["bound_s"][1:]
    b = res["bytes"]
    pub_s, bound_s = statistics.median(publish), statistics.median(bound)
    return {
        "bytes": b,
        "tensors": res["tensors"],
        "publish_s": round(pub_s, 6),
        "publish_gb_s": round(
            b / pub_s / 1e9, 3
        ),  # bytes of one copy / time to reach every receiver
        "acked_s": round(
            statistics.median(acked), 6
        ),  # until the learner has every WEIGHTS_APPLIED
        "publish_call_s": round(
            statistics.median(res["calls"][v] for v in versions), 6
        ),  # plan + checksums
        "delivered_gb_s": round(n * b / pub_s / 1e9, 3),  # all N copies
        "bound_s": round(bound_s, 6),
        "bound_gb_s": round(n * b / bound_s / 1e9, 3),  # memcpy bandwidth (all N copies)
        "ratio": round(statistics.median(bb / p for bb, p in zip(bound, publish, strict=True)), 4),
        "publish_s_rounds": [round(x, 6) for x in publish],
        "bound_s_rounds": [round(x, 6) for x in bound],
    }


def publish_phase(args: argparse.Namespace, model: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    chunk = int(args.chunk_mb * (1 << 20))
    for n in [int(x) for x in args.receivers.split(",") if x.strip()]:
        r = publish_round(model, args.publish_mb, n, args.publish_repeat + 1, chunk)
        out[str(n)] = r
        progress(
            f"publish to {n} receiver(s): {r['bytes'] / 1e6:,.1f} MB in {r['publish_s'] * 1e3:,.1f} ms "
            f"({r['publish_gb_s']:.2f} GB/s per receiver), all acked {r['acked_s'] * 1e3:,.1f} ms; "
            f"memcpy x{n} {r['bound_s'] * 1e3:,.1f} ms ({r['bound_gb_s']:.2f} GB/s); ratio {r['ratio']:.3f}"
        )
    return out


# -- main ---------------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    import numpy
    import ray
    import torch
    import transformers
    import zmq

    return {
        "torch": torch.__version__,
        "ray": ray.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "pyzmq": zmq.__version__,
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    import asyncio

    args = parse_args(argv)
    result: dict[str, Any] = {
        "bench": "learner",
        "device": args.device,
        "world": args.world,
        "cpus": os.cpu_count(),
        "ray_cpus": args.cpus,
    }
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        progress(
            f"warning: load average {load:.1f} on {os.cpu_count()} CPUs before the start: other "
            "processes share the cores, figures will be noisy"
        )
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as tmp:
        progress(f"writing the {args.shape} model")
        model, shape = make_model(Path(tmp), args.shape)
        result["shape"] = shape
        progress(f"model: {shape}")
        if not args.skip_update:
            result.update(asyncio.run(update_phase(args, model)))
        if not args.skip_publish:
            result["publish"] = publish_phase(args, model)
            result["publish_source"] = (
                f"synthetic {args.publish_mb} MB" if args.publish_mb > 0 else "model"
            )
            result["chunk_bytes"] = int(args.chunk_mb * (1 << 20))
    result["versions"] = versions()
    result["loadavg_1m"] = {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)}
    if "update_ratio" in result:
        print(
            f"PPO update {result['update_tok_s']:,.0f} tok/s vs bare step {result['bare_tok_s']:,.0f} tok/s "
            f"(ratio {result['update_ratio']:.3f}, world {args.world}, {args.device}, {args.shape}, "
            f"{args.lengths} lengths, {args.layout}, bound {args.bound}, old logprobs {args.old_logprobs})"
        )
    if "prepare_over_update" in result:
        print(
            f"prepare {statistics.median(result['prepare_s_rounds']):.3f} s vs update "
            f"{statistics.median(result['update_only_s_rounds']):.3f} s "
            f"(prepare/update {result['prepare_over_update']:.3f})"
        )
    for n, r in result.get("publish", {}).items():
        print(
            f"publish to {n}: {r['publish_s'] * 1e3:,.1f} ms ({r['publish_gb_s']:.2f} GB/s), "
            f"memcpy x{n} {r['bound_s'] * 1e3:,.1f} ms, ratio {r['ratio']:.3f}"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
