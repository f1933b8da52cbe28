#!/usr/bin/env python3
"""Multi-turn generation, the agent's pattern, through ``VllmEngine`` against bare ``AsyncLLM``,
per CUDA-graph mode.

The workload is the long-tail agent's turn structure without its tools: ``--episodes`` episodes
start together, each on its own prompt of ``--prompt-len`` ids; an episode runs T turns (lognormal
around ``--turns-median``, cut to 1..``--max-turns``, seeded per round), each turn generating
``--turn-tokens`` tokens (``ignore_eos``), then appending ``--tool-tokens`` random ids (a tool's
answer) and submitting the whole context again. So every decode step runs beside other episodes'
new turns: the engine's batches are mixed prefill-decode most of the time, unlike the single-turn
batches of bench/rollout.py. What the learner waits for is an episode's end, so the figures are
the round's wall time (set by its longest episode) and that episode's tokens/s.

Per mode (``--modes``: vLLM ``cudagraph_mode`` values without torch.compile, ``default`` for
vLLM's own compiled default, ``eager``), one engine in its own process: an untimed warm-up round,
then ``--rounds`` rounds, each once through ``VllmEngine.generate`` (turns of one episode share a
``kv_scope``, as the agent's do) and once through the same engine's bare ``AsyncLLM`` with the same
``SamplingParams``. Figures: per mode the median round wall of each side and their ratio (bare /
ours: the wrapper's cost, target >= 0.95), and each mode's speed-up over the first one named (both
sides' rounds pooled). The last line of stdout is one JSON object.

Every sampled token's logprob is checked (finite, <= 0: ``check_logprobs``, as the rollout server
checks its engine's), and each round reports their mean: a mode whose output is corrupt is
reported as failed, not timed (vLLM's ``FULL`` graphs of large mixed batches have been corrupt).
Output that is wrong but finite shows in that mean: a mode whose median round mean is more than
``LOGPROB_TOLERANCE`` nats from the first mode's is failed too (the same seeded episodes, the same
weights: graph modes differ by rounding only).

    python3 bench/multiturn.py                       # one GPU: FULL_DECODE_ONLY, FULL, default
    .venv/bin/python bench/multiturn.py              # CPU: eager, the tiny model, 16 episodes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import Progress, gpu_count, ratio
from rollout_service.engine.base import EngineOutputError, SamplingSettings, check_logprobs
from tools.make_tiny_model import make_tiny_model, preset_spec

progress = Progress("bench/multiturn")
SHAPES = {"tiny": "tiny", "0.5b": "qwen2-0.5b"}  # --shape -> tools/make_tiny_model.py preset
ID_LIMIT = 500  # random ids stay below the tiny tokenizer's 512 (and any model's vocabulary)
LOGPROB_TOLERANCE = 0.5  # nats, between modes' mean sampled-token logprobs (tens of thousands each)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/multiturn.py",
        description=(__doc__ or "").split("\n\n")[0].replace("\n", " "),
    )
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument(
        "--modes",
        help="comma-separated; default FULL_DECODE_ONLY,FULL,default on cuda, eager on the CPU",
    )
    p.add_argument("--episodes", type=int, help="default 128 on cuda, 16 on the CPU")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per side and mode")
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--turn-tokens", type=int, default=25, help="generated tokens per turn")
    p.add_argument("--tool-tokens", type=int, default=30, help="ids appended after each turn")
    p.add_argument("--turns-median", type=float, default=6.0)
    p.add_argument("--turns-sigma", type=float, default=0.8, help="of log(turns)")
    p.add_argument("--max-turns", type=int, default=31)
    p.add_argument("--shape", choices=sorted(SHAPES), help="default 0.5b on cuda, tiny on the CPU")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--capture-size",
        type=int,
        help="vLLM's max_cudagraph_capture_size for the graph modes (default vLLM's: "
        "min(2 x max_num_seqs, 512) tokens; a larger batch runs eagerly)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument("--mode-timeout-s", type=float, default=300.0, help="limit of one mode")
    p.add_argument("--one-mode", help=argparse.SUPPRESS)  # the child: run this mode, print JSON
    p.add_argument("--model", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if (gpu_count() or 0) > 0 else "cpu"
    cuda = a.device == "cuda"
    a.modes = (a.modes or ("FULL_DECODE_ONLY,FULL,default" if cuda else "eager")).split(",")
    a.episodes = a.episodes or (128 if cuda else 16)
    a.shape = a.shape or ("0.5b" if cuda else "tiny")
    a.dtype = "bfloat16" if cuda else "float32"
    return a


# -- the child: one engine, one mode ----------------------------------------------------------


def engine_settings(a: argparse.Namespace) -> Any:
    # lazy: vllm_engine pulls in numpy, psutil and the engine's modules (~0.4 s): not for --help
    from rollout_service.engine.vllm_engine import VllmEngineSettings

    eager = a.one_mode == "eager" or a.device == "cpu"
    graphs: dict[str, Any] | None = None
    if not eager and a.one_mode != "default":
        graphs = {"mode": 0, "cudagraph_mode": a.one_mode}
    if graphs is not None and a.capture_size:
        graphs["max_cudagraph_capture_size"] = a.capture_size
    return VllmEngineSettings(
        model=a.model,
        max_model_len=a.prompt_len + a.max_turns * (a.turn_tokens + a.tool_tokens) + 64,
        gpu_memory_utilization=a.gpu_memory_utilization if a.device == "cuda" else 0.3,
        dtype=a.dtype,
        enforce_eager=eager,
        compilation_config=graphs,
        max_num_seqs=a.max_num_seqs,
    )


async def turn(
    engine: Any, bare: bool, episode: str, rid: str, ids: list[int], a: argparse.Namespace
) -> tuple[list[int], list[float]]:
    """One turn of ``episode`` (its turns share a KV scope, as the agent's do): ids, logprobs."""
    if not bare:  # VllmEngine checks the logprobs itself
        sampling = SamplingSettings(max_tokens=a.turn_tokens, ignore_eos=True, kv_scope=episode)
        gen = await engine.generate(rid, ids, sampling)
        return list(gen.token_ids), list(gen.logprobs)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(  # what VllmEngine sends: its logprobs, no text, the final output
        max_tokens=a.turn_tokens,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    final = None
    async for step in engine.async_llm.generate(TokensPrompt(prompt_token_ids=ids), params, rid):
        final = step  # FINAL_ONLY: one output, the whole turn
    assert final is not None
    comp = final.outputs[0]
    out = list(comp.token_ids)
    logprobs = [float(comp.logprobs[i][t].logprob) for i, t in enumerate(out)]
    check_logprobs(logprobs, f"bare request {rid}")
    return out, logprobs


async def one_round(engine: Any, a: argparse.Namespace, seed: int, bare: bool) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    turns = rng.lognormal(np.log(a.turns_median), a.turns_sigma, size=a.episodes)
    turns = np.clip(np.round(turns), 1, a.max_turns).astype(int).tolist()
    prompts = rng.integers(1, ID_LIMIT, size=(a.episodes, a.prompt_len)).tolist()
    tools = rng.integers(1, ID_LIMIT, size=(a.episodes, a.max_turns, a.tool_tokens)).tolist()
    side = "b" if bare else "o"

    logprob_sum = 0.0

    async def episode(i: int) -> tuple[float, int]:
        nonlocal logprob_sum
        ids, start, made = list(prompts[i]), time.perf_counter(), 0
        for t in range(turns[i]):
            name = f"{side}{seed}-{i:03d}"
            out, logprobs = await turn(engine, bare, name, f"{name}-{t:03d}", ids, a)
            ids += out + tools[i][t]
            made += len(out)
            logprob_sum += sum(logprobs)
        return time.perf_counter() - start, made

    start = time.perf_counter()
    done = await asyncio.gather(*(episode(i) for i in range(a.episodes)))
    wall = time.perf_counter() - start
    longest = max(range(a.episodes), key=lambda i: (turns[i], done[i][0]))
    made = sum(m for _, m in done)
    return {
        "wall_s": round(wall, 3),
        "tokens_per_s": round(made / wall, 1),
        "mean_logprob": round(logprob_sum / max(made, 1), 3),
        "longest_turns": turns[longest],
        "longest_tokens_per_s": round(done[longest][1] / done[longest][0], 1),
    }


async def child(a: argparse.Namespace) -> dict[str, Any]:
    # lazy: vllm_engine pulls in numpy, psutil and the engine's modules (~0.4 s): not for --help
    from rollout_service.engine.vllm_engine import VllmEngine

    start = time.perf_counter()
    engine = await VllmEngine.start(engine_settings(a))
    out: dict[str, Any] = {"mode": a.one_mode, "start_s": round(time.perf_counter() - start, 1)}
    try:
        for bare in (False, True):  # warm-up: the kernels and shapes of both sides, untimed
            await one_round(engine, a, 10_000, bare)
        out["ours"], out["bare"] = [], []
        for r in range(a.rounds):  # alternating, the same episodes on both sides
            for bare in (False, True):
                rec = await one_round(engine, a, r, bare)
                out["bare" if bare else "ours"].append(rec)
                progress(f"{a.one_mode} round {r} {'bare' if bare else 'ours'}: {rec}")
    except EngineOutputError as e:  # a result of its own: not timed, not compared
        out["error"] = f"corrupt output: {e}"
    finally:
        await engine.shutdown()
    return out


# -- the parent: a child per mode, then the comparison ----------------------------------------


def run_mode(a: argparse.Namespace, argv: list[str], mode: str, model: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, *argv, "--one-mode", mode, "--model", str(model)]
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=a.mode_timeout_s)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"over --mode-timeout-s {a.mode_timeout_s}"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"mode": mode, "error": f"exit {done.returncode}"}
    return json.loads(lines[-1])


