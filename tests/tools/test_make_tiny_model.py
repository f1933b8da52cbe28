"""Tests of tools/make_tiny_model.py (and common/identity.py on the models it makes)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from common import identity
from common.identity import model_identity, tokenizer_identity
from tools.make_tiny_model import (
    CALCULATOR_TOOL,
    PRESETS,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    TinyModelSpec,
    bfloat16_bits_to_float32,
    make_tiny_model,
    model_config,
    preset_spec,
    render_chat,
    to_bfloat16_bits,
    train_tokenizer,
    weight_shapes,
)

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "bin" / "make-tiny-model"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def conversation() -> list[dict]:
    return [
        {"role": "user", "content": "What is 3+4 and 5*6?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "3+4"}},
                },
                # OpenAI clients send arguments as a JSON string: it must not be encoded twice.
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "5*6"}'},
                },
            ],
        },
        {"role": "tool", "content": "7"},
        {"role": "tool", "content": "30"},
    ]


def test_same_seed_gives_identical_files(tiny: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again")
    assert file_hashes(again) == file_hashes(tiny)
    assert set(file_hashes(tiny)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tiny_model.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_other_seed_changes_weights_but_not_tokenizer(tiny: Path, tmp_path: Path) -> None:
    other = file_hashes(make_tiny_model(tmp_path / "seed1", TinyModelSpec(seed=1)))
    base = file_hashes(tiny)
    assert {name for name in base if base[name] != other[name]} == {
        "model.safetensors",
        "tiny_model.json",
    }


@pytest.mark.integration
def test_cli_writes_same_directory_in_another_process(tiny: Path, tmp_path: Path) -> None:
    # A fresh process also checks that tokenizer training does not depend on hash seeds.
    start = time.perf_counter()
    subprocess.run([sys.executable, str(CLI), "--out", str(tmp_path / "cli")], check=True)
    elapsed = time.perf_counter() - start
    assert file_hashes(tmp_path / "cli") == file_hashes(tiny)
    assert elapsed < 30, f"make-tiny-model took {elapsed:.1f} s"


@pytest.mark.integration
def test_cli_refuses_foreign_files_and_bad_shapes(tmp_path: Path) -> None:
    make_tiny_model(tmp_path / "model")
    make_tiny_model(tmp_path / "model")  # rewriting its own output is fine
    (tmp_path / "model" / "chat_template.jinja").write_text("{{ messages }}")
    run = [sys.executable, str(CLI), "--out", str(tmp_path / "model")]
    out = subprocess.run(run, capture_output=True, text=True)
    assert out.returncode == 2 and "chat_template.jinja" in out.stderr
    out = subprocess.run(
        [*run[:-1], str(tmp_path / "new"), "--heads", "3"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "num_heads" in out.stderr
    assert not (tmp_path / "new").exists()


def safetensors_header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])


def test_qwen2_0_5b_preset_has_qwen2_0_5b_shape() -> None:
    # Checked without writing the 1-2 GB file: the config and the shapes it implies.
    spec = preset_spec("qwen2-0.5b", dtype="bfloat16", seed=3)
    assert (spec.seed, spec.dtype, spec.vocab_size) == (3, "bfloat16", 512)
    config = model_config(spec, train_tokenizer(spec.vocab_size))
    assert config["vocab_size"] == 151936 and config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["intermediate_size"]) == (896, 4864)
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (24, 14)
    assert (config["num_key_value_heads"], config["max_position_embeddings"]) == (2, 4096)
    assert config["dtype"] == "bfloat16"
    params = sum(int(np.prod(shape)) for shape in weight_shapes(config).values())
    assert params == 494_032_768  # Qwen2-0.5B's count
    assert "lm_head.weight" not in weight_shapes(config)
    assert preset_spec("tiny") == TinyModelSpec()
    with pytest.raises(ValueError, match="unknown preset"):
        preset_spec("qwen2-7b")
    with pytest.raises(ValueError, match="dtype"):
        TinyModelSpec(dtype="float16")
    assert set(PRESETS) >= {"tiny", "small", "qwen2-0.5b"}


def test_bfloat16_rounding_matches_torch() -> None:
    import torch

    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.normal(0, 0.02, 10_000).astype(np.float32),
            np.array(
                [0.0, -0.0, 1.0, 1.00390625, 1.01171875, -2.5, 3.4e38, np.inf, -np.inf, 1e-40],
                dtype=np.float32,
            ),
        ]
    )
    ours = to_bfloat16_bits(x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, want)
    np.testing.assert_array_equal(
        bfloat16_bits_to_float32(ours), torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    )
    assert np.isnan(bfloat16_bits_to_float32(to_bfloat16_bits(np.array([np.nan], np.float32))))


@pytest.mark.integration
def test_cli_preset_and_bfloat16(tiny: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    # Shape flags override the preset's fields; bf16 holds the float32 model's values, rounded.
    out = tmp_path / "small-bf16"
    subprocess.run(
        [
            sys.executable,
            str(CLI),
            "--out",
            str(out),
            "--preset",
            "small",
            "--layers",
            "1",
            "--dtype",
            "bfloat16",
        ],
        check=True,
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["dtype"]) == (
        512,
        1,
        "bfloat16",
    )
    meta = json.loads((out / "tiny_model.json").read_text())
    assert meta["spec"]["dtype"] == "bfloat16" and meta["spec"]["num_layers"] == 1
    header = safetensors_header(out / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    f32 = make_tiny_model(tmp_path / "small-f32", preset_spec("small", num_layers=1))
    assert file_hashes(out)["tokenizer.json"] == file_hashes(f32)["tokenizer.json"]
    assert (out / "model.safetensors").stat().st_size < 0.6 * (
        f32 / "model.safetensors"
    ).stat().st_size
    ref = load_file(str(f32 / "model.safetensors"))
    lm = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert lm.dtype == torch.bfloat16
    state = lm.state_dict()
    for name, array in ref.items():
        got = state[name].view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(got, to_bfloat16_bits(array), err_msg=name)
    with torch.no_grad():
        logits = lm(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
    # The default (float32) output is unchanged by the new flags.
    subprocess.run(
        [
            sys.executable,
            str(CLI),
            "--out",
            str(tmp_path / "tiny"),
            "--preset",
            "tiny",
            "--dtype",
            "float32",
        ],
        check=True,
    )
    assert file_hashes(tmp_path / "tiny") == file_hashes(tiny)


@pytest.mark.integration
def test_cli_help_is_fast_and_imports_nothing_heavy() -> None:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(CLI), "--help"], check=True, capture_output=True, text=True
    )
    elapsed = time.perf_counter() - start
    assert "--out" in out.stdout and "--seed" in out.stdout
    assert elapsed < 1.0, f"--help took {elapsed:.2f} s"
    probe = textwrap.dedent(
        """
        import sys
        from tools.make_tiny_model import parse_args
        try:
            parse_args(["--help"])
        except SystemExit:
            pass
        heavy = {"torch", "transformers", "tokenizers", "numpy", "safetensors", "jinja2"}
        print(sorted(heavy & set(sys.modules)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, check=True, capture_output=True, text=True
    )
    assert out.stdout.splitlines()[-1] == "[]"


def test_transformers_loads_model_and_tokenizer(tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        tiny, local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    assert len(tokenizer) <= model.config.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None

    for token in (*SPECIAL_TOKENS, *TOOL_TOKENS):
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids) == [token]
    text = 'What is 12+7? héllo 日本 <tool_call>{"a": 1}</tool_call><|im_end|>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # Tool tags are not "special": a parser still sees them after skip_special_tokens.
    assert "<tool_call>" in tokenizer.decode(ids, skip_special_tokens=True)

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_chat_template_renders_tools_calls_and_responses(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    messages = conversation()
    text = tokenizer.apply_chat_template(
        messages, tools=[CALCULATOR_TOOL], tokenize=False, add_generation_prompt=True
    )
    assert text == render_chat(messages, [CALCULATOR_TOOL], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert json.dumps(CALCULATOR_TOOL) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5*6"}}\n</tool_call><|im_end|>\n'
    ) in text
    # Consecutive tool results share one user turn.
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n30\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    tool_call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    assert ids.count(tool_call_id) == 2 + 2  # two calls + two in the system prompt's instructions
    assert ids.count(tokenizer.convert_tokens_to_ids("<tool_response>")) == 2

    plain = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        tokenize=False,
    )
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_metadata_records_spec_and_hashes(tiny: Path) -> None:
    meta = json.loads((tiny / "tiny_model.json").read_text())
    assert meta["spec"]["seed"] == 0 and meta["tokenizer_vocab_size"] == 512
    for name, digest in meta["files_sha256"].items():
        assert hashlib.sha256((tiny / name).read_bytes()).hexdigest() == digest
    assert meta["model_identity_sha256"] == model_identity(tiny)["sha256"]
    assert meta["tokenizer_identity_sha256"] == tokenizer_identity(tiny)["sha256"]


def test_identities_are_stable_and_track_content(tiny: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again")
    assert model_identity(again)["sha256"] == model_identity(tiny)["sha256"]
    assert tokenizer_identity(again) == {**tokenizer_identity(tiny), "name": "again"}
    assert tokenizer_identity(tiny)["vocab_size"] == 512

    seed1 = make_tiny_model(tmp_path / "seed1", TinyModelSpec(seed=1))
    assert model_identity(seed1)["sha256"] != model_identity(tiny)["sha256"]
    assert tokenizer_identity(seed1)["sha256"] == tokenizer_identity(tiny)["sha256"]

    small = make_tiny_model(tmp_path / "small", TinyModelSpec(vocab_size=400))
    assert tokenizer_identity(small)["sha256"] != tokenizer_identity(tiny)["sha256"]
    assert tokenizer_identity(small)["vocab_size"] == 400

    # Any tokenizer file counts, e.g. an edited chat template.
    config = json.loads((again / "tokenizer_config.json").read_text())
    config["chat_template"] += "{{- '' }}"
    (again / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_identity(again)["sha256"] != tokenizer_identity(tiny)["sha256"]


def test_model_identity_samples_large_weight_files(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pretend the tiny file is huge: only 4 chunks of 1 KiB of its data are hashed.
    monkeypatch.setattr(identity, "SAMPLE_CHUNKS", 4)
    monkeypatch.setattr(identity, "SAMPLE_CHUNK_BYTES", 1024)
    monkeypatch.setattr(identity, "SAMPLE_BUDGET", 4096)
    weights = (tiny / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(weights[:8], "little")
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "generation_config.json"):
        (copy / name).write_bytes((tiny / name).read_bytes())

    def identity_with_byte_flipped(offset: int) -> str:
        data = bytearray(weights)
        data[offset] ^= 0xFF
        (copy / "model.safetensors").write_bytes(bytes(data))
        return model_identity(copy)["sha256"]

    base = model_identity(tiny)["sha256"]
    assert identity_with_byte_flipped(header_end) != base  # first sampled chunk
    assert identity_with_byte_flipped(len(weights) - 1) != base  # last sampled chunk
    assert identity_with_byte_flipped(header_end + 2000) == base  # between samples: by design


def test_identity_names_and_missing_files(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert identity.display_name(snapshot) == "Qwen/Qwen2.5-7B-Instruct"
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        model_identity(snapshot)
    (snapshot / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="weight files"):
        model_identity(snapshot)
    with pytest.raises(FileNotFoundError, match="tokenizer files"):
        tokenizer_identity(snapshot)


VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, gpu_memory_utilization=0.05,
              max_model_len=512, seed=0, distributed_executor_backend="uni")
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("<|im_start|>user\\nWhat is 3+4?<|im_end|>\\n<|im_start|>assistant\\n")
    params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=0, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)[0].outputs[0]
    logprobs = [out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)]
    print("RESULT " + json.dumps({"token_ids": list(out.token_ids), "logprobs": logprobs,
                                  "eos_token_id": tokenizer.eos_token_id}))
"""


@pytest.mark.e2e
def test_vllm_cpu_loads_and_generates(tiny: Path, tmp_path: Path) -> None:
    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    # Engine core and worker in this one subprocess (no multiprocessing, "uni" executor): each
    # extra process imports vLLM again, which made the test ~3x slower on a 2-core machine.
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    assert len(result["token_ids"]) == 8
    assert all(0 <= t < vocab for t in result["token_ids"])
    assert all(lp <= 0.0 for lp in result["logprobs"])
    assert (
        result["eos_token_id"]
        == json.loads((tiny / "tiny_model.json").read_text())["special_token_ids"]["<|im_end|>"]
    )
