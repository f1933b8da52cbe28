"""Reference endpoints: the smallest correct learner intake and rollout sender built on protocol/.

They exist so the conformance suite, the fuzz test and the benchmark have a live, protocol-correct
peer on each side before the real servers do, and so those servers can be compared with them.
``ReferenceLearner`` accepts batches, keeps the trajectories it received (deduplicated), frees room
at once, and serves a small fixed weight set as version 0 to joiners that ask for it.
``ReferenceRolloutServer`` streams synthetic valid trajectories and applies received weights into
a dict (verifying them is the assembler's job). Validation (1.1): the reference rollout server
offers the "validation" capability and answers every VALIDATE_REQUEST at once with metrics of a
few synthetic episodes; the reference learner, with ``validate_on_join``, asks every peer that
offers it to validate right after its handshake and keeps the results.

Run one from a shell: ``python -m protocol.reference learner --bind tcp://127.0.0.1:5555``
or ``python -m protocol.reference rollout-server --connect tcp://127.0.0.1:5555``.
"""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field

import anyio
import numpy as np

from common.identity import wire_identities
from protocol.driver import LearnerServer, RolloutClient
from protocol.events import (
    BatchReceived,
    PeerJoined,
    ValidationReceived,
    ValidationRequested,
    WeightsReceived,
)
from protocol.limits import CodecLimits
from protocol.messages import VALIDATION_CAPABILITY, Identity, ValidateRequest, ValidateResult
from protocol.receiver import LearnerProtocol
from protocol.sender import RolloutConnection
from protocol.trajectory import Trajectory
from protocol.validation import EpisodeOutcome, summarize
from protocol.weights import NamedBuffer
from protocol.zmq_auth import CurveClientKeys, CurveServerKeys
from protocol.zmq_transport import ZmqServerChannel, client_factory

# "" = accept any tokenizer
REFERENCE_TOKENIZER = Identity(name="reference", sha256="", vocab_size=512)
REFERENCE_MODEL = Identity(name="reference", sha256="0" * 64, vocab_size=512)


def tokenizer_from_dir(model_dir: str) -> Identity:
    """The tokenizer identity of a model directory, as a real rollout server would announce it."""

    return wire_identities(model_dir)[1]


def reference_weights(seed: int = 0) -> list[NamedBuffer]:
    """A small fixed weight set (deterministic), big enough to span several chunks."""
    rng = np.random.default_rng(seed)
    arrays = {
        "embed.weight": rng.standard_normal((512, 64), dtype=np.float32),
        "layer0.weight": rng.standard_normal((64, 64), dtype=np.float32),
        "layer0.bias": np.zeros(64, dtype=np.float32),
    }
    return [NamedBuffer(k, "float32", v.shape, memoryview(v).cast("B")) for k, v in arrays.items()]


