"""End-to-end step split: the whole job (bin/train: learner + rollout server) on the demo's task, run
once per ``max_staleness``, with each step's time split into wait / prepare / update / broadcast.

What it does, every stage bounded in time and reported on stderr as it goes:
1. writes the model and the data into ``--work-dir`` (kept and reused by later calls: a second
   call with the same shape skips straight to the runs): on a GPU a Qwen2-0.5B-shaped random
   model in bfloat16 (hidden 896, 24 layers, 14 / 2 heads, intermediate 4864; the tiny tokenizer),
   on the CPU the tiny model in float32; and the tiny arithmetic data (bin/make-tiny-data's);
2. warms the model up (tools/warmup.py in a child process, so its GPU memory is gone before vLLM
   starts; on CUDA with bfloat16 autocast, capped by ``--warmup-seconds``): demonstrations that
   call the calculator half of the time, as bin/demo's first stage, so episodes are multi-turn
   and some earn a reward. ``--no-warmup`` trains the random model (one-turn episodes);
3. runs ``bin/train --config configs/gpu_e2e.yaml`` once per value of ``--staleness`` (overrides:
   model, data, run directory, steps, ``actor_rollout_ref.rollout.max_staleness``; on the CPU also
   the device, dtype, eager mode and small batches), each in its own session and bounded by
   ``--timeout-s``: past it bin/train gets SIGTERM (it stops its children), then its group gets
   SIGKILL, then every process still carrying this bench's marker in its environment (the
   children run in sessions of their own) is killed;
4. reads each run's RUN_DIR/metrics.jsonl and prints, per run, the mean over the steps after the
   first (step 1 pays the start-up: compilation, first weight load) of timing/wait_s, prepare_s,
   update_s, broadcast_s, step_s and perf/tokens_per_s, the reward and turns-per-episode curves,
   staleness and drops, and every ``weights/*`` metric the learner logs; a table on stderr, one
   JSON line on stdout (also written to ``--results``, after every run, so a run cut short still
   leaves the earlier ones).

Exit status 0 when every run finished all its steps, 1 otherwise (the JSON says which and why,
with the tail of the failed run's log), 2 on bad arguments.

    python3 bench/e2e.py                          # GPU: auto-detected, ~6-8 minutes on one H100
    .venv/bin/python bench/e2e.py --steps 3       # CPU: the tiny model, ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "gpu_e2e.yaml"
MARKER_ENV = "AGENTRL_E2E_BENCH_ID"
"""Set in bin/train's environment; every process of a run inherits it (the final sweep's key)."""
TIMINGS = ("timing/wait_s", "timing/prepare_s", "timing/update_s", "timing/broadcast_s", "timing/step_s",
           "perf/tokens_per_s")
EXTRA_MEANS = ("staleness/mean", "staleness/max", "intake/dropped_stale", "response/length_mean",
               "perf/update_tokens_per_s", "actor/entropy")
# TinyModelSpec fields per --shape (vocab_size 512 is the tiny tokenizer's).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},  # TinyModelSpec's defaults: hidden 128, 2 layers, ~0.4M parameters
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
             "max_position_embeddings": 4096},
}
QWEN2_VOCAB = 151936
"""Qwen2-0.5B's embedding rows (--vocab qwen2). The tokenizer has 512 ids: a random model samples the
ids above them, which the learner refuses (token ids are checked against the tokenizer's vocabulary)."""
# Overrides on the CPU: configs/gpu_e2e.yaml's settings that only a GPU runs, and a small batch.
CPU_OVERRIDES = [
    "trainer.device=cpu", "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.enforce_eager=true",
    "actor_rollout_ref.rollout.compilation_config=null", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false", "actor_rollout_ref.rollout.max_num_seqs=32",
    "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=3.0e-4",
    "actor_rollout_ref.rollout.max_model_len=768", "rollout_server.max_concurrent_episodes=32", "ray.num_cpus=2",
]
STOP_GRACE_S = 60.0
T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[e2e {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="e2e", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="training steps per run (default %(default)s)")
    p.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "e2e",
                   help="model, data and runs; kept and reused (default %(default)s)")
    p.add_argument("--staleness", default="0,2", help="comma-separated max_staleness values, one run each "
                   "(default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=420.0, help="wall-clock limit of each run (default %(default)s)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda when torch sees a GPU (default %(default)s)")
    p.add_argument("--shape", choices=("auto", *SHAPES), default="auto",
                   help="model shape; auto: 0.5b on cuda, tiny on the CPU (default %(default)s)")
    p.add_argument("--vocab", choices=("tokenizer", "qwen2"), default="tokenizer",
                   help="model vocabulary: the tokenizer's 512 ids, or Qwen2's 151936 rows (the full 494M "
                        "parameters; only once the learner accepts ids the tokenizer lacks) (default %(default)s)")
    p.add_argument("--no-warmup", action="store_true", help="train the random model (episodes stay one turn)")
    p.add_argument("--warmup-seconds", type=float, default=60.0,
                   help="cap of the warm-up's training loop (default %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="cap of the warm-up's steps (default: 300 on cuda, 500 on the CPU)")
    p.add_argument("--config", type=Path, default=CONFIG, help="bin/train config (default %(default)s)")
    p.add_argument("--results", type=Path, default=None,
                   help="also write the JSON result here, after every run (default WORK/e2e-results.json)")
    p.add_argument("--save-logs", type=Path, default=None,
                   help="copy each run's metrics.jsonl, resolved config and log tails here (e.g. $OUT/e2e)")
    p.add_argument("--prepare-only", action="store_true", help="write model, data and warm-up, then stop")
    p.add_argument("overrides", nargs="*", help="more key=value overrides for bin/train (every run)")
    a = p.parse_args(argv)
    try:
        a.staleness_values = [int(x) for x in a.staleness.split(",") if x.strip()]
    except ValueError:
        p.error(f"--staleness must be comma-separated integers (got {a.staleness!r})")
    if not a.staleness_values or any(s < 0 for s in a.staleness_values):
        p.error("--staleness needs at least one value >= 0")
    if a.steps < 1:
        p.error("--steps must be >= 1")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        p.error(f"overrides must be key=value (got {bad})")
    return a


def resolve_device(asked: str) -> str:
    if asked != "auto":
        return asked
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gpu_names() -> list[str]:
    """The GPUs nvidia-smi lists (not through torch: a CUDA context here would hold GPU memory for
    the whole bench)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"nvidia-smi failed: {e}"]


# ---------------------------------------------------------------- model and data


def model_spec(shape: str, vocab: str) -> Any:
    from tools.make_tiny_model import TinyModelSpec

    fields = dict(SHAPES[shape])
    if vocab == "qwen2":
        fields["vocab_multiple"] = QWEN2_VOCAB  # the 512-id tokenizer rounded up to 151936 rows
    return TinyModelSpec(**fields)


def write_model(out: Path, shape: str, vocab: str, dtype: str) -> Path:
    """The random model in `dtype`, reused when an earlier call wrote the same one."""
    import inspect
    from dataclasses import asdict

    from tools.make_tiny_model import make_tiny_model

    spec = model_spec(shape, vocab)
    stamp = out.parent / f"{out.name}.json"  # outside the model directory: make_tiny_model refuses stray files
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
    if "dtype" in inspect.signature(make_tiny_model).parameters:  # tools/make_tiny_model.py's --dtype, if there
        make_tiny_model(out, spec, dtype=dtype)
    else:
        make_tiny_model(out, spec)
    if dtype != "float32":
        convert_dtype(out, dtype)
    stamp.write_text(json.dumps(want, sort_keys=True))
    progress(f"model: written in {time.monotonic() - t0:.1f} s ({params_of(out) / 1e6:.0f}M parameters)")
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
    save_file({k: (t.to(target) if t.is_floating_point() else t).contiguous() for k, t in tensors.items()},
              str(path), metadata={"format": "pt"})
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


def write_data(out: Path) -> Path:
    from tools.make_tiny_data import make_tiny_data

    if (out / "train.jsonl").is_file() and (out / "val.jsonl").is_file():
        progress(f"data: reusing {out}")
        return out
    make_tiny_data(out)
    progress(f"data: written to {out}")
    return out


def run_warmup(model: Path, data: Path, out: Path, device: str, steps: int, seconds: float) -> dict[str, Any]:
    """tools/warmup.py in a child process (its own session, bounded); reused when an earlier call
    warmed the same model with the same settings. Returns its summary."""
    want = {"source_model": str(model), "device": device, "max_steps": steps, "cap_seconds": seconds}
    stamp = out.parent / f"{out.name}.json"
    if stamp.is_file() and (out / "warmup.json").is_file():
        try:
            kept = json.loads(stamp.read_text())
            if kept.get("want") == want:
                progress(f"warm-up: reusing {out} ({kept['summary'].get('steps')} steps, "
                         f"probe {kept['summary'].get('probe')})")
                return dict(kept["summary"])
        except (ValueError, KeyError):
            pass
    stamp.unlink(missing_ok=True)
    if out.exists():
        shutil.rmtree(out)
    # bin/demo's first stage: half the demonstrations call the calculator, half box a guess; stop at
    # a 0.15 chance of a whole right episode. A 0.5B model from random weights: smaller steps, clipped.
    cmd = [sys.executable, str(ROOT / "bin" / "warmup"), "--model", str(model), "--data", str(data / "train.jsonl"),
           "--out", str(out), "--guess-fraction", "0.5", "--target", "0.15", "--steps", str(steps),
           "--max-seconds", str(seconds), "--device", device]
    if device == "cuda":
        cmd += ["--lr", "5e-4", "--grad-clip", "1.0"]
    progress(f"warm-up: at most {steps} steps / {seconds:g} s on {device} -> {out}")
    t0 = time.monotonic()
    limit = seconds + 180.0  # loading the model and building the demonstrations come on top
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, start_new_session=True, cwd=ROOT)
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
    progress(f"warm-up: {summary['steps']} steps in {time.monotonic() - t0:.1f} s (stopped: {summary['stopped']}, "
             f"probe {summary['probe']})")
    return summary


# ---------------------------------------------------------------- runs


def preflight(args: argparse.Namespace, overrides: list[str]) -> None:
    """``bin/train --check`` with every override the runs will get (the model path pointed at an
    existing directory): a config mistake fails here, in seconds, not after the warm-up."""
    cmd = [sys.executable, str(ROOT / "bin" / "train"), "--config", str(args.config), *overrides,
           f"trainer.total_training_steps={args.steps}",
           f"actor_rollout_ref.rollout.max_staleness={max(args.staleness_values)}", *args.overrides, "--check"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise RuntimeError("bin/train --check did not answer within 120 s") from None
    if out.returncode != 0:
        raise RuntimeError(f"bin/train --check refuses the config (exit status {out.returncode}):\n"
                           f"{out.stderr.strip()[-3000:]}")
    progress("config: bin/train --check passes")


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def sweep(marker: str) -> list[int]:
    """SIGKILL every process (but us) whose environment carries this bench run's marker."""
    import psutil

    killed = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(MARKER_ENV) == marker:
                p.kill()
                killed.append(p.pid)
        except psutil.Error:
            continue
    return killed


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The per-step records of metrics.jsonl (a half-written last line is skipped)."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "timing/step_s" in rec:
            out.append(rec)
    by_step = {int(r["step"]): r for r in out}  # a step logged twice: the later record counts
    return [by_step[s] for s in sorted(by_step)]


def tail(path: Path, lines: int = 30) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 32 * 1024))
            return "\n".join(f.read().decode("utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_train(args: argparse.Namespace, staleness: int, overrides: list[str], work: Path) -> dict[str, Any]:
    run_dir = work / f"run-s{staleness}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    log = work / f"run-s{staleness}.train.log"
    marker = uuid.uuid4().hex
    cmd = [sys.executable, str(ROOT / "bin" / "train"), "--config", str(args.config), *overrides,
           f"trainer.run_dir={run_dir}", f"trainer.total_training_steps={args.steps}",
           f"actor_rollout_ref.rollout.max_staleness={staleness}", *args.overrides]
    env = dict(os.environ, **{MARKER_ENV: marker})
    progress(f"run max_staleness={staleness}: bin/train, {args.steps} steps, limit {args.timeout_s:g} s, "
             f"logs {run_dir / 'logs'}")
    t0 = time.monotonic()
    result: dict[str, Any] = {"max_staleness": staleness, "run_dir": str(run_dir), "steps_asked": args.steps}
    seen = 0
    first_step_at = None
    timed_out = False
    refused = RefusalWatch(run_dir / "logs" / "learner.log")
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)
        try:
            deadline = t0 + args.timeout_s
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                if refused.poll() and seen == 0:
                    result["refused"] = refused.first
                    progress(f"  s={staleness}: the learner refuses the rollout server's batches "
                             f"({refused.count} times; no step done), giving up: {refused.first}")
                    break
                records = read_metrics(run_dir / "metrics.jsonl")
                for r in records[seen:]:
                    if first_step_at is None:
                        first_step_at = time.monotonic() - t0
                    progress(f"  s={staleness} step {r['step']}/{args.steps}: reward {r.get('reward/mean', float('nan')):.3f} "
                             f"turns {r.get('episode/turns_mean', float('nan')):.2f}  step {r['timing/step_s']:.2f} s "
                             f"(wait {r.get('timing/wait_s', 0):.2f} prep {r.get('timing/prepare_s', 0):.2f} "
                             f"upd {r.get('timing/update_s', 0):.2f} bcast {r.get('timing/broadcast_s', 0):.2f})")
                seen = max(seen, len(records))
                time.sleep(1.0)
        finally:
            if proc.poll() is None:  # timed out, or this bench was interrupted
                progress(f"  s={staleness}: stopping bin/train (SIGTERM, {STOP_GRACE_S:g} s grace)")
                kill_group(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    kill_group(proc.pid)
                    proc.wait()
            kill_group(proc.pid)  # anything left in its group
            if stray := sweep(marker):
                progress(f"  s={staleness}: killed {len(stray)} stray processes of the run")
    wall = time.monotonic() - t0
    records = read_metrics(run_dir / "metrics.jsonl")
    result |= {"exit_status": proc.returncode, "timed_out": timed_out, "wall_s": round(wall, 1),
               "first_step_after_s": round(first_step_at, 1) if first_step_at is not None else None}
    result |= summarize(records)
    result["weight_updates"] = weight_updates(records, run_dir / "logs")
    result["ok"] = not timed_out and proc.returncode == 0 and result["steps_done"] >= args.steps
    if not result["ok"]:
        why = f"timed out after {args.timeout_s:g} s" if timed_out else f"bin/train exit status {proc.returncode}"
        if "refused" in result:
            why = f"the learner refused every batch ({result['refused']})"
        result["error"] = f"{why}, {result['steps_done']}/{args.steps} steps"
        result["log_tail"] = tail(log)
        progress(f"  s={staleness}: FAILED ({result['error']}); bin/train's output ends:\n{result['log_tail']}")
    else:
        progress(f"  s={staleness}: done in {wall:.1f} s")
    if args.save_logs is not None:
        save_logs(args.save_logs / f"run-s{staleness}", run_dir, log)
    return result


class RefusalWatch:
    """Counts the learner's "invalid message" warnings (a batch it refused: e.g. token ids outside the
    tokenizer's vocabulary). A run whose every batch is refused never takes a step: better to stop
    it at once than to wait out its time limit."""

    LIMIT = 20

    def __init__(self, log: Path) -> None:
        self.log, self.pos, self.count, self.first = log, 0, 0, ""

    def poll(self) -> bool:
        try:
            with self.log.open("rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except OSError:
            return False
        end = chunk.rfind(b"\n") + 1  # whole lines only
        self.pos += end
        for line in chunk[:end].decode("utf-8", errors="replace").splitlines():
            if "invalid message" in line:
                self.count += 1
                if not self.first:
                    self.first = line.split("invalid message", 1)[1].strip()[:300]
        return self.count >= self.LIMIT


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the steps after the first (all of them when there is only one), curves, weights/*."""
    out: dict[str, Any] = {"steps_done": len(records)}
    if not records:
        return out
    body = records[1:] or records
    out["mean_over_steps"] = [int(r["step"]) for r in body]

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in body if isinstance(r.get(key), (int, float))]
        return round(sum(vals) / len(vals), 4) if vals else None

    out["means"] = {k: mean(k) for k in (*TIMINGS, *EXTRA_MEANS)}
    weight_keys = sorted({k for r in records for k in r if k.startswith("weights/")})
    out["weights"] = {k: mean(k) for k in weight_keys}
    out["step1"] = {k: (round(float(records[0][k]), 4) if k in records[0] else None) for k in TIMINGS}
    out["reward_curve"] = [round(float(r.get("reward/mean", float("nan"))), 4) for r in records]
    out["turns_curve"] = [round(float(r.get("episode/turns_mean", float("nan"))), 3) for r in records]
    turns = [float(r["episode/turns_mean"]) for r in records if "episode/turns_mean" in r]
    out["turns_mean"] = round(sum(turns) / len(turns), 3) if turns else None
    return out


APPLIED = re.compile(r"weights applied.*?reload_s=([0-9.]+).*?version=(\d+)")


def weight_updates(records: list[dict[str, Any]], logs: Path) -> dict[str, Any]:
    """Each weight update end to end against its bound, both from this run. End to end
    (``weights/applied_s``): from the learner starting to gather version v until every rollout
    server generates with it. Bound: the bare ``reload_weights`` of that same file inside the
    rollout server (``reload_s`` in its "weights applied" log line; slowest server) plus the
    learner's device-to-host copy of the weights at its best speed in the run (``weights/copy_s``
    of a publish into a slot file whose pages already exist; the first publishes into each new
    file also pay for faulting its pages in, which the end-to-end time includes)."""
    reload: dict[int, float] = {}
    for log in sorted(logs.glob("*.log")):
        for m in APPLIED.finditer(log.read_text(errors="replace")):
            v = int(m.group(2))
            reload[v] = max(reload.get(v, 0.0), float(m.group(1)))
    copy = {int(r["step"]): float(r["weights/copy_s"]) for r in records if "weights/copy_s" in r}
    rows = []
    for r in records:
        if "weights/applied_s" not in r:
            continue
        v = int(r["weights/version"])
        if v in reload and copy:
            bound = reload[v] + min(copy.values())
            rows.append({"version": v, "applied_s": round(float(r["weights/applied_s"]), 4),
                         "reload_s": reload[v], "d2h_s": round(min(copy.values()), 4), "bound_s": round(bound, 4),
                         "ratio": round(float(r["weights/applied_s"]) / bound, 3)})
    if not rows:
        return {"versions": []}
    return {"versions": rows, "median_applied_s": statistics.median(x["applied_s"] for x in rows),
            "median_bound_s": statistics.median(x["bound_s"] for x in rows),
            "median_ratio": statistics.median(x["ratio"] for x in rows)}


def save_logs(dest: Path, run_dir: Path, train_log: Path, max_bytes: int = 2 * 1024 * 1024) -> None:
    """Copy what explains a run (metrics, resolved config, the tail of every log) to `dest`."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        files = [run_dir / "metrics.jsonl", run_dir / "config.resolved.yaml", train_log,
                 *sorted((run_dir / "logs").glob("*"))]
        for f in files:
            if not f.is_file():
                continue
            with f.open("rb") as src:
                src.seek(max(0, f.stat().st_size - max_bytes))
                (dest / f.name).write_bytes(src.read())
    except OSError as e:
        progress(f"could not copy the logs to {dest}: {e}")


# ---------------------------------------------------------------- report


def fmt(v: Any, width: int = 9) -> str:
    if v is None:
        return "-".rjust(width)
    if isinstance(v, float):
        return (f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3f}").rjust(width)
    return str(v).rjust(width)


def table(runs: list[dict[str, Any]]) -> str:
    cols = [("wait", "timing/wait_s"), ("prepare", "timing/prepare_s"), ("update", "timing/update_s"),
            ("bcast", "timing/broadcast_s"), ("step", "timing/step_s"), ("tok/s", "perf/tokens_per_s"),
            ("stale", "staleness/mean"), ("dropped", "intake/dropped_stale")]
    head = "staleness  steps " + "".join(n.rjust(9) for n, _ in cols) + "    turns"
    lines = ["mean over steps 2.. (seconds unless named):", head]
    for r in runs:
        means = r.get("means", {})
        row = f"{r['max_staleness']:>9}  {r.get('steps_done', 0):>5} " + "".join(fmt(means.get(k)) for _, k in cols)
        row += fmt(r.get("turns_mean"))
        if not r.get("ok"):
            row += f"   FAILED: {r.get('error')}"
        lines.append(row)
    for r in runs:
        lines.append(f"s={r['max_staleness']}: reward {r.get('reward_curve')}  turns {r.get('turns_curve')}  "
                     f"step 1 {fmt((r.get('step1') or {}).get('timing/step_s')).strip()} s, first step after "
                     f"{r.get('first_step_after_s')} s, wall {r.get('wall_s')} s")
        if (wu := r.get("weight_updates") or {}).get("versions"):
            lines.append(f"s={r['max_staleness']}: weight update end to end vs bound (reload_weights + D2H, same "
                         f"run): median {wu['median_applied_s']:.3f} s vs {wu['median_bound_s']:.3f} s, ratio "
                         f"{wu['median_ratio']:.2f}; per version " + ", ".join(
                             f"v{x['version']} {x['applied_s']:.3f}/{x['bound_s']:.3f}" for x in wu["versions"]))
        if r.get("weights"):
            lines.append(f"s={r['max_staleness']}: " + "  ".join(
                f"{k.removeprefix('weights/')} {fmt(v).strip()}" for k, v in r["weights"].items()))
    return "\n".join(lines)


def write_results(path: Path, result: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(result, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as e:
        progress(f"could not write {path}: {e}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    results_path = args.results or work / "e2e-results.json"
    result: dict[str, Any] = {"bench": "e2e", "ok": False, "runs": []}
    try:
        device = resolve_device(args.device)
        shape = args.shape if args.shape != "auto" else ("0.5b" if device == "cuda" else "tiny")
        dtype = "bfloat16" if device == "cuda" else "float32"
        result |= {"device": device, "shape": shape, "vocab": args.vocab, "dtype": dtype, "steps": args.steps,
                   "config": str(args.config), "overrides": args.overrides}
        if device == "cuda":
            result["gpus"] = gpu_names()
        progress(f"device {device}, shape {shape}, dtype {dtype}, staleness {args.staleness_values}, "
                 f"{args.steps} steps per run, work dir {work}")
        data_overrides = [f"data.train_files={work / 'data' / 'train.jsonl'}",
                          f"data.val_files={work / 'data' / 'val.jsonl'}"]
        device_overrides = CPU_OVERRIDES if device == "cpu" else []
        preflight(args, [f"actor_rollout_ref.model.path={work}", *data_overrides, *device_overrides])
        model = write_model(work / f"model-{shape}-{args.vocab}-{dtype}", shape, args.vocab, dtype)
        result["parameters"] = params_of(model)
        data = write_data(work / "data")
        if not args.no_warmup:
            steps = args.warmup_steps or (300 if device == "cuda" else 500)
            summary = run_warmup(model, data, work / f"{model.name}-warm", device, steps, args.warmup_seconds)
            result["warmup"] = {k: summary.get(k) for k in ("steps", "stopped", "probe", "seconds", "final_loss")}
            model = work / f"{model.name}-warm"
        result["model"] = str(model)
        if args.prepare_only:
            result["ok"] = True
            return finish(result, results_path)
        overrides = [f"actor_rollout_ref.model.path={model}", *data_overrides, *device_overrides]
        for i, s in enumerate(args.staleness_values):
            result["runs"].append(run_train(args, s, overrides, work))
            write_results(results_path, result)
            if i + 1 < len(args.staleness_values):  # the last table comes with the result
                progress("\n" + table(result["runs"]))
        result["ok"] = all(r.get("ok") for r in result["runs"])
    except KeyboardInterrupt:
        result["error"] = "interrupted"
        progress("interrupted")
    except Exception as e:  # reported in the JSON line: the caller may only see stdout
        result["error"] = f"{type(e).__name__}: {e}"
        progress(f"error: {result['error']}")
    return finish(result, results_path)


def finish(result: dict[str, Any], results_path: Path) -> int:
    result["wall_s"] = round(time.monotonic() - T0, 1)
    if result["runs"]:
        print(table(result["runs"]), file=sys.stderr, flush=True)
    write_results(results_path, result)
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
