"""Shared fakes for the protocol tests: deterministic trajectories, sample messages, a fake clock and
an in-memory network that pumps frames between ``RolloutConnection``s and one ``LearnerProtocol``.

``conftest.py`` puts this folder on ``sys.path`` (the suite runs with ``--import-mode=importlib``),
hence the distinctive module name: a plain ``helpers`` could shadow another folder's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from protocol import codec
from protocol.errors import ProtocolError
from protocol.events import BatchAcked, BatchReceived, Event
from protocol.messages import (
    Ack,
    Admit,
    Bye,
    ChunkPart,
    Error,
    Heartbeat,
    Hello,
    Identity,
    Limits,
    MsgType,
    SourceMetrics,
    TensorSpec,
    TrajectoryBatch,
    ValidateRequest,
    ValidateResult,
    WeightsAnnounce,
    WeightsApplied,
    WeightsChunk,
    Welcome,
)
from protocol.receiver import LearnerProtocol
from protocol.sender import RolloutConnection, SenderState
from protocol.trajectory import Trajectory
from protocol.version import PROTOCOL_VERSION, ProtocolVersion
from protocol.weights import NamedBuffer

TOKENIZER = Identity("tiny-tokenizer", "ab" * 32, 1000)
MODEL = Identity("tiny-model", "cd" * 32, 1000)
Frames = list[Any]


# -- data -------------------------------------------------------------------------------------------
def make_traj(
    tid: str = "t0",
    *,
    prompt_len: int = 3,
    response_len: int = 4,
    seed: int = 0,
    group_uid: str = "g0",
    **scalars: Any,
) -> Trajectory:
    """A valid trajectory with deterministic contents derived from ``seed``."""
    rng = np.random.default_rng(seed)
    mask = np.ones(response_len, np.uint8)
    mask[1::3] = 0  # every third token is a tool token
    lp = -rng.random(response_len, dtype=np.float32) * mask
    return Trajectory(
        trajectory_id=tid,
        group_uid=group_uid,
        prompt_ids=rng.integers(0, 1000, prompt_len, dtype=np.int32),
        response_ids=rng.integers(0, 1000, response_len, dtype=np.int32),
        response_mask=mask,
        rollout_logprobs=lp.astype(np.float32),
        versions=np.full(response_len, 3, np.int32),
        reward=0.5,
        **scalars,
    )


def trajs_equal(a: Trajectory, b: Trajectory) -> bool:
    arrays = ("prompt_ids", "response_ids", "response_mask", "rollout_logprobs", "versions")
    scalars = [k for k in Trajectory.__dataclass_fields__ if k not in arrays]
    return all(getattr(a, k) == getattr(b, k) for k in scalars) and all(
        np.array_equal(getattr(a, k), getattr(b, k)) for k in arrays
    )


def tensors(sizes: Iterable[int] = (10, 7), *, seed: int = 0) -> list[NamedBuffer]:
    """float32 tensors of the given element counts, deterministic."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):
        arr = rng.standard_normal(n).astype(np.float32)
        out.append(NamedBuffer(f"layer{i}.weight", "float32", (n,), memoryview(arr)))
    return out


def sample_messages() -> dict[MsgType, Any]:
    """One representative message per type (batch and chunk carry payload frames)."""
    return {
        MsgType.HELLO: Hello(
            [1, 0], "rollout-0", "rollout-server", "epoch-a", MODEL, TOKENIZER, 7, ["x"]
        ),
        MsgType.WELCOME: Welcome(
            [1, 0], "learner", "sess", 4, 7, 1, 1.0, 10.0, Limits(1 << 20, 64, 4096)
        ),
        MsgType.TRAJECTORY_BATCH: TrajectoryBatch(
            5,
            [
                make_traj(
                    "a", seed=1, reward_extras={"pass": True, "score": 0.25}, timings={"gen": 1.5}
                ),
                make_traj("b", prompt_len=2, response_len=0, seed=2, termination="length"),
            ],
        ),
        MsgType.ACK: Ack([1, 2], 3, [2]),
        MsgType.WEIGHTS_ANNOUNCE: WeightsAnnounce(
            8, "tx", [TensorSpec("w", "float32", [2, 2], 16, 123)], 2
        ),
        MsgType.WEIGHTS_CHUNK: WeightsChunk(
            "tx", 8, 1, [ChunkPart(0, 0, 3), ChunkPart(1, 4, 2)], (b"abc", b"de")
        ),
        MsgType.WEIGHTS_APPLIED: WeightsApplied(8, "tx", False, "boom", 0.25),
        MsgType.HEARTBEAT: Heartbeat(12.5, 7),
        MsgType.ERROR: Error(3, "bad", False, "HELLO.peer_id", 1, 0),
        MsgType.BYE: Bye("done"),
        MsgType.VALIDATE_REQUEST: ValidateRequest("val-1", 7, 30.0),
        MsgType.VALIDATE_RESULT: ValidateResult(
            "val-1",
            7,
            True,
            "",
            [source_metrics("math"), source_metrics("qa", count=0)],
            1,
            2,
            3,
            4.5,
        ),
        MsgType.ADMIT: Admit(8, 7),
    }


