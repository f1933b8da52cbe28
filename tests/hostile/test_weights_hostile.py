"""A hostile learner against a real rollout server process: weight announces that lie.

The server is the real ``RolloutServer`` with its real ZeroMQ client, in a child process of its own
(this file run as a script), on the tiny model; only generation is scripted, so it starts in
seconds instead of vLLM's minute. Its engine names the tiny model's manifest, as ``VllmEngine``
does. The test plays the learner on a bare ROUTER socket with the protocol's own encoder and
measures the child's RSS. Checked (issue 16, SPEC §8 "Checks before allocating"):
- a ~200-byte announce claiming 3 GiB is refused (ERROR TOO_LARGE) and the RSS barely moves;
- an announce whose names or shapes are not the model's is refused, naming the tensor;
- a transfer cut off after some chunks is abandoned after ``weights_timeout_s`` with ERROR
  TIMED_OUT and WEIGHTS_APPLIED ok=false, logged once;
- file announces pointing at /etc/passwd, through a symlink or ``..`` out of the weights
  directory, or at a directory, are refused with ERROR INVALID_FIELD ``file``;
- a slot file whose first bytes claim a huge safetensors header is refused, not allocated for;
- afterwards the server still applies valid versions, as a file and as chunks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from protocol import codec
from protocol.errors import ErrorCode
from protocol.messages import (
    ADMISSION_CAPABILITY,
    WEIGHTS_FILE_CAPABILITY,
    Error,
    Heartbeat,
    Hello,
    Limits,
    MsgType,
    TensorSpec,
    WeightsAnnounce,
    WeightsApplied,
    Welcome,
)
from protocol.version import PROTOCOL_VERSION
from protocol.weights import plan_transfer

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2.0  # rollout_server.weights_timeout_s of the child
MAX_RSS_GROWTH = 100 << 20


# -- the child: a real RolloutServer --------------------------------------------------------------
def _serve(tmp: Path, model: Path, address: str, shm: Path) -> None:
    sys.path.insert(0, str(REPO / "tests" / "rollout"))
    from server_testkit import serve_scripted

    serve_scripted(tmp, model, address, shm, **{"rollout_server.weights_timeout_s": TIMEOUT_S})


# -- the hostile learner ----------------------------------------------------------------------------
@dataclass
class Learner:
    sock: zmq.Socket
    proc: subprocess.Popen
    log: Path
    identity: bytes = b""  # the session's; set by WELCOME
    last_from: bytes = b""
    version: int = 0

    def send(self, msg: Any) -> int:
        frames = codec.encode(msg)
        self.sock.send_multipart([self.identity, *frames], copy=False)
        return sum(len(memoryview(f).cast("B")) for f in frames)

    def recv(self, what: str, pred: Callable[[Any], bool], timeout: float = 10.0) -> Any:
        """The next message matching ``pred``; heartbeats go out meanwhile so the session lives."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            if self.identity:
                self.send(Heartbeat(time.time(), self.version))
            if self.sock.poll(200):
                identity, *frames = self.sock.recv_multipart()
                msg = codec.decode(frames)
                if pred(msg):
                    self.last_from = identity
                    return msg
                seen.append(type(msg).__name__)
        raise AssertionError(
            f"no {what} within {timeout} s (got {seen[-20:]}); server log:\n"
            f"{self.log.read_text()[-3000:]}"
        )

    def refusal(self, transfer_id: str, timeout: float = 10.0) -> tuple[WeightsApplied, Error]:
        applied = self.recv(
            f"WEIGHTS_APPLIED of {transfer_id}",
            lambda m: isinstance(m, WeightsApplied) and m.transfer_id == transfer_id,
            timeout,
        )
        err = self.recv("ERROR", lambda m: isinstance(m, Error), timeout)
        assert not applied.ok and err.ref_type == MsgType.WEIGHTS_ANNOUNCE and not err.fatal
        return applied, err

    def applied(self, transfer_id: str) -> WeightsApplied:
        return self.recv(
            f"WEIGHTS_APPLIED of {transfer_id}",
            lambda m: isinstance(m, WeightsApplied) and m.transfer_id == transfer_id,
        )

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss


