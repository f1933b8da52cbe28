"""A real ``bin/learner`` on the tiny model, and peers that act as hostile or valid rollout servers.

``LearnerProcess`` starts the learner (intake) as a child process with ``configs/default.yaml`` on
loopback and reads its RSS from /proc. ``Peer`` is a blocking ZeroMQ DEALER driven by the
protocol's own sans-IO ``RolloutConnection``: it handshakes, sends batches and waits for their ACK
or ERROR, so "the endpoint still serves a valid peer" is checked with the real protocol. Peers
present the run's token (``transport.auth`` defaults to token) unless told otherwise.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from common.peer_auth import TOKEN_FILE_NAME, read_token
from launcher.plan import free_port
from protocol import codec
from protocol.messages import Ack, Error, Welcome
from protocol.sender import RolloutConnection, SenderState
from protocol.trajectory import Trajectory
from protocol.zmq_auth import use_token

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class LearnerProcess:
    """``bin/learner`` (intake only) bound on a free loopback port, logging to ``log``."""

    def __init__(self, model: Path, run_dir: Path, *overrides: str) -> None:
        self.model, self.run_dir = model, run_dir
        self.address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
        self.log = run_dir.parent / "learner.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "bin/learner"),
                    "--config",
                    str(ROOT / "configs/default.yaml"),
                    f"actor_rollout_ref.model.path={model}",
                    f"learner.bind_address={self.address}",
                    f"trainer.run_dir={run_dir}",
                    *overrides,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        deadline = time.monotonic() + 90
        while "listening" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, (
                "the learner did not start:\n" + self.log.read_text()
            )
            time.sleep(0.1)

    @property
    def token(self) -> str:
        """The token the learner created in its run directory (``transport.auth: token``)."""
        return read_token(self.run_dir / TOKEN_FILE_NAME)

    @property
    def rss(self) -> int:
        assert self.proc.poll() is None, "the learner died:\n" + self.log.read_text()[-4000:]
        return rss_bytes(self.proc.pid)

    @property
    def log_bytes(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        """The log from byte ``offset`` (a ``log_bytes``) on. Sliced as bytes: the log has
        multi-byte characters (progress bars), so a byte offset into the decoded text lands past
        where it was taken, cutting off the first lines written since."""
        return self.log.read_bytes()[offset:].decode(errors="replace")

    def stop(self) -> int:
        """SIGINT, then wait; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


class RssWatch:
    """The highest RSS of a process seen by ``sample`` calls, above the one at creation."""

    def __init__(self, learner: LearnerProcess) -> None:
        self.learner = learner
        self.base = self.peak = learner.rss

    def sample(self) -> int:
        self.peak = max(self.peak, self.learner.rss)
        return self.peak - self.base

    def sample_for(self, seconds: float, every_s: float = 0.02) -> int:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample()
            time.sleep(every_s)
        return self.sample()

    @property
    def growth(self) -> int:
        return self.peak - self.base


def trajectory(prompt_len: int, response_len: int, *, vocab: int = 100) -> Trajectory:
    """A valid trajectory of the given lengths (token ids below ``vocab``)."""
    ids = np.arange(prompt_len + response_len, dtype=np.int32) % vocab
    return Trajectory(
        trajectory_id=uuid.uuid4().hex,
        group_uid=uuid.uuid4().hex[:8],
        prompt_ids=ids[:prompt_len],
        response_ids=ids[prompt_len:],
        response_mask=np.ones(response_len, np.uint8),
        rollout_logprobs=np.full(response_len, -0.5, np.float32),
        versions=np.zeros(response_len, np.int32),
        reward=1.0,
    )


class Peer:
    """A rollout server: a blocking DEALER driven by ``RolloutConnection``."""

    def __init__(
        self, learner: LearnerProcess, peer_id: str = "valid-peer", *, token: str | None = ""
    ) -> None:
        """``token``: presented at the handshake; "" (default): the learner's, None: none."""
        from common.identity import wire_identities

        model, tok = wire_identities(learner.model)
        self.conn = RolloutConnection(
            peer_id=peer_id,
            epoch=uuid.uuid4().hex,
            model=model,
            tokenizer=tok,
            heartbeat_interval_s=1.0,
            heartbeat_timeout_s=30.0,
        )
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if token is not None:
            use_token(self.sock, token or learner.token)
        self.sock.connect(learner.address)

    def _flush(self) -> None:
        for frames in self.conn.data_to_send(time.monotonic()):
            self.sock.send_multipart(frames, copy=False)

    def _until(self, done: Any, timeout_s: float) -> list[Any]:
        """Receive (answering heartbeats) until ``done(messages so far)``; the messages."""
        got: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while not done(got):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; received {[type(m).__name__ for m in got]}"
            if self.sock.poll(int(min(left, 0.5) * 1000)):
                frames = self.sock.recv_multipart(copy=False)
                got.append(codec.decode([f.buffer for f in frames], codec.CodecLimits()))
                self.conn.receive([f.buffer for f in frames], time.monotonic())
            self._flush()
        return got

    def handshake(self, timeout_s: float = 20.0) -> Welcome:
        self.conn.start(time.monotonic())
        self._flush()
        got = self._until(lambda ms: any(isinstance(m, Welcome) for m in ms), timeout_s)
        assert self.conn.state is SenderState.READY
        return next(m for m in got if isinstance(m, Welcome))

    def send_batch(self, trajs: list[Trajectory], timeout_s: float = 30.0) -> Ack | Error:
        """Submit one batch; its ACK or the ERROR that refers to it."""
        seq = self.conn.submit(trajs)
        self._flush()

        def answered(ms: list[Any]) -> bool:
            return any(
                (isinstance(m, Ack) and seq in m.seqs)
                or (isinstance(m, Error) and m.ref_seq == seq)
                for m in ms
            )

        got = self._until(answered, timeout_s)
        return next(
            m
            for m in got
            if (isinstance(m, Ack) and seq in m.seqs) or (isinstance(m, Error) and m.ref_seq == seq)
        )

    def close(self) -> None:
        self.sock.close(linger=0)


def serves_a_valid_peer(learner: LearnerProcess, peer_id: str) -> None:
    """A fresh rollout server handshakes and gets a valid batch acknowledged."""
    p = Peer(learner, peer_id)
    try:
        p.handshake()
        answer = p.send_batch([trajectory(8, 16), trajectory(8, 16)])
        assert isinstance(answer, Ack), answer
    finally:
        p.close()
