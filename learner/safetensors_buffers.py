"""Raw tensors of a safetensors checkpoint as NamedBuffers, memory-mapped, for any dtype.

The learner publishes its version-0 policy (the checkpoint it starts from) to rollout servers that
ask for weights. Reading the format directly (8-byte header length, JSON header, raw data) keeps
bf16 and fp8 bytes as they are, where numpy-based loaders cannot represent them, and copies nothing.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

from protocol.weights import NamedBuffer

_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def load_buffers(model_dir: str | Path) -> list[NamedBuffer]:
    out: list[NamedBuffer] = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (n,) = struct.unpack("<Q", mm[:8])
        header = json.loads(mm[8 : 8 + n])
        data = memoryview(mm)[8 + n :]
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            out.append(NamedBuffer(name, _DTYPES[meta["dtype"]], tuple(meta["shape"]), data[start:end]))
    if not out:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    return out