@pytest.fixture(scope="module")
def shm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The learner's weights directory (``learner.weights_file_dir``) with one slot file."""
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def learner(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, shm: Path
) -> Iterator[Learner]:
    tmp = tmp_path_factory.mktemp("hostile")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    log = tmp / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, __file__, str(tmp), str(tiny_model), address, str(shm)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    lrn = Learner(sock, proc, log)
    try:
        hello = lrn.recv("HELLO", lambda m: isinstance(m, Hello), timeout=120)
        assert WEIGHTS_FILE_CAPABILITY in hello.capabilities
        lrn.identity = lrn.last_from
        # Admission with no grants: the server generates nothing, it only listens for weights.
        lrn.send(
            Welcome(
                list(PROTOCOL_VERSION),
                "hostile-learner",
                uuid.uuid4().hex,
                credits=0,
                policy_version=0,
                next_seq=1,
                heartbeat_interval_s=0.5,
                heartbeat_timeout_s=30.0,
                limits=Limits(256 << 20, 256, 1 << 20),
                capabilities=[ADMISSION_CAPABILITY],
            )
        )
        lrn.recv("HEARTBEAT", lambda m: isinstance(m, Heartbeat))
        yield lrn
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        sock.close(0)
        ctx.term()


def _tiny_tensors(model: Path) -> list[Any]:
    from common.safetensors_buffers import load_dir

    return load_dir(model)


def _file_announce(version: int, model: Path, path: str) -> WeightsAnnounce:
    """What the learner sends a local peer: the manifest, checksums 0, no chunks, and a path."""
    ann, _ = plan_transfer(version, _tiny_tensors(model))
    return replace(
        ann, tensors=[replace(t, checksum=0) for t in ann.tensors], num_chunks=0, file=path
    )


# -- the checks -------------------------------------------------------------------------------------
@pytest.mark.integration
def test_a_3_gib_announce_is_refused_without_allocating(learner: Learner, tiny_model: Path) -> None:
    ann, _ = plan_transfer(1, _tiny_tensors(tiny_model))
    embed = next(i for i, t in enumerate(ann.tensors) if t.name.endswith("embed_tokens.weight"))
    huge = TensorSpec(ann.tensors[embed].name, "float32", [3 << 28], 3 << 30, 0)  # 3 GiB of float32
    lie = WeightsAnnounce(1, "lie-3gib", [huge], num_chunks=1)
    before = learner.rss()
    size = learner.send(lie)
    _, err = learner.refusal("lie-3gib")
    time.sleep(0.5)
    grown = learner.rss() - before
    print(
        f"3 GiB announce ({size} bytes on the wire): refused with {ErrorCode(err.code).name}, "
        f"RSS {before / 2**20:.1f} MiB -> +{grown / 2**20:.1f} MiB"
    )
    assert size < 300 and err.code == ErrorCode.TOO_LARGE and err.field == "tensors"
    assert "3221225472 bytes" in err.message and "can hold" in err.message, err.message
    assert grown < MAX_RSS_GROWTH


@pytest.mark.integration
def test_an_announce_unlike_the_model_is_refused_naming_the_tensor(
    learner: Learner, tiny_model: Path
) -> None:
    ann, _ = plan_transfer(2, _tiny_tensors(tiny_model))
    first = ann.tensors[0]
    # same bytes, another shape
    bent = replace(first, shape=[*first.shape[:-1], 1, first.shape[-1]])
    renamed = replace(ann.tensors[1], name="model.layers.0.backdoor")
    lie = replace(ann, transfer_id="lie-shape", tensors=[bent, renamed, *ann.tensors[2:]])
    learner.send(lie)
    _, err = learner.refusal("lie-shape")
    assert err.code == ErrorCode.INVALID_FIELD and err.field == "tensors[0].shape", err.message
    assert (
        f"{first.name}: shape" in err.message
        and "model.layers.0.backdoor is not a tensor of" in err.message
    )