def synthetic_trajectory(
    rng: np.random.Generator,
    *,
    server: str,
    prompt_len: int = 32,
    response_len: int = 64,
    version: int = 0,
    vocab: int = 512,
) -> Trajectory:
    """A valid trajectory with a tool span (mask 0) in the middle of the response."""
    mask = np.ones(response_len, dtype=np.uint8)
    mask[response_len // 3 : response_len // 2] = 0
    lp = np.where(mask == 1, -rng.random(response_len, dtype=np.float32), 0.0).astype(np.float32)
    return Trajectory(
        trajectory_id=uuid.uuid4().hex,
        group_uid=uuid.uuid4().hex[:8],
        prompt_ids=rng.integers(0, vocab, prompt_len, dtype=np.int32),
        response_ids=rng.integers(0, vocab, response_len, dtype=np.int32),
        response_mask=mask,
        rollout_logprobs=lp,
        versions=np.full(response_len, version, dtype=np.int32),
        reward=float(rng.random()),
        source_server=server,
        data_source="synthetic",
        agent_type="tool",
        termination="answered",
        num_turns=2,
        reward_extras={"acc": 1.0},
        timings={"generate_s": 0.01},
    )


@dataclass
class ReferenceLearner:
    bind: str = "tcp://127.0.0.1:0"
    capacity: int = 8
    max_credits_per_peer: int = 4
    limits: CodecLimits = field(default_factory=CodecLimits)
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    curve: CurveServerKeys | None = None
    validate_on_join: bool = (
        False  # ask every peer that offers validation to validate after its WELCOME
    )
    received: list[Trajectory] = field(default_factory=list)
    validations: list[tuple[str, ValidateResult]] = field(default_factory=list)  # (peer, result)

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        channel = ZmqServerChannel(
            self.bind, curve=self.curve, max_message_bytes=self.limits.max_message_bytes
        )
        self.address = channel.address
        proto = LearnerProtocol(
            tokenizer=REFERENCE_TOKENIZER,
            capacity=self.capacity,
            max_credits_per_peer=self.max_credits_per_peer,
            limits=self.limits,
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
        )
        self.server = server = LearnerServer(proto, channel)
        server.publish_weights(0, reference_weights(), chunk_bytes=32 << 10)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(server.run)
                task_status.started(self.address)
                async for ev in server.events:
                    if isinstance(ev, BatchReceived):
                        self.received.extend(ev.trajectories)
                        server.batch_consumed()
                    elif isinstance(ev, PeerJoined) and self.validate_on_join:
                        if VALIDATION_CAPABILITY in ev.hello.capabilities:
                            server.request_validation(
                                f"ref-{uuid.uuid4().hex[:8]}", proto.policy_version, timeout_s=30.0
                            )
                    elif isinstance(ev, ValidationReceived):
                        self.validations.append((ev.peer_id, ev.result))
        finally:
            await channel.aclose()


@dataclass
class ReferenceRolloutServer:
    connect: str
    peer_id: str = "reference-rollout"
    batches: int = 0  # 0: stream forever
    batch_size: int = 4
    curve: CurveClientKeys | None = None
    tokenizer: Identity = REFERENCE_TOKENIZER  # must match the learner's (see tokenizer_from_dir)
    applied: dict[int, dict[str, bytes]] = field(default_factory=dict)

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        conn = RolloutConnection(
            peer_id=self.peer_id,
            epoch=uuid.uuid4().hex,
            model=REFERENCE_MODEL,
            tokenizer=self.tokenizer,
            capabilities=[VALIDATION_CAPABILITY],
        )
        self.client = client = RolloutClient(conn, client_factory(self.connect, curve=self.curve))
        rng = np.random.default_rng(0)
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            task_status.started()

            async def produce() -> None:
                i = 0
                while not self.batches or i < self.batches:
                    while conn.pending >= 8:  # keep a small backlog; credits pace the wire
                        await anyio.sleep(0.01)
                    await client.submit(
                        [
                            synthetic_trajectory(
                                rng, server=self.peer_id, version=conn.policy_version
                            )
                            for _ in range(self.batch_size)
                        ]
                    )
                    i += 1
                while conn.pending:  # all handed over: leave once the learner owns every batch
                    await anyio.sleep(0.01)
                await client.close("done")

            tg.start_soon(produce)
            async for ev in client.events:
                if isinstance(ev, WeightsReceived):
                    w = ev.weights
                    self.applied[w.version] = {spec.name: bytes(buf) for spec, buf in w.tensors}
                    client.weights_applied(w.version, w.transfer_id, ok=True)
                elif isinstance(ev, ValidationRequested):
                    client.validation_result(synthetic_validation(ev.request, conn.policy_version))
            tg.cancel_scope.cancel()


def synthetic_validation(
    request: ValidateRequest, policy_version: int, *, episodes: int = 4, seed: int = 0
) -> ValidateResult:
    """The reference answer to a validation request: metrics of a few synthetic episodes."""
    rng = np.random.default_rng(seed)
    outcomes = [
        EpisodeOutcome(
            "synthetic",
            float(rng.random()),
            response_length=64,
            turns=2,
            termination="answered",
            extras={"acc": bool(i % 2)},
        )
        for i in range(episodes)
    ]
    return ValidateResult(
        request.request_id,
        max(policy_version, request.policy_version),
        sources=summarize(outcomes),
        prompts=episodes,
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m protocol.reference", description=(__doc__ or "").split("\n\n")[0]
    )
    ap.add_argument("role", choices=["learner", "rollout-server"])
    ap.add_argument("--bind", default="tcp://127.0.0.1:5555", help="learner: address to bind")
    ap.add_argument(
        "--connect", default="tcp://127.0.0.1:5555", help="rollout-server: learner address"
    )
    ap.add_argument(
        "--batches", type=int, default=0, help="rollout-server: batches to send (0 = forever)"
    )
    ap.add_argument(
        "--model", help="rollout-server: announce the tokenizer of this model directory"
    )
    ap.add_argument(
        "--validate-on-join",
        action="store_true",
        help="learner: ask every rollout server that offers validation to validate after it joins",
    )
    args = ap.parse_args()

    async def run() -> None:
        if args.role == "learner":
            learner = ReferenceLearner(bind=args.bind, validate_on_join=args.validate_on_join)
            async with anyio.create_task_group() as tg:
                addr = await tg.start(learner.serve)
                print(f"reference learner listening on {addr}", flush=True)
        else:
            tok = tokenizer_from_dir(args.model) if args.model else REFERENCE_TOKENIZER
            await ReferenceRolloutServer(
                connect=args.connect, batches=args.batches, tokenizer=tok
            ).serve()

    try:
        anyio.run(run)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
