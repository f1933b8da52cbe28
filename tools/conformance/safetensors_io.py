"""Loading a model directory's ``*.safetensors`` files as ``NamedBuffer``s for the weights check.

Files are loaded with the ``safetensors`` numpy API. numpy has no bfloat16 or float8, so a file
holding such tensors (most LLM checkpoints) cannot go through that API; those files are read as raw
bytes at the offsets their JSON header names instead. The protocol moves raw bytes with a dtype
name, so no conversion is needed either way, and no torch import.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from protocol.weights import NamedBuffer

DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}


def load_dir(directory: Path) -> list[NamedBuffer]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--weights-from {directory}: no *.safetensors files there")
    out: list[NamedBuffer] = []
    for path in files:
        out.extend(load_file(path))
    return out


def _header(path: Path) -> tuple[int, dict]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def load_file(path: Path) -> list[NamedBuffer]:
    data_start, header = _header(path)
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    unknown = sorted({v["dtype"] for v in entries.values()} - DTYPES.keys())
    if unknown:
        raise ValueError(f"{path}: dtypes {unknown} cannot be sent (protocol.weights knows {sorted(DTYPES)})")
    try:
        from safetensors.numpy import load_file as st_load

        arrays = st_load(str(path))
    except (KeyError, TypeError, ValueError):  # a dtype numpy cannot hold: read raw bytes instead
        arrays = None
    raw = path.read_bytes() if arrays is None else b""
    out = []
    for name in sorted(entries):
        e = entries[name]
        if arrays is not None:
            buf = memoryview(np.ascontiguousarray(arrays[name]).reshape(-1).view(np.uint8))
        else:
            begin, end = e["data_offsets"]
            buf = memoryview(raw)[data_start + begin : data_start + end]
        out.append(NamedBuffer(name, DTYPES[e["dtype"]], tuple(e["shape"]), buf))
    return out
