"""Batch files carry checksums that every reader checks: an edited recording or spool file is
refused naming the file and the part that changed, and `bin/replay --unchecked` reads it anyway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from rollout_service.recording import (
    ChecksumError,
    read_batch_file,
    read_recording,
    write_batch_file,
)
from tools.conformance.wire import batch_frames, tiny_trajectory
from tools.replay.cli import main as replay_main


def _written(tmp_path: Path) -> Path:
    path = tmp_path / "rec" / "batch-0000000001.msgpack"
    path.parent.mkdir()
    frames = batch_frames(1, [tiny_trajectory(f"t{i}") for i in range(3)])
    write_batch_file(path, frames, server_id="rs0", seq=1, durable=False)
    return path


def _edit(path: Path, change: Any) -> None:
    doc = msgpack.unpackb(path.read_bytes(), raw=False)
    change(doc)
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))


def _column(doc: dict[str, Any], name: str) -> int:
    columns = msgpack.unpackb(doc["frames"][1], raw=False)["columns"]
    return 2 + [c[0] for c in columns].index(name)


def _flip_mask(doc: dict[str, Any]) -> None:
    i = _column(doc, "response_mask")
    frame = bytearray(doc["frames"][i])
    frame[0] ^= 1
    doc["frames"][i] = bytes(frame)


def _edit_reward(doc: dict[str, Any]) -> None:
    header = msgpack.unpackb(doc["frames"][1], raw=False)
    header["meta"]["reward"] = [r + 1.0 for r in header["meta"]["reward"]]
    doc["frames"][1] = msgpack.packb(header, use_bin_type=True)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (_flip_mask, "(column 'response_mask') was changed"),
        (_edit_reward, "frame 1 (the header: per-trajectory fields such as reward"),
        (lambda doc: doc.update(seq=7), "its meta (server_id, seq or time) was changed"),
        (lambda doc: doc["frames"].pop(), "frames were added or removed"),
        (lambda doc: doc.pop("checksums"), "field 'checksums' missing"),
    ],
)
def test_an_edited_batch_file_is_refused_naming_what_changed(
    tmp_path: Path, change: Any, named: str
) -> None:
    path = _written(tmp_path)
    assert read_batch_file(path)[0].format == 2  # untouched: reads
    _edit(path, change)
    with pytest.raises(ChecksumError) as info:
        list(read_recording(path.parent))
    assert str(path) in str(info.value) and named in str(info.value)


def test_replay_refuses_an_edited_recording_unless_unchecked(
    tmp_path: Path, tiny_model: Path, capsys: Any
) -> None:
    path = _written(tmp_path)
    _edit(path, _edit_reward)
    inspect = ["inspect", str(path.parent), "--model", str(tiny_model), "--no-color"]
    assert replay_main(inspect) == 2
    assert "the header" in capsys.readouterr().err
    assert replay_main([*inspect, "--unchecked"]) == 0
    assert "t0" in capsys.readouterr().out
    # stream: refused before it connects, so the learner never trains the edited batch
    stream = ["stream", str(path.parent), "--to", "tcp://127.0.0.1:9", "--model", str(tiny_model)]
    assert replay_main(stream) == 2
    assert "was changed after it was written" in capsys.readouterr().err
