"""Finding recordings, and the config and model of the run that made them.

A user points ``bin/replay`` at one of three things: a run directory (``RUN_DIR/recordings/<id>/``
holds one recording per rollout server), one recording directory, or one batch file. ``find``
turns that into ``Recording``s: a server id, its batch files in write order, and the run
directory when the layout shows it (``<run_dir>/recordings/<server_id>``).

The config a rollout server ran with is the one it saved, ``RUN_DIR/rollout-server/<server_id>/
config.resolved.yaml`` (it names the server's shard, which rerun needs to find data rows); the
learner's ``RUN_DIR/config.resolved.yaml`` comes next (same file in a one-config run, other
shard). ``--config`` overrides both. Relative paths inside a config (the model, the data files)
are relative to the directory the server was started in, as they were for the server: run
``bin/replay`` from there or pass ``--model`` / overrides.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import ConfigError, load_config
from rollout_service.recording import BatchFileError, batch_files, read_batch_file

RESOLVED = "config.resolved.yaml"


class ReplayError(Exception):
    """A usage or set-up problem (not a recording, no config, no model): exit status 2."""


@dataclass
class Recording:
    directory: Path
    files: list[Path]
    run_dir: Path | None  # known when the recording sits in <run_dir>/recordings/<server_id>
    verify: bool = True  # check each file's checksums (False: --unchecked)
    _server_id: str | None = field(default=None, repr=False)

    @property
    def server_id(self) -> str:
        """The id in the files (the directory name is only a hint: files may have been copied)."""
        if self._server_id is None:
            self._server_id = str(read_meta(self.files[0], verify=self.verify).server_id)
        return self._server_id

    @property
    def label(self) -> str:
        return str(self.files[0] if len(self.files) == 1 else self.directory)

    def batches(self) -> Iterator[tuple[Any, list[Any]]]:
        """(meta, trajectories) of every file in order; ReplayError naming a damaged file."""

        for f in self.files:
            try:
                meta, msg = read_batch_file(f, verify=self.verify)
            except BatchFileError as e:
                raise ReplayError(str(e)) from None
            yield meta, list(msg.trajectories)


def read_meta(path: Path, *, verify: bool = True) -> Any:

    try:
        return read_batch_file(path, verify=verify)[0]
    except BatchFileError as e:
        raise ReplayError(str(e)) from None


def _run_dir_of(directory: Path) -> Path | None:
    return directory.parent.parent if directory.parent.name == "recordings" else None


def find(path: str | Path, *, verify: bool = True) -> list[Recording]:
    """The recordings ``path`` names (a run dir, a recording dir or a batch file); ``verify``:
    their readers check each file's checksums."""

    p = Path(path)
    if not p.exists():
        raise ReplayError(f"{p}: no such file or directory")
    if p.is_file():
        d = p.parent
        return [Recording(d, [p], _run_dir_of(d), verify)]
    if (p / "recordings").is_dir():
        found = [
            Recording(d, [f for _, f in batch_files(d)], p, verify)
            for d in sorted((p / "recordings").iterdir())
            if d.is_dir() and batch_files(d)
        ]
        if not found:
            raise ReplayError(
                f"{p / 'recordings'}: no batch files in any server's directory "
                "(was the run started with rollout_server.record=true?)"
            )
        return found
    files = [f for _, f in batch_files(p)]
    if files:
        return [Recording(p, files, _run_dir_of(p), verify)]
    raise ReplayError(
        f"{p}: not a recording: expected a run directory holding recordings/, a directory "
        "of batch-*.msgpack files (RUN_DIR/recordings/<server_id>), or one such file"
    )


def config_file(rec: Recording, explicit: str | Path | None = None) -> Path | None:
    """The config the recording's server ran with (``explicit`` wins); None when none is found."""
    if explicit is not None:
        p = Path(explicit)
        if not p.is_file():
            raise ReplayError(f"--config {p}: no such file")
        return p
    if rec.run_dir is None:
        return None
    for candidate in (
        rec.run_dir / "rollout-server" / rec.server_id / RESOLVED,
        rec.run_dir / RESOLVED,
    ):
        if candidate.is_file():
            return candidate
    return None


def _where_looked(rec: Recording) -> str:
    if rec.run_dir is None:
        return f"{rec.label} is not inside RUN_DIR/recordings/<server_id>, so no saved config can be found"
    return (
        f"looked for {rec.run_dir / 'rollout-server' / rec.server_id / RESOLVED} and "
        f"{rec.run_dir / RESOLVED}"
    )


def model_dir(rec: Recording, *, model: str | Path | None, config: str | Path | None) -> Path:
    """The model (tokenizer) directory: ``--model``, else ``actor_rollout_ref.model.path`` of the
    run's config (read as plain YAML: inspecting needs no validation)."""
    if model is not None:
        path, origin = Path(model), "--model"
    else:
        import yaml

        cfg = config_file(rec, config)
        if cfg is None:
            raise ReplayError(
                f"no config for the recording of {rec.server_id}: {_where_looked(rec)}; "
                "pass --model DIR (or --config FILE)"
            )
        try:
            tree = yaml.safe_load(cfg.read_text(encoding="utf-8")) or {}
            path = Path(tree["actor_rollout_ref"]["model"]["path"])
        except (KeyError, TypeError, yaml.YAMLError) as e:
            raise ReplayError(
                f"{cfg}: no actor_rollout_ref.model.path ({type(e).__name__}: {e}); "
                "pass --model DIR"
            ) from None
        origin = f"actor_rollout_ref.model.path in {cfg}"
    if not path.is_dir():
        raise ReplayError(
            f"model directory {path} ({origin}) does not exist here; relative paths are "
            f"relative to the directory the server ran in (now: {Path.cwd()}); pass --model DIR"
        )
    return path


def load_run_config(
    rec: Recording,
    *,
    config: str | Path | None,
    model: str | Path | None,
    overrides: list[str] | tuple[str, ...] = (),
) -> Any:
    """The validated ``Config`` the server ran with, plus overrides (``--model`` is one)."""

    cfg = config_file(rec, config)
    if cfg is None:
        raise ReplayError(
            f"no config for the recording of {rec.server_id}: {_where_looked(rec)}; "
            "pass --config FILE (the rollout server's config)"
        )
    extra = [*overrides, *([f"actor_rollout_ref.model.path={model}"] if model is not None else [])]
    try:
        loaded = load_config(cfg, extra, check_paths=False)
    except ConfigError as e:
        raise ReplayError(str(e)) from None
    path = Path(loaded.actor_rollout_ref.model.path)
    if not path.is_dir():
        raise ReplayError(
            f"model directory {path} (actor_rollout_ref.model.path in {cfg}) does not exist "
            f"here; relative paths are relative to the directory the server ran in (now: "
            f"{Path.cwd()}); pass --model DIR"
        )
    return loaded