@pytest.mark.integration
def test_a_truncated_transfer_times_out_with_an_error(learner: Learner, tiny_model: Path) -> None:
    ann, chunks = plan_transfer(
        3, _tiny_tensors(tiny_model), chunk_bytes=64 << 10, transfer_id="cut-off"
    )
    assert len(chunks) > 4
    learner.send(ann)
    for c in chunks[: len(chunks) // 2]:
        learner.send(c)
    sent = time.monotonic()
    applied, err = learner.refusal("cut-off", timeout=TIMEOUT_S + 10)
    waited = time.monotonic() - sent
    print(
        f"truncated transfer ({len(chunks) // 2} of {len(chunks)} chunks): {ErrorCode(err.code).name} "
        f"after {waited:.1f} s (timeout {TIMEOUT_S} s)"
    )
    assert err.code == ErrorCode.TIMED_OUT and applied.version == 3
    assert f"{len(chunks) // 2} of {len(chunks)} chunks" in err.message, err.message
    assert TIMEOUT_S - 0.5 <= waited <= TIMEOUT_S + 5
    time.sleep(0.5)
    failures = [
        line
        for line in learner.log.read_text().splitlines()
        if "weight transfer failed" in line and "cut-off" in line
    ]
    assert len(failures) == 1, failures  # logged once


@pytest.mark.parametrize("how", ["etc_passwd", "symlink_out", "dotdot", "directory", "missing"])
@pytest.mark.integration
def test_a_file_announce_outside_the_weights_directory_is_refused(
    learner: Learner, tiny_model: Path, shm: Path, how: str
) -> None:
    slot = shm / f"agentrl-weights-{os.getpid()}-{how}" / "v4"
    slot.mkdir(parents=True)
    path = {
        "etc_passwd": "/etc/passwd",
        "symlink_out": str(slot / "model.safetensors"),
        "dotdot": f"{slot}/../../../../../../etc/passwd",
        "directory": str(slot),
        "missing": str(slot / "gone.safetensors"),
    }[how]
    if how == "symlink_out":
        (slot / "model.safetensors").symlink_to("/etc/passwd")
    ann = replace(_file_announce(4, tiny_model, path), transfer_id=f"file-{how}")
    learner.send(ann)
    applied, err = learner.refusal(ann.transfer_id)
    assert err.code == ErrorCode.INVALID_FIELD and err.field == "file" and path in err.message, (
        err.message
    )
    words = {"directory": "not a regular file", "missing": "No such file"}.get(
        how, "is not inside a learner weights"
    )
    assert words in err.message and applied.error == err.message


def test_a_garbage_slot_file_is_refused_without_trusting_its_header(tmp_path: Path) -> None:
    """Inside the directory, a file whose first 8 bytes claim a 3 GiB header (as /etc/shadow's do,
    read as one) is refused before the header is read: the engine reads headers with this."""
    from common.safetensors_buffers import read_header

    bad = tmp_path / "model.safetensors"
    bad.write_bytes((3 << 30).to_bytes(8, "little") + b"{}" * 1000)
    before = psutil.Process().memory_info().rss
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header(bad)
    assert psutil.Process().memory_info().rss - before < MAX_RSS_GROWTH


def test_an_abandoned_version_no_longer_holds_admission_back(tiny_model: Path) -> None:
    """An announce far ahead (10**9) whose chunks never come: once it is abandoned, the server's
    staleness bound counts from the weights it runs again, so generation does not stop for good."""
    sys.path.insert(0, str(REPO / "tests" / "rollout"))
    from scripted import ScriptedEngine
    from transformers import AutoTokenizer

    from common.logging import get_logger
    from common.timeline import TimelineWriter
    from protocol.events import WeightsFailed
    from rollout_service.granting import GrantBook
    from rollout_service.metrics import RolloutStats
    from rollout_service.weights_applier import WeightApplier

    class NoReplies:  # WEIGHTS_APPLIED goes back only for a load, and nothing is loaded here
        def weights_applied(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("no load, no WEIGHTS_APPLIED")

    async def no_wait() -> None:
        raise AssertionError("nothing here waits for a change")

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(str(tiny_model)), [], version=3)
    book = GrantBook(max_concurrent_episodes=4, max_staleness=1)
    book.session(grants=False)
    woken: list[int] = []
    weights = WeightApplier(
        engine,
        NoReplies(),  # pyright: ignore[reportArgumentType]
        book,
        on_weight_update="keep",
        stats=RolloutStats(server_id="hostile"),
        timeline=TimelineWriter.off(),
        log=get_logger("test"),
        wake=lambda: woken.append(book.newest_version),
        changed=no_wait,
    )
    weights.announce(10**9)
    assert book.newest_version == 10**9 and not book.may_admit(1, engine.policy_version)
    weights.transfer_failed(WeightsFailed(10**9, "abandoned"))
    assert book.newest_version == 3  # what the engine runs
    assert book.may_admit(1, engine.policy_version)
    weights.announce(5)
    weights.transfer_failed(WeightsFailed(4, "an older one"))  # not the newest: changes nothing
    assert book.newest_version == 5
    assert woken == [10**9, 3, 5]  # admission looked again after each change


@pytest.mark.integration
def test_the_server_still_applies_valid_versions(
    learner: Learner, tiny_model: Path, shm: Path
) -> None:
    slot = shm / f"agentrl-weights-{os.getpid()}-ok" / "v5"
    slot.mkdir(parents=True)
    shutil.copy(next(tiny_model.glob("*.safetensors")), slot / "model.safetensors")
    ann = replace(
        _file_announce(5, tiny_model, str(slot / "model.safetensors")), transfer_id="file-ok"
    )
    learner.send(ann)
    assert learner.applied("file-ok").ok
    ann, chunks = plan_transfer(
        6, _tiny_tensors(tiny_model), chunk_bytes=256 << 10, transfer_id="chunks-ok"
    )
    for m in (ann, *chunks):
        learner.send(m)
    applied = learner.applied("chunks-ok")
    assert applied.ok and applied.version == 6, applied.error


if __name__ == "__main__":
    _serve(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
