"""What a full weight update of a `VllmEngine` must match, and how its bytes are staged for vLLM.

Design: ``Checkpoint`` holds the names and shapes of the model's safetensors headers (read once at
start, no tensor data); every full update is checked against it before anything is touched.
Updates received as arrays are written as one safetensors file (``stage_safetensors``) into a
fresh directory, RAM-backed when /dev/shm has room, which vLLM's in-place ``reload_weights`` reads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.safetensors_buffers import CODES, header_bytes, read_header
from rollout_service.engine.base import WeightUpdateError

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """Names and shapes an update must match (from the model dir's safetensors headers)."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    optional: frozenset[str] = frozenset()  # accepted but not required (tied lm_head)

    def check(
        self, version: int, current: int, tensors: list[tuple[str, tuple[int, ...], str]]
    ) -> None:
        """Refuses (WeightUpdateError) full weights for ``version`` over ``current`` that do not
        fit: ``tensors`` is (name, shape, numpy-style dtype name) of every tensor of the update."""
        check_newer(version, current)
        names = [name for name, _, _ in tensors]
        problems = []
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            problems.append(f"duplicate names {dupes[:5]}")
        if unknown := sorted(set(names) - set(self.shapes) - self.optional):
            problems.append(
                f"unknown names {unknown[:5]} (the checkpoint has e.g. {sorted(self.shapes)[:3]})"
            )
        if missing := sorted(set(self.shapes) - set(names)):
            problems.append(f"missing names {missing[:5]} ({len(missing)} in all)")
        for name, shape, dtype in tensors:
            want = self.shapes.get(name)
            if want is not None and tuple(shape) != want:
                problems.append(f"{name}: shape {tuple(shape)}, the model has {want}")
            if dtype not in SAFETENSORS_DTYPES:
                problems.append(f"{name}: dtype {dtype} is not a floating type")
        if problems:
            raise WeightUpdateError(
                f"refused weights for version {version}: " + "; ".join(problems)
            )


def check_newer(version: int, current: int) -> None:
    """Versions only go forward: an update to ``version`` over ``current``."""
    if version <= current:
        raise WeightUpdateError(f"version {version} is not newer than the current {current}")


def read_checkpoint(model_dir: Path) -> Checkpoint:
    """Names and shapes from the safetensors headers (no tensor data is read)."""
    ckpt = Checkpoint()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: cannot check weight updates")
    for path in files:
        ckpt.shapes.update((name, shape) for name, (_, shape) in read_header(path).items())
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("tie_word_embeddings") and "lm_head.weight" not in ckpt.shapes:
        ckpt.optional = frozenset({"lm_head.weight"})
    return ckpt


# The floating dtypes weights may arrive in: numpy dtype name -> safetensors code, taken from the
# one safetensors table (bfloat16/fp8 names are ml_dtypes').
SAFETENSORS_DTYPES = {
    name: CODES[name]
    for name in ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
}


def stage_root(shm_dir: str | None, nbytes: int) -> str | None:
    """Where to stage an update of ``nbytes``: ``shm_dir`` if set, else /dev/shm (RAM, no disk
    I/O) when it has room; containers often give it only 64 MiB, and then the default temp dir."""
    if shm_dir is not None:
        return shm_dir
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 1.1 * nbytes:
        return "/dev/shm"
    log.warning(
        "/dev/shm lacks %.2f GB: staging weight updates in %s",
        nbytes / 1e9,
        tempfile.gettempdir(),
    )
    return None


def stage_safetensors(tensors: list[tuple[str, np.ndarray]], root: str | None) -> Path:
    """Writes the update as one safetensors file in a fresh temp dir (RAM-backed when possible)."""
    out = Path(tempfile.mkdtemp(prefix="vllm-weights-", dir=root))
    try:
        write_safetensors(tensors, out / "model.safetensors")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def write_safetensors(tensors: list[tuple[str, np.ndarray]], path: Path) -> None:
    """``tensors`` as the safetensors file ``path``.

    Written by hand (8-byte header length, JSON header, raw bytes) straight from the arrays'
    buffers: safetensors.numpy.save_file first copies every tensor with tobytes(), one more full
    copy of the model in RAM at the moment memory is tightest (same speed otherwise)."""
    import numpy as np

    if bad := [f"{n}: {a.dtype}" for n, a in tensors if a.dtype.name not in SAFETENSORS_DTYPES]:
        raise WeightUpdateError(
            f"cannot stage {bad[:3]} (known dtypes: {sorted(SAFETENSORS_DTYPES)})"
        )
    arrays = [np.ascontiguousarray(a) for _, a in tensors]
    head = header_bytes(
        [(n, a.dtype.name, a.shape, a.nbytes) for (n, _), a in zip(tensors, arrays, strict=True)]
    )
    with path.open("wb") as f:
        f.write(head)
        for array in arrays:
            # a byte view: memoryview cannot cast ml_dtypes' bfloat16 ("E") to bytes
            f.write(array.reshape(-1).view(np.uint8).data)