def source_metrics(name: str = "math", *, count: int = 4, **kw: Any) -> SourceMetrics:
    """Consistent validation metrics of one source (rewards 0.5 each, half of them correct)."""
    fields: dict[str, Any] = dict(
        data_source=name,
        count=count,
        reward_sum=0.5 * count,
        reward_mean=0.5 if count else 0.0,
        response_length_mean=12.0 if count else 0.0,
        turns_mean=1.5 if count else 0.0,
        terminations={"answered": count},
        extras_mean={"acc": 0.5} if count else {},
        extras_count={"acc": count} if count else {},
    )
    return SourceMetrics(**(fields | kw))


# -- raw frame surgery ------------------------------------------------------------------------------
def on_wire(frames: Frames) -> list[bytes]:
    """What a transport delivers: every frame as its own ``bytes`` (copied, like ZeroMQ)."""
    return [bytes(memoryview(f).cast("B")) for f in frames]


def header(frames: Frames) -> dict[str, Any]:
    return msgpack.unpackb(bytes(frames[1]), raw=False)


def with_header(frames: Frames, hdr: Any) -> Frames:
    return [frames[0], msgpack.packb(hdr, use_bin_type=True), *frames[2:]]


def decode_error(frames: Frames, limits: codec.CodecLimits | None = None) -> ProtocolError:
    """Decode ``frames`` expecting a ProtocolError, and return it."""
    try:
        msg = codec.decode(frames, limits or codec.CodecLimits())
    except ProtocolError as e:
        return e
    raise AssertionError(f"decoded without error: {msg!r}")


# -- in-memory network ------------------------------------------------------------------------------
class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now


@dataclass
class WireRecord:
    direction: str  # "up": rollout -> learner, "down": learner -> rollout
    identity: bytes
    frames: Frames
    dropped: bool

    @property
    def type(self) -> MsgType:
        return codec.peek_type(self.frames)

    def decoded(self) -> Any:
        return codec.decode(self.frames)


# drop(direction, identity, frames) -> True to lose the frames; mutate(...) -> frames to deliver
DropRule = Callable[[str, bytes, Frames], bool]
MutateRule = Callable[[str, bytes, Frames], Frames]


