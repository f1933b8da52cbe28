"""Cheap content identities of a Hugging Face model directory and of its tokenizer.

Rollout servers and the learner compare these in their handshake so that a server running another
model or tokenizer than the learner is refused at start-up instead of producing silently wrong
log-probabilities. Design:
- an identity is a sha256 over an ordered list of (file name, length, bytes) records, so renaming,
  adding or removing a file changes it; `name` is for humans and logs only (compare `sha256`);
- tokenizer: every tokenizer file that exists (tokenizer.json, tokenizer_config.json, the chat
  template, ...) is hashed whole: they are small and each one changes how text becomes token ids;
- model: config.json, generation_config.json (vLLM takes default sampling parameters from it) and
  a fingerprint of each weight file: the whole safetensors header plus a fixed-size sample of the
  tensor data (see `_weights_fingerprint` for why not all of it);
- stdlib only, no torch / transformers import: it runs in `--help`-fast start-up paths.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from protocol.messages import Identity as WireIdentity

# Files that decide how text is turned into ids (and back). Absent ones are skipped.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
MODEL_CONFIG_FILES = ("config.json", "generation_config.json")
WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

# Weight data sampling: files whose data is at most SAMPLE_BUDGET bytes are hashed whole; larger
# ones contribute SAMPLE_CHUNKS evenly spaced chunks (4 MiB read per file, whatever its size).
SAMPLE_CHUNKS = 64
SAMPLE_CHUNK_BYTES = 64 * 1024
SAMPLE_BUDGET = SAMPLE_CHUNKS * SAMPLE_CHUNK_BYTES


if TYPE_CHECKING:
    from protocol.messages import Identity


class ModelIdentity(TypedDict):
    name: str
    sha256: str


class TokenizerIdentity(TypedDict):
    name: str
    vocab_size: int | None  # highest token id + 1 (added tokens included); None if unknown
    sha256: str


def model_identity(model_dir: str | Path) -> ModelIdentity:
    """Identity of the model (config + weights) in `model_dir`; cheap even for huge checkpoints."""
    root = Path(model_dir)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root}: no config.json; is this a Hugging Face model directory?")
    weights = _weight_files(root)
    if not weights:
        raise FileNotFoundError(f"{root}: no weight files (*.safetensors, pytorch_model*.bin)")
    h = hashlib.sha256(b"model-identity/1\0")
    for name in (*MODEL_CONFIG_FILES, *WEIGHT_INDEX_FILES):
        if (root / name).is_file():
            _add_record(h, name, (root / name).read_bytes())
    for path in weights:
        _add_record(h, path.name, _weights_fingerprint(path))
    return ModelIdentity(name=display_name(root), sha256=h.hexdigest())


def tokenizer_identity(model_dir: str | Path) -> TokenizerIdentity:
    """Identity of the tokenizer (vocabulary, merges, special tokens, chat template) in `model_dir`."""
    root = Path(model_dir)
    present = [name for name in TOKENIZER_FILES if (root / name).is_file()]
    if not present:
        raise FileNotFoundError(f"{root}: none of the tokenizer files {TOKENIZER_FILES}")
    h = hashlib.sha256(b"tokenizer-identity/1\0")
    for name in present:
        _add_record(h, name, (root / name).read_bytes())
    return TokenizerIdentity(
        name=display_name(root), vocab_size=_vocab_size(root), sha256=h.hexdigest()
    )


def display_name(model_dir: str | Path) -> str:
    """Directory name, or `org/name` for a Hugging Face cache snapshot (models--org--name/snapshots/REV)."""
    path = Path(model_dir).resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


def _add_record(h: hashlib._Hash, name: str, data: bytes) -> None:
    # Name and length framing: no two different file sets can produce the same byte stream.
    encoded = name.encode()
    h.update(struct.pack("<Q", len(encoded)) + encoded + struct.pack("<Q", len(data)))
    h.update(data)


def _weight_files(root: Path) -> list[Path]:
    files = sorted(root.glob("*.safetensors"))
    return files or sorted(root.glob("pytorch_model*.bin"))


def _weights_fingerprint(path: Path) -> bytes:
    """Size + safetensors header + sampled tensor data of one weight file.

    Why not hash every byte: a 7B bf16 checkpoint is ~15 GB; reading it at 1-2 GB/s (much less from
    network storage) would add many seconds to every server start and handshake. The identity
    guards against deployment mistakes (wrong model, revision or fine-tune), not tampering, and
    weight transfers carry their own checksums. The header pins every tensor's name, dtype, shape
    and offsets; the samples catch a re-initialised or fine-tuned checkpoint of the same shape,
    since training changes nearly every weight. Small files (tiny test models) are hashed whole.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        header = b""
        if path.suffix == ".safetensors" and size >= 8:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = struct.pack("<Q", header_len) + f.read(header_len)
        start = len(header)
        out = [struct.pack("<Q", size), header]
        data_len = size - start
        if data_len <= SAMPLE_BUDGET:
            f.seek(start)
            out.append(f.read())
        else:
            span = data_len - SAMPLE_CHUNK_BYTES  # first chunk at the start, last at the end
            for i in range(SAMPLE_CHUNKS):
                f.seek(start + span * i // (SAMPLE_CHUNKS - 1))
                out.append(f.read(SAMPLE_CHUNK_BYTES))
    return b"".join(out)


def _vocab_size(root: Path) -> int | None:
    ids: set[int] = set()
    if (root / "tokenizer.json").is_file():
        spec = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = spec.get("model", {}).get("vocab", {})
        # BPE / WordPiece / WordLevel map token -> id; Unigram is a list of [piece, score].
        ids.update(vocab.values() if isinstance(vocab, dict) else range(len(vocab)))
        ids.update(token["id"] for token in spec.get("added_tokens", []))
    else:
        for name in ("vocab.json", "added_tokens.json"):
            if (root / name).is_file():
                ids.update(json.loads((root / name).read_text(encoding="utf-8")).values())
    return max(ids) + 1 if ids else None


def embedding_rows(model_dir: str | Path) -> int:
    """The model's vocabulary size in ``config.json`` (its embedding rows); 0 if unknown."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    value = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0
    return int(value) if isinstance(value, int) else 0


def wire_identities(model_dir: str | Path) -> tuple[Identity, Identity]:
    """(model, tokenizer) identities of `model_dir` as the protocol's HELLO/handshake carries them."""

    m, t = model_identity(model_dir), tokenizer_identity(model_dir)
    return WireIdentity(m["name"], m["sha256"]), WireIdentity(
        t["name"], t["sha256"], t["vocab_size"] or 0
    )
