"""Supervised warm-up of a tiny model on tool-episode demonstrations, so that RL has a signal.

A randomly initialised model never writes a tool call nor a right answer: every reward is 0 and
GRPO's group advantages are all zero. This teaches the *format* of a tool episode, briefly:
- demonstrations come from the data rows: the question (rendered by ``ChatRenderer`` with the tool
  schemas, as the tool agent renders it), a hermes ``<tool_call>`` to the calculator with the
  expression of the question ("What is 51 + 99? ..." -> ``51 + 99``), the calculator's real
  response (the tool itself is called) appended as the tool agent appends it
  (``renderer.tool_delta_ids``), then ``The answer is \\boxed{N}.``: a plain last turn, which the
  tool agent ends as ``no_tool_call`` and the math reward reads from the box;
- the loss is on the model's tokens only (both turns and their end tokens), never on the prompt or
  the tool response: exactly the mask the rollouts carry;
- it stops at *partial* competence, measured: every PROBE_EVERY steps (``--probe-every``) a probe
  scores held-out rows (the PROBE_ROWS after the training rows) with the chance that sampling at
  temperature 1 writes the whole episode right; training stops once that reaches ``target``
  (0.3), so some episodes earn the reward and most groups have reward variance: RL has something
  left to learn. A fixed step count cannot do this: the copying both turns need (question ->
  call, tool response -> box) appears abruptly, at a step that batch order decides;
- a copy drill (random strings of the expression tokens shown twice) trains alongside and brings
  that step forward and into line across seeds (on demonstrations alone some seeds never learn
  the copy);
- deterministic for a seed (torch's CPU kernels, one seeded generator for batches and drill);
  ``max_seconds`` is a safety cap that breaks that promise only when it triggers, and the summary
  says so;
- ``device``: ``auto`` (the default) trains on CUDA when it is available, with float32 master
  weights and bfloat16 autocast, else on the CPU (float32, no autocast). Batch order and drill
  strings come from the same CPU generator on both. On CUDA torch's deterministic algorithms are
  asked for (cuBLAS's fixed workspace): the atomics of the default kernels made two warm-ups of
  one seed on one GPU type part from their first steps, and one of them never reached the target.
  Each backward runs in strict mode, since attention's backward stays non-deterministic in
  warn-only mode (``tools/deterministic.py``, which also falls back when an op has no
  deterministic kernel); everything else runs warn-only. cuDNN attention is switched off: SDPA
  chooses it in the warn-only forward, and torch runs its backward non-deterministically in any
  mode (two warm-ups of one seed on an H200 parted with it on). The first step is run twice more
  before training (``repeat_check``), and the summary names the gradients that do not repeat,
  with default and with math attention;
- the output is the source directory with new weights: ``model.safetensors`` under the
  checkpoint's own tensor names and dtypes (a bfloat16 checkpoint stays bfloat16), every config and tokenizer file copied unchanged, and
  ``warmup.json`` (what was done, from what) in place of the tiny model's metadata, whose hashes
  would no longer hold.
Packing, the loss, the probe, bucketed batches and the drill are ``tools/warmup_batches.py``; the
calculator's demonstrations are ``tools/demos/calculator.py``; this module runs the loop and writes
the model.
torch, transformers and the rollout service are imported inside functions: ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from tools.demos import Demonstration
from tools.deterministic import StrictBackward, repeat_check
from tools.warmup_batches import (
    DRILL_BATCH,
    Bucket,
    bucketed_epoch,
    demo_loss,
    drill_batch,
    drill_loss,
    pack,
    probe,
)

if TYPE_CHECKING:
    pass

DEFAULT_STEPS = 500  # at most: training stops as soon as the probe reaches the target
DEFAULT_TARGET = 0.3
DEFAULT_EXAMPLES = 224
DEFAULT_LR = 3e-3
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEED = 0
DEFAULT_MAX_SECONDS = 120.0
DEFAULT_DRILL_WEIGHT = 0.5
PROBE_ROWS = 32  # held-out rows (after the training rows) the probe scores
PROBE_EVERY = 10  # steps
DEFAULT_TOOLS = ("calculator", "finish")  # configs/default.yaml: the schemas the prompt shows
METADATA = "warmup.json"
# Files of the source directory that are not copied: its weights (rewritten) and the tiny model's
# metadata (its file hashes would be wrong for the new weights).
NOT_COPIED = {"model.safetensors", "tiny_model.json", METADATA}


def load_rows(data_file: str | Path, n: int) -> list[dict[str, Any]]:
    rows = []
    with Path(data_file).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) == n:
                break
    if not rows:
        raise ValueError(f"{data_file} has no rows")
    return rows


def _cut(demos: list[Demonstration], max_tokens: int | None) -> list[Demonstration]:
    """Every demonstration cut to its first ``max_tokens`` tokens (None: unchanged). The padded
    width of a batch, hence a step's cost, is its longest demonstration: a long-tailed set would
    pay for its longest episode in every step. Turns are local (each copies from the tool
    responses just before it), so the turns a cut episode keeps teach what its lost turns would."""
    if max_tokens is None:
        return demos
    out = []
    for d in demos:
        if len(d.ids) <= max_tokens:
            out.append(d)
            continue
        train = d.train[:max_tokens]
        train[-1] = False  # it would predict the first token cut off
        out.append(Demonstration(d.ids[:max_tokens], train, d.expression, d.answer))
    return out


def _prepare_out_dir(model_dir: Path, out: Path) -> None:
    if out.resolve() == model_dir.resolve():
        raise ValueError("out_dir must differ from model_dir")
    if out.is_dir():
        # Rewriting an earlier warm-up is fine; anything else in the way is someone else's.
        if any(out.iterdir()) and not (out / METADATA).exists():
            raise FileExistsError(f"{out} exists and is not a warm-up output ({METADATA} missing)")
    out.mkdir(parents=True, exist_ok=True)


def _log(msg: str) -> None:
    print(f"warmup: {msg}", file=sys.stderr, flush=True)


def warmup(
    model_dir: str | Path,
    data_file: str | Path,
    out_dir: str | Path,
    *,
    steps: int = DEFAULT_STEPS,
    examples: int = DEFAULT_EXAMPLES,
    lr: float = DEFAULT_LR,
    seed: int = DEFAULT_SEED,
    max_seconds: float = DEFAULT_MAX_SECONDS,
    target: float | None = DEFAULT_TARGET,
    batch_size: int = DEFAULT_BATCH_SIZE,
    drill_weight: float = DEFAULT_DRILL_WEIGHT,
    tools: tuple[str, ...] = DEFAULT_TOOLS,
    log_every: int = 50,
    guess_fraction: float = 0.0,
    device: str = "auto",
    grad_clip: float | None = None,
    max_tokens: int | None = None,
    bucket: Bucket | None = None,
    agent: str = "calculator",
    probe_every: int = PROBE_EVERY,
    lr_decay: bool = False,
) -> dict[str, Any]:
    """Train at most ``steps`` Adam steps on episodes from the first ``examples`` rows of
    ``data_file`` (batches of ``batch_size``, plus the copy drill weighted ``drill_weight``; 0: off),
    stopping once the probe on the next PROBE_ROWS rows reaches ``target`` (None: never), and write
    the model to ``out_dir``. ``guess_fraction``: the share of episodes that skip the tool and box a
    guess (see tools.demos.calculator.build_demonstrations; the probe always scores the tool episode). ``device``: auto
    (CUDA when available, else the CPU), cpu or cuda; on CUDA the forward passes run under bfloat16
    autocast. ``grad_clip``: clip the gradient norm to it (None: no clipping; a large model
    trained from random weights wants 1.0). ``max_tokens``: cut every demonstration to its first
    N tokens (see ``_cut``; None: whole episodes). ``bucket``: batches of demonstrations of similar
    lengths (``length``: whole episodes; ``prompt``: prompts), each run only as wide as its longest
    (a long-tailed set then costs about its mean length per step, not its longest; see
    ``bucketed_epoch``). ``lr_decay``: the learning rate falls linearly from ``lr`` to 0 at
    ``steps`` (``_decayed_lr``). ``agent``: whose episodes the demonstrations are
    (``tools.demos.BUILDERS``; the calculator's by default). Returns the summary (also written to
    warmup.json)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # lazy: this module is bin/warmup's command line, whose --help stays instant
    from rollout_service.agents.rendering import ChatRenderer
    from rollout_service.tools import load_builtin_tools
    from tools.demos import build as demos_for

    if steps < 1 or examples < 1 or batch_size < 1 or probe_every < 1:
        raise ValueError("steps, examples, batch_size and probe_every must be >= 1")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda (got {device!r})")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
    t0 = time.perf_counter()
    model_dir, out = Path(model_dir), Path(out_dir)
    _prepare_out_dir(model_dir, out)
    registry = load_builtin_tools()
    tool_objs = {name: registry.get(name)() for name in tools}
    if agent == "calculator" and "calculator" not in tool_objs:
        raise ValueError("the demonstrations call the calculator: it must be among the tools")
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(model_dir)))
    tok = renderer.tok
    rows = load_rows(data_file, examples + PROBE_ROWS)
    # a short file still keeps some rows out for the probe
    n_probe = min(PROBE_ROWS, len(rows) // 4)
    n_train = min(examples, len(rows) - n_probe)
    demos = _cut(
        demos_for(
            agent, rows[:n_train], renderer, tool_objs, guess_fraction=guess_fraction, seed=seed
        ),
        max_tokens,
    )
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else renderer.eos_id)
    data = pack(demos, pad, trim=bucket is not None)
    probe_data = (
        pack(
            _cut(
                demos_for(agent, rows[n_train : n_train + n_probe], renderer, tool_objs),
                max_tokens,
            ),
            pad,
            trim=bucket is not None,
        )
        if n_probe
        else None
    )
    pool = torch.tensor(
        sorted(
            {
                t
                for d in demos
                for text in (d.expression, d.answer)
                for t in tok.encode(text, add_special_tokens=False)
            }
        )
    )

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if device == "cuda":
        # must precede cuBLAS's first handle to take effect; process-wide, and the warm-up is a
        # process of its own wherever it runs on a GPU (bench/e2e.py's child, the CLI)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        # SDPA picks its kernel in the forward, which runs warn-only, and there it may pick cuDNN
        # attention, whose backward torch runs non-deterministically whatever the flag says (it
        # is only left out of the choice in strict mode). Flash and memory-efficient attention
        # read the flag in their backward, which runs strict.
        torch.backends.cuda.enable_cudnn_sdp(False)
    # strict for each backward on CUDA: warn-only leaves attention's backward non-deterministic
    backward = StrictBackward(torch, strict=device == "cuda")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    if device == "cuda":
        model.to(device)  # pyright: ignore[reportArgumentType]  (transformers' stub of .to is narrower than torch's)
        data = data.to(device)
        probe_data = probe_data.to(device) if probe_data is not None else None
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if device == "cuda"
        else contextlib.nullcontext
    )
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def zero_grad() -> None:
        opt.zero_grad(set_to_none=True)

    order: list[int] = []
    losses: list[float] = []
    drill_losses: list[float] = []
    probes: list[tuple[int, float]] = []
    stopped = "steps"
    repeat: dict[str, Any] = {}
    _log(
        f"{n_train} demonstrations ({data.ids.shape[1]} tokens max, {data.prefix} shared, "
        f"{int(data.train.sum())} loss tokens), {n_probe} probe rows; at most {steps} steps of {batch_size}, "
        f"lr {lr:g}, drill {drill_weight:g}, target {target}"
        + (f", on {device}" if device != "cpu" else "")
    )
    for step in range(1, steps + 1):
        if len(order) < batch_size:  # epochs of seeded shuffles: every example is seen evenly
            order += (
                torch.randperm(len(demos), generator=gen).tolist()
                if bucket is None
                else bucketed_epoch(data, batch_size, gen, bucket)
            )
        batch, order = order[:batch_size], order[batch_size:]
        # drawn once: a backward that leaves strict mode reruns the forward on the same batch
        drill_x = drill_batch(pool, gen, DRILL_BATCH, pad) if drill_weight > 0 else None

        def forward(batch: list[int] = batch, drill_x: Any = drill_x) -> tuple[Any, Any, Any]:
            with autocast():
                loss = demo_loss(model, data, batch)
                if drill_x is None:
                    return loss, None, loss
                drill = drill_loss(model, drill_x[0].to(device), drill_x[1].to(device))
                return loss, drill, loss + drill_weight * drill

        if step == 1 and device == "cuda":  # does a step repeat here, and if not, is it attention
            repeat = repeat_check(
                torch,
                list(model.named_parameters()),
                lambda: backward.run(forward, zero_grad),
                zero_grad,
            )
        zero_grad()
        loss, drill, _total = backward.run(forward, zero_grad)
        if drill is not None:
            drill_losses.append(drill.item())
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if lr_decay:
            for group in opt.param_groups:
                group["lr"] = _decayed_lr(lr, step, steps)
        opt.step()
        losses.append(loss.item())
        if probe_data is not None and (step % probe_every == 0 or step == steps):
            with autocast():
                probes.append((step, round(probe(model, probe_data), 4)))
        reached = (
            target is not None
            and bool(probes)
            and probes[-1][0] == step
            and probes[-1][1] >= target
        )
        if step % log_every == 0 or step == steps or reached:
            drill_note = f" drill {drill_losses[-1]:.4f}" if drill_losses else ""
            probe_note = f" probe {probes[-1][1]:.3f}" if probes else ""
            _log(
                f"step {step}/{steps} loss {losses[-1]:.4f}{drill_note}{probe_note} "
                f"({time.perf_counter() - t0:.1f} s)"
            )
        if reached:
            stopped = "target"
            break
        if time.perf_counter() - t0 > max_seconds and step < steps:
            stopped = "max_seconds"
            _log(f"stopping after {step} steps: max_seconds {max_seconds:g} reached")
            break
    if target is not None and stopped != "target":
        _log(
            f"the probe did not reach the target {target:g}: the model is less competent than asked"
        )

    state = model.state_dict()
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        # the checkpoint's own names (the tied lm_head is not one) and dtypes
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    torch_dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    save_file(
        {
            k: state[k].detach().to("cpu", torch_dtypes.get(d, torch.float32)).contiguous()
            for k, d in dtypes.items()
        },
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and f.name not in NOT_COPIED:
            shutil.copy(f, out / f.name)
    last = losses[-10:]
    summary = {
        "out_dir": str(out),
        "source_model": str(model_dir),
        "data_file": str(data_file),
        "examples": n_train,
        "probe_rows": n_probe,
        "probe_every": probe_every,
        "steps": len(losses),
        "max_steps": steps,
        "stopped": stopped,
        "target": target,
        "probe": probes[-1][1] if probes else None,
        "probe_history": probes,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "drill_weight": drill_weight,
        "tools": list(tools),
        "guess_fraction": guess_fraction,
        # a default warm-up keeps its keys
        **({"max_tokens": max_tokens} if max_tokens is not None else {}),
        **({"bucket": True} if bucket == "length" else {"bucket": bucket} if bucket else {}),
        **({"lr_decay": True} if lr_decay else {}),
        "first_loss": round(losses[0], 6),
        "final_loss": round(losses[-1], 6),
        "mean_loss_last_10": round(sum(last) / len(last), 6),
        "final_drill_loss": round(drill_losses[-1], 6) if drill_losses else None,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if device != "cpu" or grad_clip is not None:  # a CPU warm-up's summary keeps its keys
        summary |= {"device": device, "grad_clip": grad_clip}
    if device != "cpu":
        summary["deterministic_backward"] = backward.mode
        summary["repeat_check"] = repeat
        # which model this is, across machines and leases: runs compared with each other must
        # name the same digest (bench/vs_verl_report.py checks it)
        summary["weights_sha256"] = _sha256(out / "model.safetensors")
    (out / METADATA).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _decayed_lr(lr: float, step: int, steps: int) -> float:
    """The learning rate of ``step`` (1-based) of at most ``steps`` under ``--lr-decay``: linear
    from ``lr`` to 0. At a constant 3e-3 the last few batches decide where a choice between two
    demonstrated actions ends; a falling rate averages over more of them."""
    return lr * (1.0 - (step - 1) / steps)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="warmup",
        description="Short supervised warm-up of a (tiny) model on calculator tool episodes built "
        "from data rows, so RL starts with a reward signal. Prints a JSON summary.",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=Path("runs/tiny-model"),
        help="source model dir (default %(default)s)",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=Path("runs/tiny-data/train.jsonl"),
        help="JSONL rows with question/answer (default %(default)s)",
    )
    p.add_argument("--out", type=Path, required=True, help="output model dir (created)")
    p.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help="at most this many optimizer steps (default %(default)s)",
    )
    p.add_argument(
        "--target",
        type=float,
        default=DEFAULT_TARGET,
        help="stop once the probe (held-out chance of a fully right episode) reaches this; "
        "0: run all steps (default %(default)s)",
    )
    p.add_argument(
        "--probe-every",
        type=_positive_int,
        default=PROBE_EVERY,
        help="probe every this many steps (default %(default)s); a probe of long episodes costs "
        "a few steps' time, and the target can only be seen where a probe runs",
    )
    p.add_argument(
        "--examples",
        type=int,
        default=DEFAULT_EXAMPLES,
        help=f"train on the first N rows; the next {PROBE_ROWS} are the probe's (default %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help="episodes per step (default %(default)s)",
    )
    p.add_argument(
        "--lr", type=float, default=DEFAULT_LR, help="Adam learning rate (default %(default)s)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="cut every demonstration (and probe episode) to its first N tokens: long episodes then "
        "cost N, and the turns they show still teach the format (default: no cut)",
    )
    p.add_argument(
        "--bucket",
        nargs="?",
        const="length",
        choices=get_args(Bucket),
        help="batches of demonstrations of similar lengths, each only as wide as its longest: a "
        "long-tailed set costs its mean length per step, not its longest. length (the value "
        "without an argument): whole episodes; prompt: the prompts, so that the short and the "
        "long answer to one prompt share batches (default: off)",
    )
    p.add_argument(
        "--lr-decay",
        action="store_true",
        help="lower the learning rate linearly from --lr to 0 at --steps (default: constant)",
    )
    p.add_argument(
        "--guess-fraction",
        type=float,
        default=0.0,
        help="share of demonstrations that answer wrong: they skip the tool and guess (calculator, "
        "code, mixed) or note a wrong code (statelm); the warmed model then chooses between the "
        "two, and RL learns the right one from the reward (default %(default)s)",
    )
    p.add_argument(
        "--drill-weight",
        type=float,
        default=DEFAULT_DRILL_WEIGHT,
        help="weight of the copy drill's loss; 0: off (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="(default %(default)s)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=DEFAULT_MAX_SECONDS,
        help="stop early past this wall time (default %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA (bfloat16 autocast) when available, else the CPU (default %(default)s)",
    )
    p.add_argument(
        "--grad-clip",
        type=float,
        default=None,
        help="clip the gradient norm to this (default: no clipping)",
    )
    p.add_argument(
        "--tools",
        default=",".join(DEFAULT_TOOLS),
        help="tools whose schemas the prompt shows, in config order (default %(default)s)",
    )
    p.add_argument(
        "--agent",
        default="calculator",
        help="whose episodes to demonstrate: a name of tools/demos (default %(default)s)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr is for our progress lines
    try:
        summary = warmup(
            a.model,
            a.data,
            a.out,
            steps=a.steps,
            examples=a.examples,
            lr=a.lr,
            seed=a.seed,
            max_seconds=a.max_seconds,
            target=a.target or None,
            batch_size=a.batch_size,
            drill_weight=a.drill_weight,
            guess_fraction=a.guess_fraction,
            max_tokens=a.max_tokens,
            bucket=a.bucket,
            lr_decay=a.lr_decay,
            probe_every=a.probe_every,
            device=a.device,
            grad_clip=a.grad_clip,
            tools=tuple(t.strip() for t in a.tools.split(",") if t.strip()),
            agent=a.agent,
        )
    except (FileExistsError, FileNotFoundError, ValueError, KeyError) as e:
        print(f"warmup: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