def summarize(modes: list[dict[str, Any]]) -> dict[str, Any]:
    for m in modes:
        if "error" in m:
            continue
        for side in ("ours", "bare"):
            m[f"{side}_wall_s_median"] = round(statistics.median(r["wall_s"] for r in m[side]), 3)
        m["bare_over_ours"] = ratio(m["bare_wall_s_median"], m["ours_wall_s_median"])
        pooled = [r for side in ("ours", "bare") for r in m[side]]
        m["wall_s_median"] = round(statistics.median(r["wall_s"] for r in pooled), 3)
        m["longest_tokens_per_s_median"] = round(
            statistics.median(r["longest_tokens_per_s"] for r in pooled), 1
        )
        m["mean_logprob_median"] = round(statistics.median(r["mean_logprob"] for r in pooled), 3)
    ok = [m for m in modes if "error" not in m]
    for m in ok[1:]:
        gap = abs(m["mean_logprob_median"] - ok[0]["mean_logprob_median"])
        if gap > LOGPROB_TOLERANCE:
            m["error"] = (
                f"mean sampled-token logprob {m['mean_logprob_median']} against "
                f"{ok[0]['mode']}'s {ok[0]['mean_logprob_median']}: its output differs, not timed"
            )
    ok = [m for m in modes if "error" not in m]
    base = ok[0] if ok else None
    speedups = {m["mode"]: ratio(base["wall_s_median"], m["wall_s_median"]) for m in ok if base}
    return {"baseline": base["mode"] if base else None, "speedup": speedups}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.one_mode:
        print(json.dumps(asyncio.run(child(a))), flush=True)
        return 0
    result: dict[str, Any] = {
        "bench": "multiturn",
        **{k: v for k, v in vars(a).items() if k not in ("one_mode", "model")},
    }
    with tempfile.TemporaryDirectory(prefix="bench-multiturn-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", preset_spec(SHAPES[a.shape], dtype=a.dtype))
        result["modes"] = []
        for mode in a.modes:
            progress(f"mode {mode}: starting its engine")
            result["modes"].append(run_mode(a, argv, mode, model))
    result |= summarize(result["modes"])
    for m in result["modes"]:
        if "error" in m:
            progress(f"{m['mode']}: {m['error']}")
        else:
            progress(
                f"{m['mode']}: round wall median {m['wall_s_median']} s (ours {m['ours_wall_s_median']}, "
                f"bare {m['bare_wall_s_median']}: bare/ours {m['bare_over_ours']}), longest episode "
                f"{m['longest_tokens_per_s_median']} tokens/s; x{result['speedup'].get(m['mode'])} "
                f"against {result['baseline']}"
            )
    print(json.dumps(result), flush=True)
    return 0 if all("error" not in m for m in result["modes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
