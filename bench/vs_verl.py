#!/usr/bin/env python3
"""The same GRPO job on verl's own trainer and on ours, one after the other on the same GPU machine.

What a verl user asks: is this faster than what I run today, for the same job, on the same GPU?

The job: bench/e2e.py's long-tail agentic workload (multi-turn calculator chains, heavy tail of
episode lengths), the same warmed Qwen2-0.5B-shaped model, the same rows, batch (16 prompts x 8),
response limits, optimizer (AdamW, lr 2e-5, weight decay 0.01, clip 1.0), KL loss (low_var_kl,
0.001), mini-batches (64 samples: 2 optimizer steps a step), micro-batches (8) and GPUs
(``--gpus 1``: one shared; ``--gpus 2``: each configuration's own two-GPU placement, named in its
result). verl runs at its best on these machines (bench/verl_side.py: FSDP2, packed sequences
through our learner's varlen kernel, token-capped micro-batches) in its maintained synchronous
trainer and in its asynchronous ones.
verl expresses the workload as it is: its tool agent loop (``tool_agent``) with our calculator as a
function tool (bench/verl_plugins/calculator_tool.py: our evaluator, our schema byte for byte, so
the prompts are the same tokens) and our math reward as its reward function
(bench/verl_plugins/reward.py). The rows are written as verl's parquet (chat-message ``prompt``,
``data_source``, ``reward_model.ground_truth``, ``extra_info``, ``agent_name``); ours reads the
same rows from the JSONL.

Differences that remain are named in the result's ``caveats`` (CAVEATS below).

Stages (``--stage``), each bounded to fit one 10-minute command on a GPU machine:
- ``prepare``: bench/e2e.py --prepare-only (model, data, warm-up) into ``--work-dir``;
- ``verl``: first the device check of the attention plugin on the warmed model (no verl run
  without it), then each configuration of ``--verl`` for ``--steps``, one result file each
  (``vs_verl-verl-LABEL.json``: separate calls add up); verl's per-step metrics come from its file
  logger (VERL_FILE_LOGGER_PATH), stamped as they appear;
- ``ours``: bench/e2e.py with ``--staleness`` (0 = ours sync, 1 and 2 async), ``--steps`` each;
- ``report``: merges the stages' JSON files of ``--work-dir``: per configuration the step time and
  its split, tokens/s ((prompt + response tokens of the batch) / step time, the same definition on
  both sides), peak GPU memory (nvidia-smi, sampled every 0.5 s by this script, the same way for
  both), the reward against wall-clock (seconds since the end of step 1; step 1 pays start-up), and
  per-step speed-ups of every configuration against the best synchronous trainer of either side
  and against each verl configuration. One JSON line on stdout,
  the JSON and a PNG of the reward curves at ``--results``.
- ``all``: the four in order (a GPU machine with time for it).

    python3 bench/vs_verl.py --stage prepare --work-dir /root/vs
    python3 bench/vs_verl.py --stage verl --work-dir /root/vs --gpus 2 --steps 10 --verl sync
    python3 bench/vs_verl.py --stage verl --work-dir /root/vs --gpus 2 --steps 10 --verl fully-async-t1
    python3 bench/vs_verl.py --stage ours --work-dir /root/vs --steps 10 --staleness 0,2
    python3 bench/vs_verl.py --stage report --work-dir /root/vs --results docs/gpu/h100_vs_verl.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import verl_side  # noqa: E402

OUR_TIMINGS = {
    "timing/wait_s": "wait",
    "timing/prepare_s": "prepare",
    "timing/update_s": "update",
    "timing/broadcast_s": "broadcast",
    "timing/step_s": "step",
}
REWARD_WINDOW = 5
CAVEATS = [
    "verl caps a turn only by the whole response budget; ours also at 64 tokens a turn",
    "verl's reward sees tool outputs: only a \\boxed answer counts (ours falls back to the last number)",
    "both sides train packed rows through the same varlen kernel (verl through "
    "bench/verl_plugins/varlen_attention.py); ours also runs a prefix shared by a micro-batch once",
    "verl's fully-async trainer takes the old logprobs from vLLM (bypass mode, forced); ours and "
    "verl's sync trainers recompute them in a forward pass (the job has 2 mini-batches a step)",
    "verl's step is the wall-clock between two versions' metric records (stamped as they appear); "
    "ours is the learner's own step time",
]
SYNC_LABELS = ("ours-sync", "verl-sync", "verl-v0-sync")


def progress(msg: str) -> None:
    print(f"[vs_verl {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vs_verl",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--stage", choices=("prepare", "verl", "ours", "report", "all"), default="all")
    p.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "vs_verl")
    p.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    p.add_argument("--staleness", default="0,1,2", help="our runs (default 0,1,2; 0 = sync)")
    p.add_argument("--timeout-s", type=float, default=560.0, help="limit of a stage's run(s)")
    p.add_argument("--results", type=Path, default=None, help="report JSON (and .png beside it)")
    p.add_argument(
        "--gpus",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: both sides share GPU 0; 2: verl colocated on both (FSDP over 2, one vLLM replica "
        "each), ours with the learner on GPU 0 and the rollout server on GPU 1 (default 1)",
    )
    p.add_argument(
        "--verl",
        default="sync,fully-async-t0,fully-async-t1",
        help="verl configurations, in order (bench/verl_side.py): sync (V1, colocated), v0-sync "
        "(the deprecated trainer), separate-async-sK (V1, at most K versions old) and "
        "fully-async-tT (staleness_threshold T), both with trainer and rollout on separate GPUs; "
        "default sync,fully-async-t0,fully-async-t1",
    )
    p.add_argument(
        "--verl-arg", action="append", default=[], help="one more hydra override for verl"
    )
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be >= 2 (step 1 pays the start-up and is left out of the means)")
    return a


# -- data -------------------------------------------------------------------------------------------


def verl_rows(rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """Our JSONL rows in verl's RL parquet layout, the agent loop chosen per row."""
    return [
        {
            "data_source": str(r.get("data_source", "longtail")),
            "prompt": [{"role": "user", "content": str(r["question"])}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(r["answer"])},
            "extra_info": {"split": split, "index": i},
            "agent_name": "tool_agent",
        }
        for i, r in enumerate(rows)
    ]