@dataclass
class Net:
    """A learner and any number of rollout connections, driven synchronously.

    ``pump`` moves frames until nobody has anything to send; ``check`` (if set) runs after every
    delivered message, so invariants are checked at every step, not only between pumps.
    """

    learner: LearnerProtocol
    clock: FakeClock = field(default_factory=FakeClock)
    conns: dict[bytes, RolloutConnection] = field(default_factory=dict)
    drop: DropRule | None = None
    mutate: MutateRule | None = None
    check: Callable[[Net], None] | None = None
    wire: list[WireRecord] = field(default_factory=list)
    learner_events: list[Event] = field(default_factory=list)
    sender_events: dict[bytes, list[Event]] = field(default_factory=dict)

    def add(
        self, identity: bytes, conn: RolloutConnection, *, request_weights: bool = False
    ) -> RolloutConnection:
        self.conns[identity] = conn
        self.sender_events.setdefault(identity, [])
        conn.start(self.clock.now, request_weights=request_weights)
        return conn

    def _carry(self, direction: str, ident: bytes, frames: Frames) -> Frames | None:
        frames = on_wire(frames)
        dropped = bool(self.drop and self.drop(direction, ident, frames))
        if not dropped and self.mutate:
            frames = self.mutate(direction, ident, frames)
        self.wire.append(WireRecord(direction, ident, frames, dropped))
        return None if dropped else frames

    def step(self) -> int:
        """One round: every sender's output to the learner, then the learner's output back."""
        now, moved = self.clock.now, 0
        for ident, conn in list(self.conns.items()):
            for frames in conn.data_to_send(now):
                moved += 1
                if (f := self._carry("up", ident, frames)) is not None:
                    self.learner_events += self.learner.receive(ident, f, now)
                    self._check()
        for ident, frames in self.learner.data_to_send(now):
            moved += 1
            if (f := self._carry("down", ident, frames)) is not None and ident in self.conns:
                self.sender_events[ident] += self.conns[ident].receive(f, now)
                self._check()
        return moved

    def pump(self, max_rounds: int = 200) -> None:
        for _ in range(max_rounds):
            if self.step() == 0:
                return
        raise AssertionError("network did not go quiet (message storm?)")

    def _check(self) -> None:
        if self.check is not None:
            self.check(self)

    def tick(self) -> None:
        now = self.clock.now
        for ident, conn in self.conns.items():
            self.sender_events[ident] += conn.tick(now)
        self.learner_events += self.learner.tick(now)

    def advance(self, dt: float) -> None:
        """Move the clock, run timers, then pump."""
        self.clock.advance(dt)
        self.tick()
        self.pump()

    def run_for(self, seconds: float, step: float = 0.25) -> None:
        """Let time pass in small steps, so heartbeats flow wherever they are not dropped."""
        end = self.clock.now + seconds
        while self.clock.now < end - 1e-9:
            self.advance(min(step, end - self.clock.now))

    def reconnect_idle(self) -> None:
        """What a driver does: an IDLE connection opens a fresh session."""
        for conn in self.conns.values():
            if conn.state is SenderState.IDLE:
                conn.start(self.clock.now)

    # -- observations ---------------------------------------------------------------------------
    def sent(self, direction: str, t: MsgType, ident: bytes | None = None) -> list[WireRecord]:
        """Messages put on the wire (dropped ones included) in one direction, of one type."""
        return [
            r
            for r in self.wire
            if r.direction == direction and r.type == t and (ident is None or r.identity == ident)
        ]

    def received(self) -> list[BatchReceived]:
        return [e for e in self.learner_events if isinstance(e, BatchReceived)]

    def delivered_ids(self) -> list[str]:
        return [t.trajectory_id for e in self.received() for t in e.trajectories]

    def acked(self, ident: bytes) -> list[int]:
        return sorted(
            s for e in self.sender_events[ident] if isinstance(e, BatchAcked) for s in e.seqs
        )

    def events(self, ident: bytes, kind: type) -> list[Any]:
        return [e for e in self.sender_events[ident] if isinstance(e, kind)]

    def learner_events_of(self, kind: type) -> list[Any]:
        return [e for e in self.learner_events if isinstance(e, kind)]

    def errors_sent(self, direction: str) -> list[Error]:
        return [r.decoded() for r in self.sent(direction, MsgType.ERROR)]


def learner(**kw: Any) -> LearnerProtocol:
    kw.setdefault("tokenizer", TOKENIZER)
    return LearnerProtocol(**kw)


def rollout(
    peer_id: str = "rollout-0",
    epoch: str = "epoch-1",
    *,
    version: ProtocolVersion = PROTOCOL_VERSION,
    **kw: Any,
) -> RolloutConnection:
    kw.setdefault("tokenizer", TOKENIZER)
    kw.setdefault("model", MODEL)
    return RolloutConnection(peer_id=peer_id, epoch=epoch, version=version, **kw)


def connected(*, capacity: int = 16, max_credits: int = 4, n: int = 1, **learner_kw: Any) -> Net:
    """A network with ``n`` rollout connections (identities r0, r1, ...) past the handshake."""
    net = Net(learner(capacity=capacity, max_credits_per_peer=max_credits, **learner_kw))
    for i in range(n):
        net.add(f"r{i}".encode(), rollout(f"rollout-{i}"))
    net.pump()
    assert all(c.state is SenderState.READY for c in net.conns.values())
    return net
