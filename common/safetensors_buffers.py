"""Raw tensors of a safetensors checkpoint as NamedBuffers, memory-mapped, for any dtype.

Used wherever weights are sent as they lie on disk: the learner publishing the checkpoint it starts
from (version 0), and the conformance suite's ``--weights-from``; and on the receiving side, for
``model_manifest``: what a weight update of the model may hold, from the headers alone. Reading the format directly
(8-byte header length, JSON header, raw data) keeps bf16 and fp8 bytes as they are, where numpy-based
loaders cannot represent them, imports no torch, and copies nothing.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

from common.identity import display_name
from protocol.weights import ModelManifest, NamedBuffer

DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


CODES = {name: code for code, name in DTYPES.items()}


def header_bytes(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """The 8-byte length and padded JSON header of a safetensors file holding ``tensors`` (name,
    dtype as in NamedBuffer, shape, byte size) laid end to end in that order; the raw bytes follow
    it. Raises KeyError for a dtype the format lacks."""
    header, offset = {}, 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {
            "dtype": CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so that the data starts aligned
    return len(raw).to_bytes(8, "little") + raw


MAX_HEADER_BYTES = 100 << 20  # the format's own limit on the JSON header


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype as in NamedBuffer, shape) from a safetensors header; no tensor data is read.
    ValueError for a file that is no safetensors file: its first 8 bytes are never trusted as a
    length to allocate (any file read as a header would claim petabytes)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 0 < n <= min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(
                f"{path}: not a safetensors file (header length {n}, file {size} bytes, "
                f"limit {MAX_HEADER_BYTES})"
            )
        header = json.loads(f.read(n))
    return {
        name: (_dtype_name(meta["dtype"]), tuple(meta["shape"]))
        for name, meta in header.items()
        if name != "__metadata__"
    }


def _dtype_name(code: str) -> str:
    """numpy's name of a safetensors dtype code (an unknown code stays as it is)."""
    return DTYPES.get(code, code)


def model_manifest(model_dir: str | Path) -> ModelManifest:
    """Names, dtypes and shapes of every tensor of the model in ``model_dir`` (its safetensors
    headers; no tensor data is read). With ``tie_word_embeddings`` and no ``lm_head.weight`` on
    disk, an update may still carry one, shaped like the embedding."""

    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{root}: no *.safetensors files: cannot tell which weights this model takes"
        )
    tensors = {name: spec for path in files for name, spec in read_header(path).items()}
    optional = {}
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    embed = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
    if config.get("tie_word_embeddings") and "lm_head.weight" not in tensors and embed is not None:
        optional["lm_head.weight"] = tensors[embed]
    return ModelManifest(tensors, optional, name=f"model {display_name(root)!r}")


def load_file(path: Path, *, writable: bool = False) -> list[NamedBuffer]:
    """The file's tensors as views of one mapping of it; ``writable``: a private (copy-on-write)
    mapping, for readers such as ``torch.frombuffer`` that want writable memory (nothing is
    copied unless written, and nothing written reaches the file)."""
    access = mmap.ACCESS_COPY if writable else mmap.ACCESS_READ
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=access)
    (n,) = struct.unpack("<Q", mm[:8])
    header = json.loads(mm[8 : 8 + n])
    data = memoryview(mm)[8 + n :]
    out = []
    for name in sorted(k for k in header if k != "__metadata__"):
        meta = header[name]
        if meta["dtype"] not in DTYPES:
            raise ValueError(
                f"{path}: tensor {name} has dtype {meta['dtype']}, which cannot be sent "
                f"(known: {sorted(DTYPES)})"
            )
        start, end = meta["data_offsets"]
        out.append(NamedBuffer(name, DTYPES[meta["dtype"]], tuple(meta["shape"]), data[start:end]))
    return out


def save_file(path: str | Path, tensors: list[NamedBuffer]) -> int:
    """``tensors`` as the safetensors file ``path``, written beside it and renamed into place (a
    reader, or a mapping of the file it replaces, never sees it half written); its size in bytes."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    head = header_bytes([(t.name, t.dtype, t.shape, memoryview(t.data).nbytes) for t in tensors])
    with tmp.open("wb") as f:
        f.write(head)
        for t in tensors:
            f.write(memoryview(t.data).cast("B"))
    os.replace(tmp, target)
    return len(head) + sum(memoryview(t.data).nbytes for t in tensors)


def load_dir(directory: str | Path, *, writable: bool = False) -> list[NamedBuffer]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files there")
    return [t for path in files for t in load_file(path, writable=writable)]