def write_verl_data(src: Path, out: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "val"):
        with (src / f"{split}.jsonl").open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(verl_rows(rows, split)), paths[split])
    return paths


# -- running ----------------------------------------------------------------------------------------


class GpuMemory:
    """Peak GPU memory used (MiB, summed over the GPUs), from nvidia-smi every ``interval`` s."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.peak_mib, self.samples = interval, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
                used = sum(float(x) for x in out.split())
                self.peak_mib, self.samples = max(self.peak_mib, used), self.samples + 1
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return  # no nvidia-smi (a CPU machine): no memory figure
            self._stop.wait(self.interval)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def run_bounded(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Run ``cmd`` in its own session, output to ``log``; past ``timeout_s`` SIGTERM, then SIGKILL
    of its whole group. Returns exit status, wall time, whether it timed out and the peak GPU
    memory seen meanwhile."""
    t0 = time.monotonic()
    with log.open("wb") as out, GpuMemory() as mem:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT
        )
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.wait()
    return {
        "exit_status": rc,
        "timed_out": timed_out,
        "wall_s": round(time.monotonic() - t0, 1),
        "peak_gpu_mib": round(mem.peak_mib) if mem.samples else None,
    }


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stage_prepare(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "e2e.py"),
        "--prepare-only",
        "--work-dir",
        str(work),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout_s)
    sys.stderr.write(out.stderr[-4000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result.get("ok"):
        raise RuntimeError(f"bench/e2e.py --prepare-only failed: {result.get('error')}")
    data = write_verl_data(work / "data-longtail", work / "data-longtail-verl")
    return {
        "model": result["model"],
        "warmup": result.get("warmup"),
        "verl_data": str(data["train"]),
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return out


def check_plugin(a: argparse.Namespace, work: Path, model: str) -> dict[str, Any]:
    """bench/verl_plugins/varlen_attention.py's check on this machine's GPU, on the warmed model,
    in a child process (its GPU memory is gone before verl starts): packed logprobs through the
    varlen kernel equal per-sequence SDPA's to bf16 tolerance. verl is not timed without it."""
    cmd = [sys.executable, "-m", verl_side.ATTENTION_LIB, model, "--device", "cuda"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    (work / "verl-attention-check.log").write_text(out.stdout + out.stderr)
    try:
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        result = {"ok": False, "error": tail(work / "verl-attention-check.log", 15)}
    return result


def stage_verl(a: argparse.Namespace, work: Path, prep: dict[str, Any]) -> list[dict[str, Any]]:
    check = check_plugin(a, work, prep["model"])
    progress(f"verl attention plugin check: {json.dumps(check, sort_keys=True)}")
    if not check.get("ok") or not check.get("varlen_kernel"):
        raise RuntimeError(f"verl's packed attention failed its device check: {check}")
    out = []
    for name in a.verl.split(","):
        cfg = verl_side.verl_config(name.strip(), a.gpus)
        out.append({**run_verl(a, work, prep, cfg), "attention_check": check})
    return out


def run_verl(
    a: argparse.Namespace, work: Path, prep: dict[str, Any], cfg: verl_side.VerlConfig
) -> dict[str, Any]:
    run_dir = work / f"run-{cfg.label}"
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ)
    env["VERL_FILE_LOGGER_PATH"] = str(metrics)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HYDRA_FULL_ERROR", "1")
    cmd = [
        sys.executable,
        "-m",
        cfg.module,
        *verl_side.overrides(cfg, a, prep["model"], work),
    ]
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    progress(f"{cfg.label}: {a.steps} steps, log {run_dir / 'train.log'}")
    stamped = run_dir / "stamped.jsonl"
    stamped.unlink(missing_ok=True)
    with verl_side.MetricsWatcher(metrics, out=stamped) as watch:
        run = run_bounded(cmd, run_dir / "train.log", a.timeout_s, env)
    summary = verl_side.summarize(watch.records)
    out = {
        "label": cfg.label,
        "side": "verl",
        "gpus": a.gpus,
        "placement": cfg.placement(a.gpus),
        "staleness": cfg.staleness,
        "command": " ".join(cmd[2:]),
        **run,
        **summary,
    }
    if not summary.get("steps_done") or run["exit_status"] != 0:
        out["log_tail"] = tail(run_dir / "train.log")
    return out


def stage_ours(a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    results = work / "ours-e2e.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "e2e.py"),
        "--work-dir",
        str(work),
        "--staleness",
        a.staleness,
        "--steps",
        str(a.steps),
        "--results",
        str(results),
        "--deadline-s",
        str(max(a.timeout_s - 20, 100)),
        "--gpus",
        str(a.gpus),
    ]
    progress(f"ours: staleness {a.staleness}, {a.steps} steps each")
    run = run_bounded(cmd, work / "ours-e2e.log", a.timeout_s, dict(os.environ))
    e2e = json.loads(results.read_text()) if results.exists() else {"runs": []}
    out = []
    for r in e2e.get("runs", []):
        m = r.get("means", {})
        out.append(
            {
                "label": "ours-" + ("sync" if r["max_staleness"] == 0 else r["label"]),
                "side": "ours",
                "gpus": a.gpus,
                "max_staleness": r["max_staleness"],
                "exit_status": r.get("exit_status"),
                "timed_out": r.get("timed_out"),
                "wall_s": r.get("wall_s"),
                "steps_done": r.get("steps_done"),
                "split_s": {n: m[k] for k, n in OUR_TIMINGS.items() if m.get(k) is not None},
                "tokens_per_s": m.get("perf/tokens_per_s"),
                "response_length_mean": m.get("response/length_mean"),
                "reward_curve": r.get("reward_curve"),
                "clock_curve": r.get("clock_curve"),
                "waste": r.get("waste"),
                "staleness_max": r.get("staleness_max"),
                # one sampler over the whole e2e command: the peak of all its runs
                "peak_gpu_mib": run["peak_gpu_mib"],
            }
        )
    if not out:
        out.append(
            {"label": "ours", "side": "ours", **run, "log_tail": tail(work / "ours-e2e.log")}
        )
    return out


# -- report -----------------------------------------------------------------------------------------


def ratio(a: Any, b: Any) -> float | None:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
    return round(float(a) / float(b), 3) if ok else None


def report(work: Path, results: Path | None) -> dict[str, Any]:
    """Every configuration run in ``work`` side by side, with per-step speed-ups of each against
    the best synchronous trainer of either side and against each verl configuration."""
    prepare = _load(work / "vs_verl-prepare.json")
    files = [*sorted(work.glob("vs_verl-verl-*.json")), work / "vs_verl-ours.json"]
    configs = [c for f in files for c in (_load(f) or {}).get("configs", [])]
    done = [c for c in configs if c.get("steps_done") and c.get("split_s", {}).get("step")]
    syncs = [c for c in done if c["label"] in SYNC_LABELS]
    best_sync = min(syncs, key=lambda c: c["split_s"]["step"], default=None)
    versus: dict[str, Any] = {}
    for base in [c for c in done if c["side"] == "verl"] + ([best_sync] if best_sync else []):
        key = "best_sync" if base is best_sync else base["label"]
        versus[key] = {
            c["label"]: {
                "step_speedup": ratio(base["split_s"]["step"], c["split_s"]["step"]),
                "tokens_per_s_ratio": ratio(c.get("tokens_per_s"), base.get("tokens_per_s")),
            }
            for c in done
            if c is not base
        }
    out = {
        "bench": "vs_verl",
        "workload": "longtail",
        "gpus": max((int(c.get("gpus", 1)) for c in configs), default=1),
        "prepare": prepare,
        "configs": configs,
        "best_sync": best_sync["label"] if best_sync else None,
        "speedup_vs": versus,
        "caveats": CAVEATS,
    }
    if results:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        plot(results.with_suffix(".png"), configs, out["gpus"])
    return out


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def plot(path: Path, configs: list[dict[str, Any]], gpus: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5.5))
        for c in configs:
            xs, ys = c.get("clock_curve"), c.get("reward_curve")
            if not xs or not ys:
                continue
            trail = [
                statistics.fmean(ys[max(0, i - REWARD_WINDOW + 1) : i + 1]) for i in range(len(ys))
            ]
            (line,) = ax.plot(xs, trail, lw=2, label=f"{c['label']} (mean of {REWARD_WINDOW})")
            ax.plot(xs, ys, "o", ms=3.5, alpha=0.6, color=line.get_color())
        ax.set_xlabel("wall-clock since the end of step 1 (s)")
        ax.set_ylabel("mean reward per step")
        where = "one GPU" if gpus == 1 else f"{gpus} GPUs"
        ax.set_title(f"bench/vs_verl.py: verl's trainer vs ours, long-tail workload, {where}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    except Exception as e:  # the figures are in the JSON
        progress(f"could not draw {path}: {type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = a.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    stages = ["prepare", "verl", "ours", "report"] if a.stage == "all" else [a.stage]
    for stage in stages:
        t0 = time.monotonic()
        if stage == "report":
            out = report(work, a.results)
            print(json.dumps(out, sort_keys=True))
            continue
        if stage == "prepare":
            saved: dict[str, Any] = stage_prepare(a, work)
        else:
            prep = _load(work / "vs_verl-prepare.json")
            if prep is None:
                print(
                    f"vs_verl: run --stage prepare first (no {work}/vs_verl-prepare.json)",
                    file=sys.stderr,
                )
                return 2
            configs = stage_verl(a, work, prep) if stage == "verl" else stage_ours(a, work)
            saved = {"configs": configs}
            if stage == "verl":  # one file per configuration: separate calls add up
                for c in configs:
                    path = work / f"vs_verl-verl-{c['label']}.json"
                    path.write_text(json.dumps({"configs": [c]}, indent=1) + "\n")
        saved["stage_s"] = round(time.monotonic() - t0, 1)
        if stage != "verl":
            (work / f"vs_verl-{stage}.json").write_text(json.dumps(saved, indent=1) + "\n")
        progress(f"{stage}: done in {saved['stage_s']} s")
        print(json.dumps({"stage": stage, **saved}, sort_keys=True)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
