"""What bench/e2e.py runs on: the workloads (config, data set, warm-up and per-device defaults),
the random model, the data, and the warm-up with the check of its probe.

Design: everything is written into the work directory and reused by a later call that asks for the
same thing: a JSON stamp beside the model and beside the warmed model records what made it, and
anything else is written again from scratch. The warm-up runs tools/warmup.py in a child process of
its own session, bounded in time, so that its GPU memory is gone before vLLM starts; it stops on its
probe, and a probe below --min-probe raises WarmupMissed before any run is timed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._e2e_runs import kill_group
from bench._e2e_summary import progress
from tools.make_tiny_data import make_longtail_data, make_tiny_data
from tools.make_tiny_model import (
    TinyModelSpec,
    make_tiny_model,
)

ROOT = Path(__file__).resolve().parent.parent

# TinyModelSpec fields per --shape (vocab_size 512 is the tiny tokenizer's).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},  # TinyModelSpec's defaults: hidden 128, 2 layers, ~0.4M parameters
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "max_position_embeddings": 4096,
    },
}
QWEN2_VOCAB = 151936
"""Qwen2-0.5B's embedding rows (--vocab qwen2). The tokenizer has 512 ids: a random model samples the
ids above them, which the learner refuses (token ids are checked against the tokenizer's vocabulary)."""
# Overrides on the CPU: the GPU configs' settings that only a GPU runs, and a small batch.
CPU_OVERRIDES = [
    "trainer.device=cpu",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.enforce_eager=true",
    "actor_rollout_ref.rollout.compilation_config=null",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.rollout.max_num_seqs=32",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.optim.lr=3.0e-4",
    "rollout_server.max_concurrent_episodes=32",
    "ray.num_cpus=2",
]
DEADLINE_CUDA_S = 570.0
"""longtail on a GPU: the four runs fit a 10-minute command (after a --prepare-only one)."""


@dataclass(frozen=True)
class Workload:
    """What a workload runs: its config, data set, warm-up and defaults (per device: cuda, cpu)."""

    config: Path
    data: str  # folder under the work dir
    staleness: str
    steps: dict[str, int]
    timeout_s: dict[str, float]
    # tools/warmup.py's arguments besides model, data, out, steps, seconds, device, target, seed
    warmup_args: dict[str, list[str]]
    warmup_target: dict[str, float]  # the probe it stops at, and --min-probe's default
    warmup_steps: dict[str, int]
    warmup_seconds: dict[str, float]
    warm_suffix: str  # the warmed model is <model>-warm<suffix>
    warmup_data: str = "train.jsonl"  # the warm-up's rows, in the data folder
    # of the whole bench; a device not named: none
    deadline_s: dict[str, float] = field(default_factory=dict)
    cpu_overrides: list[str] = field(default_factory=list)


WORKLOADS = {
    # The long-tail set: whole right episodes (never cut: a model trained on the first turns only
    # loses its way in long contexts) of warmup.jsonl (more long chains than the workload, so that
    # every count of steps left is copied, not only the common small ones), in length-bucketed
    # batches, until the held-out probe reaches the target: the warmed model must follow long chains
    # to their end, the tail comes from its own sampling. On a GPU the target is where the runs of
    # docs/performance.md start (0.2); the caps leave room for a slower GPU to get there, and for
    # a warm-up whose kernels part from the usual path (2 of 6 H200 leases were at 0.08-0.10 after
    # 360 s, still rising): 480 s plus the model's writing fit one 10-minute device command.
    "longtail": Workload(
        config=ROOT / "configs" / "longtail_e2e.yaml",
        data="data-longtail",
        staleness="0,1,2,4",
        steps={"cuda": 10, "cpu": 4},
        timeout_s={"cuda": 240.0, "cpu": 420.0},
        warmup_args={
            d: ["--tools", "calculator", "--bucket", "--drill-weight", "1.0"]
            for d in ("cuda", "cpu")
        },
        warmup_target={"cuda": 0.2, "cpu": 0.7},
        warmup_steps={"cuda": 1500, "cpu": 3000},
        warmup_seconds={"cuda": 480.0, "cpu": 2700.0},
        warm_suffix="-longtail",
        deadline_s={"cuda": DEADLINE_CUDA_S},
        warmup_data="warmup.jsonl",
        cpu_overrides=["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
    ),
    # bin/demo's first stage: half the demonstrations call the calculator, half box a guess; stop at
    # a 0.15 chance of a whole right episode.
    "calc": Workload(
        config=ROOT / "configs" / "gpu_e2e.yaml",
        data="data",
        staleness="0,2",
        steps={"cuda": 6, "cpu": 3},
        timeout_s={"cuda": 420.0, "cpu": 420.0},
        warmup_args={d: ["--guess-fraction", "0.5"] for d in ("cuda", "cpu")},
        warmup_target={"cuda": 0.15, "cpu": 0.15},
        warmup_steps={"cuda": 1000, "cpu": 500},
        warmup_seconds={"cuda": 300.0, "cpu": 1200.0},
        warm_suffix="",
        cpu_overrides=["actor_rollout_ref.rollout.max_model_len=768"],
    ),
}


def model_spec(shape: str, vocab: str) -> Any:

    fields = dict(SHAPES[shape])
    if vocab == "qwen2":
        fields["vocab_multiple"] = QWEN2_VOCAB  # the 512-id tokenizer rounded up to 151936 rows
    return TinyModelSpec(**fields)


def write_model(out: Path, shape: str, vocab: str, dtype: str) -> Path:
    """The random model in `dtype`, reused when an earlier call wrote the same one."""
    import inspect
    from dataclasses import asdict

    spec = model_spec(shape, vocab)
    # outside the model directory: make_tiny_model refuses stray files
    stamp = out.parent / f"{out.name}.json"
    want = {"spec": asdict(spec), "dtype": dtype}
    if stamp.is_file() and (out / "model.safetensors").is_file():
        try:
            if json.loads(stamp.read_text()) == want:
                progress(f"model: reusing {out}")
                return out
        except ValueError:
            pass
    stamp.unlink(missing_ok=True)
    if out.exists():
        shutil.rmtree(out)
    progress(f"model: writing {shape} ({vocab} vocabulary, {dtype}) to {out}")
    t0 = time.monotonic()
    # tools/make_tiny_model.py's --dtype, if there
    if "dtype" in inspect.signature(make_tiny_model).parameters:
        make_tiny_model(out, spec, dtype=dtype)  # pyright: ignore[reportCallIssue]  (checked just above)
    else:
        make_tiny_model(out, spec)
    if dtype != "float32":
        convert_dtype(out, dtype)
    stamp.write_text(json.dumps(want, sort_keys=True))
    progress(
        f"model: written in {time.monotonic() - t0:.1f} s ({params_of(out) / 1e6:.0f}M parameters)"
    )
    return out


def convert_dtype(model_dir: Path, dtype: str) -> None:
    """Rewrite model.safetensors (floating tensors) and config.json's dtype in `dtype`, unless they
    already are."""
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    if all(t.dtype == target for t in tensors.values() if t.is_floating_point()):
        return
    save_file(
        {
            k: (t.to(target) if t.is_floating_point() else t).contiguous()
            for k, t in tensors.items()
        },
        str(path),
        metadata={"format": "pt"},
    )
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = dtype
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (model_dir / "tiny_model.json").unlink(missing_ok=True)  # its file hashes no longer hold


def params_of(model_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        for k in f.keys():
            size = 1
            for d in f.get_slice(k).get_shape():
                size *= d
            n += size
    return n


def write_data(out: Path, workload: str) -> Path:
    """The workload's train.jsonl / val.jsonl: reused for calc; rewritten for longtail (milliseconds,
    deterministic), so a changed generator never leaves stale rows behind."""

    if workload == "longtail":
        make_longtail_data(out)
        progress(f"data: long-tail set written to {out}")
        return out
    if (out / "train.jsonl").is_file() and (out / "val.jsonl").is_file():
        progress(f"data: reusing {out}")
        return out
    make_tiny_data(out)
    progress(f"data: written to {out}")
    return out


def file_digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def warmup_reusable(kept: Any, summary: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether a kept warm-up (its settings ``kept`` and its ``summary``) is the one ``want`` asks
    for. The step and time caps are safety stops, not settings: a warm-up that stopped at its
    target within the new caps is what a new one under them would train, so it is reused and a
    lease's minutes are not spent training it again. One stopped by a cap is reused only under the
    same caps."""
    if not isinstance(kept, dict):
        return False
    if kept == want:
        return True
    caps = ("max_steps", "cap_seconds")
    same = {k: v for k, v in kept.items() if k not in caps} == {
        k: v for k, v in want.items() if k not in caps
    }
    return (
        same
        and summary.get("stopped") == "target"
        and float(summary.get("steps", float("inf"))) <= float(want["max_steps"])
        and float(summary.get("seconds", float("inf"))) <= float(want["cap_seconds"])
    )


def run_warmup(
    model: Path, data: Path, out: Path, device: str, steps: int, seconds: float, extra: list[str]
) -> dict[str, Any]:
    """tools/warmup.py on the rows in ``data`` in a child process (its own session, bounded); reused
    when an earlier call warmed the same model on the same rows with the same settings (``extra``
    holds the seed and the target). Returns its summary."""
    want = {
        "source_model": str(model),
        "device": device,
        "max_steps": steps,
        "cap_seconds": seconds,
        "args": extra,
        "data": file_digest(data),
    }
    stamp = out.parent / f"{out.name}.json"
    if stamp.is_file() and (out / "warmup.json").is_file():
        try:
            kept = json.loads(stamp.read_text())
            if warmup_reusable(kept.get("want"), kept["summary"], want):
                progress(
                    f"warm-up: reusing {out} ({kept['summary'].get('steps')} steps, "
                    f"probe {kept['summary'].get('probe')})"
                )
                return dict(kept["summary"])
        except (ValueError, KeyError):
            pass
    stamp.unlink(missing_ok=True)
    if out.exists():
        shutil.rmtree(out)
    cmd = [
        sys.executable,
        str(ROOT / "bin" / "warmup"),
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(out),
        *extra,
        "--steps",
        str(steps),
        "--max-seconds",
        str(seconds),
        "--device",
        device,
    ]
    if device == "cuda":  # a 0.5B model from random weights: smaller steps, clipped
        cmd += ["--lr", "5e-4", "--grad-clip", "1.0"]
    progress(f"warm-up: at most {steps} steps / {seconds:g} s on {device} -> {out}")
    t0 = time.monotonic()
    limit = seconds + 180.0  # loading the model and building the demonstrations come on top
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=None, start_new_session=True, cwd=ROOT
    )
    try:
        stdout, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.wait()
        raise RuntimeError(f"warm-up did not finish within {limit:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"warm-up failed (exit status {proc.returncode}); its errors are above")
    summary = json.loads(stdout.decode().strip().splitlines()[-1])
    stamp.write_text(json.dumps({"want": want, "summary": summary}, sort_keys=True))
    progress(
        f"warm-up: {summary['steps']} steps in {time.monotonic() - t0:.1f} s (stopped: {summary['stopped']}, "
        f"probe {summary['probe']})"
    )
    return summary


class WarmupMissed(RuntimeError):
    """The warm-up's probe is below --min-probe: no run is timed on that model."""


def warm_up(
    args: argparse.Namespace, model: Path, rows: Path, device: str
) -> tuple[Path, dict[str, Any]]:
    """The warmed model (run_warmup: seeded, until the probe reaches its target) and the JSON's
    record of it: the probe, its history, what stopped it, and the probe the runs need."""
    workload = WORKLOADS[args.workload]
    warm = model.parent / f"{model.name}-warm{workload.warm_suffix}"
    extra = [
        *workload.warmup_args[device],
        "--target",
        f"{args.warmup_target:g}",
        "--seed",
        str(args.warmup_seed),
    ]
    summary = run_warmup(model, rows, warm, device, args.warmup_steps, args.warmup_seconds, extra)
    keys = (
        *("steps", "stopped", "probe", "probe_history", "seconds", "final_loss", "seed", "target"),
        *("deterministic_backward", "weights_sha256"),
    )
    return warm, {k: summary.get(k) for k in keys} | {"min_probe": args.min_probe}


def check_probe(record: dict[str, Any], warm: Path) -> None:
    """Raise WarmupMissed when the warm-up's probe is below its minimum (recorded as probe_ok)."""
    probe, least = record.get("probe"), float(record["min_probe"])
    record["probe_ok"] = least <= 0 or (probe is not None and probe >= least)
    if record["probe_ok"]:
        progress(f"warm-up: probe {probe} >= --min-probe {least:g}")
        return
    raise WarmupMissed(
        f"warm-up missed: its probe is {probe} after {record.get('steps')} steps, "
        f"{record.get('seconds')} s (stopped by {record.get('stopped')}), below --min-probe "
        f"{least:g}; no run is timed on a model less competent than the documented one. Raise "
        f"--warmup-steps / --warmup-seconds (a new warm-up replaces {warm}), try another "
        "--warmup-seed, or pass --min-probe 0 to time this model anyway"
    )
