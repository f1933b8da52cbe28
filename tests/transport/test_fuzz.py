"""Fuzzing the receive path: hostile frames must only ever produce typed ERRORs, never a crash.

Live: 10,000+ deterministic random and mutated messages go over a real DEALER socket to a live
``LearnerServer``. After each, a probe (a HEARTBEAT whose ``time`` is a marked string, so the
learner answers with an ERROR quoting it) marks the end of that message's answers. Every answer is
checked against the local codec: a message the codec rejects gets exactly one ERROR with the same
code, type and seq, unless it is itself an ERROR (never answered). Afterwards a fresh rollout
client must still handshake and deliver a batch.

Sans sockets: hypothesis feeds random frames and mutated encodings to ``codec.decode`` (only
``ProtocolError`` may come out) and to both state machines (nothing may come out).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import anyio
import msgpack
import pytest
import zmq
import zmq.asyncio
from fuzz_corpus import Frames, cases, valid_encodings, wire
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transport_testkit import (
    TOKENIZER,
    ZmqNet,
    client_running,
    learner_running,
    make_batch,
    submit_all,
)

from protocol import codec
from protocol.errors import ErrorCode, ProtocolError
from protocol.events import PeerJoined, ProtocolViolation
from protocol.messages import Error, Hello, MsgType
from protocol.receiver import LearnerProtocol
from protocol.sender import RolloutConnection
from protocol.weights import NamedBuffer

SEED = 20240611
N_CASES = 10_000
LIMITS = codec.CodecLimits(max_message_bytes=512 << 10)
ERROR_CODES = {int(c) for c in ErrorCode}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _local_verdict(frames: Frames) -> ProtocolError | Any:
    try:
        return codec.decode(frames, LIMITS)
    except ProtocolError as e:
        return e


def _probe(i: int) -> Frames:
    return [bytes((MsgType.HEARTBEAT,)), msgpack.packb({"time": f"probe-{i}"})]


@pytest.mark.anyio
async def test_live_learner_survives_fuzzing_and_still_serves() -> None:
    net = ZmqNet()
    server = net.server("tcp://127.0.0.1:0", max_message_bytes=LIMITS.max_message_bytes)
    stats: collections.Counter[str] = collections.Counter()
    codes: collections.Counter[str] = collections.Counter()
    replies_by_type: collections.Counter[str] = collections.Counter()
    t0 = time.monotonic()
    async with learner_running(
        server, limits=LIMITS, heartbeat_interval_s=5.0, heartbeat_timeout_s=60.0
    ) as lh:
        w = bytearray(range(256)) * 4
        lh.server.publish_weights(
            0, [NamedBuffer("w", "uint8", (1024,), memoryview(w))], chunk_bytes=300
        )
        dealer = net.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(server.address)
        try:
            for i, (category, frames) in enumerate(
                cases(SEED, N_CASES, max_message_bytes=LIMITS.max_message_bytes)
            ):
                stats[category] += 1
                await dealer.send_multipart(frames, copy=len(frames[-1]) < 65536)
                await dealer.send_multipart(_probe(i))
                errors: list[Error] = []
                marker = f"(got 'probe-{i}')"
                with anyio.fail_after(10):
                    while True:
                        reply = wire(await dealer.recv_multipart(copy=False))
                        msg = codec.decode(reply)  # the learner only ever sends valid messages
                        if isinstance(msg, Error) and msg.message.endswith(marker):
                            assert msg.code == ErrorCode.INVALID_FIELD
                            break
                        replies_by_type[type(msg).__name__] += 1
                        if isinstance(msg, Error):
                            assert msg.code in ERROR_CODES, f"untyped error code {msg.code}"
                            errors.append(msg)
                _check_answers(category, frames, errors, stats, codes)
        finally:
            dealer.close(linger=0)
        elapsed = time.monotonic() - t0
        assert lh.stopped.is_set() is False, "the learner's driver stopped"

        # Still serving: a fresh rollout server handshakes and delivers.
        async with client_running(net.connector(server.address), peer_id="after-fuzz") as ch:
            batch = make_batch(3, tag="after-fuzz")
            seqs = await submit_all(ch.client, [batch])
            await ch.watch.until(lambda: ch.acked() == set(seqs), timeout=10)
        assert {t.trajectory_id for t in batch} <= set(lh.received_ids)
        assert "after-fuzz" in [e.peer_id for e in lh.watch.of(PeerJoined)]
        errors_answered = sum(codes.values())
        assert lh.proto.stats["errors_sent"] == errors_answered + N_CASES  # + one per probe
        assert len(lh.watch.of(ProtocolViolation)) >= errors_answered
    net.term()
    print(f"\nfuzz: {N_CASES} cases in {elapsed:.1f}s; categories {dict(stats)}")
    print(f"fuzz: ERROR answers by code {dict(codes)}; other replies {dict(replies_by_type)}")
    assert sum(stats[c] for c in stats if not c.startswith("answer")) == N_CASES
    assert stats["answer:rejected-locally"] > N_CASES // 2 and len(codes) >= 5


def _check_answers(
    category: str,
    frames: Frames,
    errors: list[Error],
    stats: collections.Counter[str],
    codes: collections.Counter[str],
) -> None:
    for e in errors:
        codes[ErrorCode(e.code).name] += 1
    local = _local_verdict(frames)
    if isinstance(local, ProtocolError):
        stats["answer:rejected-locally"] += 1
        if not codec.should_answer(local):
            assert not errors, f"{category}: an undecodable ERROR was answered with {errors}"
            return
        assert len(errors) == 1, f"{category}: expected one ERROR for {local}, got {errors}"
        (e,) = errors
        assert (e.code, e.ref_type, e.ref_seq) == (local.code, local.ref_type, local.ref_seq), (
            category,
            e,
            local,
        )
        assert e.fatal == local.code.fatal
        return
    stats["answer:decodable"] += 1
    if isinstance(local, Error):
        # Never answered, before the handshake or after (an ERROR war between peers never ends).
        assert not errors, f"{category}: a valid ERROR was answered with {errors}"
    assert len(errors) <= 1, f"{category}: several ERRORs for one message: {errors}"


# -- hypothesis, sans sockets ----------------------------------------------------------------------
VALID = valid_encodings()
FUZZ_SETTINGS = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from(["int32", "float32", "uint8", "answered", "rollout-server"]),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
random_frames = st.lists(st.binary(max_size=48), min_size=0, max_size=7)
structured = st.builds(
    lambda t, hdr, payload: [bytes((t,)), msgpack.packb(hdr, use_bin_type=True), *payload],
    st.integers(0, 12),
    msgpack_values
    | st.dictionaries(
        st.sampled_from(
            [
                "seq",
                "meta",
                "columns",
                "parts",
                "transfer_id",
                "version",
                "index",
                "code",
                "message",
                "time",
                "protocol_version",
                "peer_id",
                "role",
                "epoch",
                "model",
                "tokenizer",
                "seqs",
                "credits",
            ]
        ),
        msgpack_values,
        max_size=6,
    ),
    st.lists(st.binary(max_size=16), max_size=6),
)


@st.composite
def mutated(draw: st.DrawFn) -> Frames:
    frames = list(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(frames) - 1))
        op = draw(st.sampled_from(["flip", "cut", "grow", "drop", "dup"]))
        f = frames[i]
        if op == "flip" and f:
            j = draw(st.integers(0, len(f) - 1))
            frames[i] = f[:j] + bytes((f[j] ^ (1 << draw(st.integers(0, 7))),)) + f[j + 1 :]
        elif op == "cut":
            frames[i] = f[: draw(st.integers(0, len(f)))]
        elif op == "grow":
            frames[i] = f + draw(st.binary(min_size=1, max_size=8))
        elif op == "drop" and len(frames) > 1:
            del frames[i]
        elif op == "dup":
            frames.insert(i, f)
    return frames


def _decode_only_protocol_errors(frames: Frames) -> None:
    try:
        codec.decode(frames, LIMITS)
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode)


def _machines_never_raise(frames: Frames) -> None:
    learner = LearnerProtocol(tokenizer=TOKENIZER)
    learner.receive(b"x", frames, 0.0)
    hello = wire(codec.encode(Hello([1, 0], "p", "rollout-server", "e", TOKENIZER, TOKENIZER)))
    learner.receive(b"y", hello, 0.0)
    learner.receive(b"y", frames, 0.0)  # the same frames from a peer past its handshake
    for _, out in learner.data_to_send(0.0):
        codec.decode(out)
    rollout = RolloutConnection(peer_id="p", epoch="e", model=TOKENIZER, tokenizer=TOKENIZER)
    rollout.start(0.0)
    rollout.receive(frames, 0.0)
    for out in rollout.data_to_send(0.0):
        codec.decode(out)


@FUZZ_SETTINGS
@given(random_frames | structured | mutated())
def test_decode_raises_nothing_but_protocol_error(frames: Frames) -> None:
    _decode_only_protocol_errors(frames)


@FUZZ_SETTINGS
@given(random_frames | structured | mutated())
def test_state_machines_never_raise_on_hostile_frames(frames: Frames) -> None:
    _machines_never_raise(frames)
