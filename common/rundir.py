"""The run directory: where a process writes its resolved config, logs and metrics.

Design: `trainer.run_dir` is a format string (`runs/{experiment_name}`) resolved from the trainer
section, so the learner and every rollout server sharing a config (and a filesystem) meet in the
same directory. The resolved config is saved first, so any run, even one that crashes at start-up,
leaves behind exactly what it was started with.
"""

from __future__ import annotations

from pathlib import Path

from common.config import Config, dump_config
from common.fileio import atomic_write_bytes

RESOLVED_CONFIG_NAME = "config.resolved.yaml"


def resolve_run_dir(config: Config) -> Path:
    """trainer.run_dir with its {experiment_name}/{project_name} placeholders filled in."""
    trainer = config.trainer
    return Path(
        trainer.run_dir.format(
            experiment_name=trainer.experiment_name, project_name=trainer.project_name
        )
    )


def checkpoint_dir(config: Config, run_dir: Path) -> Path:
    """Where checkpoints go: trainer.default_local_dir, else <run_dir>/checkpoints."""
    local = config.trainer.default_local_dir
    return Path(local) if local else run_dir / "checkpoints"


def prepare_run_dir(config: Config, run_dir: Path | None = None) -> Path:
    """Create `run_dir` (default: resolve_run_dir(config)) and save the resolved config in it.

    The file is written to a temporary name and renamed, so a reader never sees half a config.
    Returns the directory.
    """
    run_dir = run_dir if run_dir is not None else resolve_run_dir(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(
        run_dir / RESOLVED_CONFIG_NAME, dump_config(config).encode("utf-8"), durable=False
    )
    return run_dir
