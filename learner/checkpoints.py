"""Checkpoint directories of a run: naming, atomic completion, finding the one to resume from.

Design: a checkpoint is the directory ``global_step_<N>`` holding the workers' DCP shards, the
trainer's state (`trainer_state.msgpack`: step, policy version, KL controller, RNG, intake state)
and a Hugging Face export (``hf/``). It is written under a ``.tmp`` name and renamed when complete,
then ``latest_checkpointed_iteration.txt`` (verl's name) is replaced atomically; a learner killed at
any moment leaves either the previous checkpoint or the new one as the latest, never half of one.
Retention (`finalize`'s ``keep``) removes the oldest complete checkpoints after the new one is
published, sparing the one with the best validation reward in its state when asked.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, cast

import msgpack

from common.fileio import atomic_write_bytes

LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.msgpack"


def step_dir(root: Path, step: int) -> Path:
    return root / f"global_step_{step}"


def staging_dir(root: Path, step: int) -> Path:
    path = root / f"global_step_{step}.tmp"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def finalize(
    root: Path,
    staging: Path,
    step: int,
    state: dict[str, Any],
    *,
    keep: int | None = None,
    keep_best: bool = False,
) -> Path:
    """Write the trainer state, publish the staged directory as step ``step`` and mark it latest;
    then keep only the newest ``keep`` checkpoints (and the best by ``val_reward`` if
    ``keep_best``)."""
    # cast: msgpack's stub allows None (a Packer with autoreset off), packb always gives bytes
    atomic_write_bytes(staging / STATE, cast(bytes, msgpack.packb(state, use_bin_type=True)))
    final = step_dir(root, step)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    atomic_write_bytes(root / LATEST, f"{step}\n".encode())
    if keep:
        prune(root, keep, keep_best=keep_best)
    return final


def steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, oldest first."""
    return sorted(
        int(p.name.removeprefix("global_step_"))
        for p in root.glob("global_step_*")
        if p.name.removeprefix("global_step_").isdigit() and (p / STATE).exists()
    )


def _val_reward(root: Path, step: int) -> float:
    value = read_state(step_dir(root, step)).get("val_reward")
    return float(value) if isinstance(value, int | float) else float("-inf")


def prune(root: Path, keep: int, *, keep_best: bool = False) -> list[int]:
    """Remove all but the newest ``keep`` checkpoints (sparing the best by validation reward if
    ``keep_best``); the steps removed."""
    done = steps(root)
    old = done[:-keep]
    if keep_best and old:
        best = max(done, key=lambda s: (_val_reward(root, s), s))
        old = [s for s in old if s != best]
    for s in old:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
    return old


def latest(root: Path) -> Path | None:
    """The latest complete checkpoint under ``root``, if any."""
    marker = root / LATEST
    if not marker.exists():
        return None
    path = step_dir(root, int(marker.read_text().strip()))
    return path if (path / STATE).exists() else None


def read_state(path: Path) -> dict[str, Any]:
    file = path / STATE
    if not file.exists():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no {STATE})")
    return msgpack.unpackb(file.read_bytes(), raw=False, strict_map_key=False)


def resume_point(mode: str, root: Path, resume_from: str | None) -> Path | None:
    """trainer.resume_mode: auto -> latest under root (or None), disable -> None, resume_path -> that."""
    if mode == "disable":
        return None
    if mode == "resume_path":
        assert resume_from is not None
        path = Path(resume_from)
        read_state(path)  # a clear error now rather than a worker failing later
        return path
    return latest(root)
