"""A recording's disk use is bounded (rollout_server.record_max_mb), and a write that fails (no
space) stops the recording with the path named, never the server or a torn file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout_service.recording import Recorder, batch_files, read_recording
from tools.conformance.wire import batch_frames, tiny_trajectory

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the recorder's thread hop is anyio's; trio adds nothing here


def _frames(seq: int) -> list:
    return batch_frames(seq, [tiny_trajectory(f"t{seq}-{i}", response_len=64) for i in range(4)])


@pytest.mark.anyio
async def test_the_oldest_files_go_once_the_recording_is_over_its_bound(tmp_path: Path) -> None:
    one = len(Path(await _written_one(tmp_path / "probe")).read_bytes())
    rec = Recorder(tmp_path / "rec", "rs0", max_bytes=7 * one // 2)
    for seq in range(1, 11):
        await rec.record(seq, _frames(seq))
    kept = batch_files(tmp_path / "rec")
    assert [n for n, _ in kept] == [8, 9, 10]
    assert rec.bytes == sum(p.stat().st_size for _, p in kept) <= 7 * one // 2
    assert [m.seq for m, _ in read_recording(tmp_path / "rec")] == [8, 9, 10]
    # a restarted server counts what is there and goes on numbering after it
    again = Recorder(tmp_path / "rec", "rs0", max_bytes=7 * one // 2)
    assert again.bytes == rec.bytes
    await again.record(11, _frames(11))
    assert [n for n, _ in batch_files(tmp_path / "rec")] == [9, 10, 11]


async def _written_one(directory: Path) -> Path:
    rec = Recorder(directory, "rs0")
    path = await rec.record(1, _frames(1))
    assert path is not None
    return path


# A process whose files may not grow past 4 KiB (RLIMIT_FSIZE: the write fails as on a full disk).
FULL_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys
    sys.path.insert(0, sys.argv[1])
    import anyio
    from rollout_service.recording import Recorder
    from tools.conformance.wire import batch_frames, tiny_trajectory

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    rec = Recorder(sys.argv[2], "rs0")
    frames = batch_frames(1, [tiny_trajectory(f"t{i}", response_len=512) for i in range(8)])
    first = anyio.run(rec.record, 1, frames)
    second = anyio.run(rec.record, 2, frames)
    print(json.dumps({"first": first, "second": second, "failed": rec.failed}))
    """
)


@pytest.mark.integration  # a child process with a file-size limit
def test_a_failed_write_stops_the_recording_naming_the_path(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(REPO), str(tmp_path / "rec")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["first"] is None and result["second"] is None
    assert str(tmp_path / "rec" / "batch-0000000001.msgpack") in result["failed"]
    assert "recording stopped" in out.stderr + out.stdout
    assert list((tmp_path / "rec").iterdir()) == []  # nothing torn, no temporary left
