#!/usr/bin/env python3
"""The learner's shared-prefix micro-batches against the cost of their distinct tokens.

Agentic batches repeat a long prefix in every sequence: the system prompt and the tool schemas
(the StateLM demo's segments start with the same ~1,300 of their ~1,700-2,000 tokens), and a GRPO
group repeats its whole prompt. With ``model.share_prefix`` a packed micro-batch runs that prefix
once (`learner.model.collate`). This bench times the actor's training pass (forward, PPO loss and
backward: `learner.update.actor_micro_loss` on `learner.model.PolicyHead`, the functions the FSDP
workers run, here unsharded in one process) over the same synthetic samples laid out two ways,
packed without sharing and packed with the shared prefix, alternating rounds after a warm-up
round of each. The bound is a linear-cost ideal: the unshared time x (shared row tokens / unshared
row tokens), what the shared layout would take if a micro-batch cost only its row's tokens;
ratio = bound / shared time. Below 1 is expected: each sequence's attention still reads the whole
prefix (per sequence it costs n x (prefix + n), not n x n), and the LM head and the loss run on the
same response tokens in both layouts. It also checks that both layouts give the same logprobs
(max abs difference in the JSON).

Samples: ``--samples`` sequences, each the common ``--prefix`` tokens, then a prompt tail of
``--tail`` tokens and a response of ``--response`` tokens (each uniform in [L/2, 3L/2]), in
micro-batches of ``--micro-size``. The defaults are the StateLM demo's step on the tiny model: 32
episodes' segments (its token cap, with the shared prefix counted once, holds ~25 a micro-batch).
``--device cuda`` runs it on a GPU in bf16 (FSDP's compute dtype), where packed
attention goes through the varlen kernel in both layouts, the shared one gathering each part's
keys as [prefix | part]; ``--shape 0.5b`` is Qwen2.5-0.5B's shape (bench/learner.py's shapes).
Progress goes to stderr; the last line of stdout is one JSON object. Run:
``.venv/bin/python bench/shared_prefix.py`` (``--help`` for the knobs).
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
from bench.learner import SHAPES
from learner.samples import (
    MiniBatchPlan,
    Sample,
    count_tokens,
)
from learner.worker_settings import WorkerSettings
from tools.make_tiny_model import TinyModelSpec, make_tiny_model

progress = Progress("bench/shared_prefix")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/shared_prefix.py", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--samples", type=int, default=64, help="sequences (default %(default)s)")
    p.add_argument("--micro-size", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--prefix", type=int, default=1300, help="tokens every sequence starts with")
    p.add_argument("--tail", type=int, default=200, help="mean prompt tokens after the prefix")
    p.add_argument("--response", type=int, default=350, help="mean response tokens")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds per layout (median)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default cpu)")
    p.add_argument("--shape", choices=("tiny", "small", "0.5b"), default="tiny", help="model shape")
    p.add_argument(
        "--gradient-checkpointing", action="store_true", help="as the workers' option of that name"
    )
    a = p.parse_args(argv)
    if min(a.samples, a.micro_size, a.prefix, a.tail, a.response, a.repeat, a.threads) < 1:
        p.error("every knob must be >= 1")
    return a


def make_samples(a: argparse.Namespace) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    head = rng.integers(0, 500, a.prefix)
    out = []
    for _ in range(a.samples):
        t = int(rng.integers(max(1, a.tail // 2), a.tail * 3 // 2 + 1))
        r = int(rng.integers(max(1, a.response // 2), a.response * 3 // 2 + 1))
        ids = np.concatenate([head, rng.integers(0, 500, t + r)]).astype(np.int64)
        mask = (rng.random(r) > 0.5).astype(np.float32)  # half tool output: not trained on
        s = Sample(ids, a.prefix + t, mask)
        s.old_logprobs = (-rng.random(r) * 3).astype(np.float32) * mask
        s.advantages = rng.normal(size=r).astype(np.float32) * mask
        out.append(s)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import torch

    # lazy: learner.model imports torch, verl; learner.update imports torch, verl; learner.varlen imports torch
    from learner.model import PolicyHead, collate, load_causal_lm, policy_outputs
    from learner.update import actor_micro_loss
    from learner.varlen import prefix_kernel, varlen_kernel

    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    samples = make_samples(a)
    micro = [samples[i : i + a.micro_size] for i in range(0, len(samples), a.micro_size)]
    plan = MiniBatchPlan(
        micro, count_tokens(samples), len(samples), max(s.response_len for s in samples)
    )
    settings = WorkerSettings(model_path="", entropy_coeff=0.01)
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        progress(f"writing the {a.shape} model")
        path = make_tiny_model(Path(tmp) / a.shape, TinyModelSpec(**SHAPES[a.shape]))
        lm = load_causal_lm(
            str(path), trust_remote_code=False, gradient_checkpointing=a.gradient_checkpointing
        )
    # On CUDA in bf16, as FSDP's mixed precision computes (its parameters cast to bf16): autocast
    # over fp32 parameters would leave the queries fp32 (RoPE's tables follow the fp32 embeddings)
    # and keep attention off the varlen kernel.
    policy = PolicyHead(lm).to(dev, dtype=torch.bfloat16 if cuda else None).train()
    layouts = {
        shared: [collate(m, dev, packed=True, share_prefix=shared) for m in micro]
        for shared in (False, True)
    }
    row_tokens = {k: sum(b.input_ids.numel() for b in v) for k, v in layouts.items()}
    if row_tokens[True] == row_tokens[False]:
        raise SystemExit(f"nothing was shared on {dev}: no prefix kernel (see the warning above)")
    kernel = varlen_kernel(dev) is not None if cuda else False
    prefix_path = "varlen kernel" if cuda and prefix_kernel(dev) else "per-sequence SDPA"

    def step(shared: bool) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        policy.zero_grad(set_to_none=True)
        for b in layouts[shared]:
            loss, _ = actor_micro_loss(policy, b, plan, settings, world=1)
            loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.no_grad():
        diff = max(
            float((policy_outputs(policy, u)[0] - policy_outputs(policy, s)[0]).abs().max())
            for u, s in zip(layouts[False], layouts[True], strict=True)
        )
    progress(f"row tokens unshared {row_tokens[False]:,}, shared {row_tokens[True]:,}")
    step(False), step(True)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(a.repeat):
        for shared in (False, True):
            times[shared].append(step(shared))
        progress(
            f"round {r + 1}: unshared {times[False][-1]:.2f} s, shared {times[True][-1]:.2f} s"
        )
    unshared_s, shared_s = statistics.median(times[False]), statistics.median(times[True])
    bound_s = unshared_s * row_tokens[True] / row_tokens[False]
    result = {
        "bench": "shared_prefix",
        "samples": a.samples,
        "micro_size": a.micro_size,
        "prefix": a.prefix,
        "tail": a.tail,
        "response": a.response,
        "threads": a.threads,
        "cpus": os.cpu_count(),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "shape": a.shape,
        "gradient_checkpointing": a.gradient_checkpointing,
        "unshared_attention": "varlen kernel" if kernel else "per-sequence SDPA",
        "shared_attention": prefix_path,
        "row_tokens_unshared": row_tokens[False],
        "row_tokens_shared": row_tokens[True],
        "unshared_s": round(unshared_s, 3),
        "shared_s": round(shared_s, 3),
        "speedup": round(unshared_s / shared_s, 3),
        "bound_s": round(bound_s, 3),
        "ratio": round(bound_s / shared_s, 3),
        "max_abs_logprob_diff": diff,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print(
        f"shared prefix: {shared_s:.2f} s vs {unshared_s:.2f} s unshared "
        f"(x{unshared_s / shared_s:.2f}); token-count bound {bound_s:.2f} s, "
        f"ratio {bound_s / shared_s:.3f}; logprobs differ by {diff:.1e}"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
