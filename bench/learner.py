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

What runs inside the actors (the bound, the update call, the profile) is in
``bench/_learner_actor.py``; phase 2 in ``bench/_learner_publish.py``.

Progress lines go to stderr; the last line of stdout is one JSON object with all figures.
Run: ``.venv/bin/python bench/learner.py`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import Progress
from bench._learner_actor import (
    ablation,
    bare_setup,
    bare_update,
    cpu_seconds,
    profile_update,
    ray_all,
    torch_profile,
    update_step,
)
from bench._learner_publish import publish_phase
from learner.samples import (
    Batching,
    OldFromForward,
    Sample,
    even_chunks,
    split_for_ranks,
)
from learner.worker_settings import WorkerSettings
from tools.make_tiny_model import TinyModelSpec, make_tiny_model

# TinyModelSpec keyword arguments per --shape; vocab_size 512 is the tiny tokenizer's.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},  # TinyModelSpec's defaults: hidden 128, 2 layers, ~0.4M parameters
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 2,
    },
    # Qwen2.5-0.5B's shape, as bench/rollout.py
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "vocab_multiple": 151936,
    },
}


# lognormal sigma of --lengths longtail: p99 / median = exp(2.33 sigma) ~ 16 in theory
LONGTAIL_SIGMA = 1.2


progress = Progress("bench/learner")


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
            result["ablation"] = await ablation(
                group, plan_refs, args.epochs, args.repeat, old_from_forward
            )
            parts = await ray_all(
                group, profile_update, [(ref, args.epochs, old_from_forward) for ref in plan_refs]
            )
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
                        group,
                        torch_profile,
                        [(ref, args.epochs, bare_side, old_from_forward) for ref in plan_refs],
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
