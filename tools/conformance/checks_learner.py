"""Checks of a learner endpoint (``--role learner``): the suite plays rollout servers.

Each check opens its own DEALER sockets under fresh peer_ids and epochs (``LearnerTarget.peer``),
so checks are independent and any subset can run; sessions get a BYE afterwards so the learner's
room is free for the next check. Where the protocol says "no reply", absence is proven with a
barrier instead of a sleep where possible: the learner answers a session in order, so an ACK for a
batch sent after X proves that nothing about X is still coming.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from collections.abc import Callable

import msgpack
import numpy as np
import zmq

from protocol import codec
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import (
    VALIDATION_CAPABILITY,
    Ack,
    Bye,
    Error,
    Heartbeat,
    MsgType,
    SourceMetrics,
    TrajectoryBatch,
    ValidateRequest,
    ValidateResult,
    WeightsAnnounce,
    WeightsApplied,
    WeightsChunk,
    Welcome,
)
from protocol.reference import synthetic_validation
from protocol.version import NUMBER_FRAMES, PROTOCOL_VERSION, ProtocolVersion
from protocol.weights import WeightAssembler
from protocol.zmq_auth import token_keys
from tools.conformance import credit_window, wire
from tools.conformance.peer import LearnerTarget, Peer
from tools.conformance.registry import CheckFailed, register
from tools.conformance.wire import Frames, Received

BIG_MESSAGE_SKIP_BYTES = 512 << 20  # above this the byte-size variant of `oversize` is skipped
MAX_COUNT_VARIANT = 200_000  # trajectories; above this the count variant of `oversize` is skipped
MAX_EXTRA_PEERS = 64  # credit_limit: sessions opened at most to use up the learner's room
QUIET_S = 0.25  # credit_limit: after the last verdict, how long stray replies are still collected


def _acks(seq: int) -> Callable[[Received], bool]:
    return lambda r: isinstance(r.msg, Ack) and seq in r.msg.seqs


def _is_error(r: Received) -> bool:
    return isinstance(r.msg, Error)


async def _ack_of(p: Peer, seq: int, what: str = "") -> Ack:
    rec = await p.expect(what or f"ACK for batch {seq}", _acks(seq), fail_on_error=f"batch {seq}")
    assert isinstance(rec.msg, Ack)
    return rec.msg


async def _send_and_ack(t: LearnerTarget, p: Peer, seq: int) -> Ack:
    await p.await_credit()
    await p.send_batch(t.batch(seq))
    return await _ack_of(p, seq)


async def _error_for(p: Peer, what: str, seq: int = 0) -> Error:
    """The ERROR answering the last message sent; an ACK of ``seq`` instead fails with that."""
    rec = await p.expect(what, lambda r: _is_error(r) or (seq > 0 and _acks(seq)(r)))
    if not isinstance(rec.msg, Error):
        raise CheckFailed(f"expected {what}, got {rec.describe()}")
    return rec.msg


@register("learner")
async def check_handshake(t: LearnerTarget) -> None:
    """HELLO -> WELCOME: same major version, credits >= 1, session id, limits, heartbeat params."""
    w = await t.peer("handshake").hello()
    problems = []
    if w.protocol_version[:1] != [PROTOCOL_VERSION.major]:
        problems.append(
            f"WELCOME.protocol_version {w.protocol_version}, this suite speaks {PROTOCOL_VERSION}"
        )
    if w.credits < 1:
        problems.append(f"WELCOME.credits is {w.credits}, a new session needs at least 1")
    if not w.session_id:
        problems.append("WELCOME.session_id is empty")
    lim = w.limits
    if (
        min(lim.max_message_bytes, lim.max_trajectories_per_batch, lim.max_tokens_per_trajectory)
        < 1
    ):
        problems.append(f"WELCOME.limits must all be >= 1: {lim}")
    if not (0 < w.heartbeat_interval_s < w.heartbeat_timeout_s):
        problems.append(
            f"WELCOME heartbeat needs 0 < interval < timeout, got interval "
            f"{w.heartbeat_interval_s} s, timeout {w.heartbeat_timeout_s} s"
        )
    if w.next_seq != 1:
        problems.append(f"WELCOME.next_seq is {w.next_seq} for a new epoch, expected 1")
    t.details.update(
        credits=w.credits,
        session_id=w.session_id,
        policy_version=w.policy_version,
        heartbeat_interval_s=w.heartbeat_interval_s,
        heartbeat_timeout_s=w.heartbeat_timeout_s,
        limits=dataclasses.asdict(lim),
    )
    if problems:
        raise CheckFailed("; ".join(problems))


AUTH_WAIT_S = 1.5  # authentication: how long a refused peer is watched for a WELCOME


@register("learner")
async def check_authentication(t: LearnerTarget) -> None:
    """Token auth is mutual (SPEC §13): a client key not the token's, a client pinning another
    learner key, no credentials, and the token in the clear (PLAIN) get no WELCOME."""
    if t.token is None:
        t.note("not checked: no --token-file (a learner with transport.auth none lets anyone in)")
        return
    keys = token_keys(t.token)
    other_public, other_secret = zmq.curve_keypair()
    token = t.token

    def curve(public: bytes, secret: bytes, server: bytes) -> Callable[[zmq.Socket], None]:
        def apply(sock: zmq.Socket) -> None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = (
                public,
                secret,
                server,
            )

        return apply

    def plain(sock: zmq.Socket) -> None:
        sock.plain_username, sock.plain_password = b"agentrl", token.encode()

    cases: dict[str, Callable[[zmq.Socket], None]] = {
        "a client key not derived from the token": curve(
            other_public, other_secret, keys.server_public
        ),
        "the token's client key pinning another learner key": curve(
            keys.client_public, keys.client_secret, other_public
        ),
        "no credentials": lambda sock: None,
        "the token as a PLAIN password": plain,
    }
    peers = {what: t.peer("auth", security=security) for what, security in cases.items()}
    for p in peers.values():
        await p.send(
            codec.encode(wire.hello(p.peer_id, p.epoch, model=t.model, tokenizer=t.tokenizer))
        )
    wait = min(t.timeout, AUTH_WAIT_S)
    # Absence can only be waited for: a refused handshake leaves nothing to see.
    await asyncio.sleep(wait)
    answered = [what for what, p in peers.items() if await p.sock.poll(0)]
    for p in peers.values():
        p.close()
    if answered:
        raise CheckFailed(f"the learner answered a peer with {', '.join(answered)}")
    await t.peer("auth-ok").hello()  # the token's own keys get in: the refusals were for the keys
    t.note(f"{len(cases)} wrong credentials got nothing within {wait:g} s; the token's keys got in")


@register("learner")
async def check_version_mismatch(t: LearnerTarget) -> None:
    """HELLO with major+1 -> ERROR VERSION_MISMATCH, fatal, naming both versions."""
    p = t.peer("version")
    theirs = [PROTOCOL_VERSION.major + 1, PROTOCOL_VERSION.minor]
    await p.send_msg(
        wire.hello(p.peer_id, p.epoch, model=t.model, tokenizer=t.tokenizer, version=theirs)
    )
    rec = await p.expect("ERROR VERSION_MISMATCH", lambda r: _is_error(r) or r.is_(Welcome))
    if isinstance(rec.msg, Welcome):
        raise CheckFailed(
            f"HELLO with protocol {theirs[0]}.{theirs[1]} was accepted (WELCOME, protocol "
            f"{'.'.join(map(str, rec.msg.protocol_version))}): expected ERROR VERSION_MISMATCH"
        )
    err = rec.msg
    assert isinstance(err, Error)
    problems = []
    if rec.error_code() is not ErrorCode.VERSION_MISMATCH:
        problems.append(f"expected ERROR VERSION_MISMATCH, got {rec.describe()}")
    if not err.fatal:
        problems.append("the ERROR is not marked fatal")
    if not (
        wire.mentions_version(err.message, theirs[0])
        and wire.mentions_version(err.message, PROTOCOL_VERSION.major)
    ):
        problems.append(
            f"the message does not name both versions ({theirs[0]}.x and "
            f"{PROTOCOL_VERSION.major}.x): {err.message!r}"
        )
    if problems:
        raise CheckFailed("; ".join(problems))


@register("learner")
async def check_minor_version_compat(t: LearnerTarget) -> None:
    """HELLO with minor+1 and unknown header keys -> WELCOME; a batch with unknown keys -> ACK."""
    p = t.peer("minor")
    newer = [PROTOCOL_VERSION.major, PROTOCOL_VERSION.minor + 1]
    base = codec.encode(
        wire.hello(p.peer_id, p.epoch, model=t.model, tokenizer=t.tokenizer, version=newer)
    )

    def future_hello(h: dict) -> None:
        h["x_future_field"] = {"nested": [1, 2, 3], "flag": True}
        h["model"]["x_future_identity_field"] = "ignored"

    await p.hello(frames=wire.with_header(base, future_hello))

    def future_batch(h: dict) -> None:
        h["x_future_field"] = [1, "two", 3.0]
        h["meta"]["x_future_column"] = [7] * len(h["meta"]["trajectory_id"])

    await p.await_credit()
    await p.send_batch(wire.with_header(t.batch(1), future_batch))
    await _ack_of(p, 1, "ACK for a batch whose header and meta carry unknown keys")


@register("learner")
async def check_number_frames(t: LearnerTarget) -> None:
    """A 1.5 learner: a batch with its numbers as frames (SPEC §4) -> ACK; one whose is_snapshot
    frame holds a 2 -> ERROR INVALID_FIELD naming it. Skipped for a learner older than 1.5."""
    p = t.peer("number-frames")
    w = await p.hello()
    if ProtocolVersion(*w.protocol_version) < NUMBER_FRAMES:
        t.note(f"skipped: the learner speaks {w.protocol_version}, number frames are 1.5")
        return
    await p.await_credit()
    batch = codec.encode(TrajectoryBatch(1, t.trajectories(2)), number_frames=True)
    await p.send_batch(batch)
    await _ack_of(p, 1, "ACK for a batch in the 1.5 form (numbers as frames)")
    bad = codec.encode(TrajectoryBatch(2, t.trajectories(2)), number_frames=True)
    flag = len(bad) - 4  # is_snapshot: reward, snapshot_index, is_snapshot, num_turns, lengths
    bad[flag] = bytes([0, 2])
    await p.await_credit()
    await p.send_batch(bad)
    err = await _error_for(p, "ERROR INVALID_FIELD for is_snapshot 2 in a number frame", 2)
    if (err.code, err.field) != (ErrorCode.INVALID_FIELD, "trajectories[1].is_snapshot"):
        raise CheckFailed(
            "is_snapshot 2 in a number frame: expected INVALID_FIELD "
            f"trajectories[1].is_snapshot, got {wire.describe_message(err)}"
        )


@register("learner")
async def check_hello_required(t: LearnerTarget) -> None:
    """A batch before HELLO -> ERROR HELLO_REQUIRED with the batch's seq as ref_seq."""
    p = t.peer("hello-required")
    await p.send(t.batch(7))
    err = await _error_for(p, "ERROR HELLO_REQUIRED for a batch sent before HELLO", 7)
    if err.code != ErrorCode.HELLO_REQUIRED or err.ref_seq != 7:
        raise CheckFailed(
            f"expected ERROR HELLO_REQUIRED with ref_seq=7, got {wire.describe_message(err)}"
        )


@register("learner")
async def check_batch_ack(t: LearnerTarget) -> None:
    """A valid batch -> ACK listing its seq (and not as a duplicate)."""
    p = t.peer("batch-ack")
    await p.hello()
    ack = await _send_and_ack(t, p, 1)
    if 1 in ack.duplicates:
        raise CheckFailed(
            f"the first batch of a new epoch was reported as a duplicate: {wire.describe_message(ack)}"
        )


@register("learner")
async def check_duplicate_batch(t: LearnerTarget) -> None:
    """The same seq sent twice -> the second ACK lists it in `duplicates`."""
    p = t.peer("duplicate")
    await p.hello()
    frames = t.batch(1)
    await p.send_batch(frames)
    await _ack_of(p, 1)
    await p.await_credit()
    await p.send_batch(frames)
    ack = await _ack_of(p, 1, "ACK for a resent batch")
    if 1 not in ack.duplicates:
        raise CheckFailed(
            f"resent batch 1 was ACKed but not listed as a duplicate: {wire.describe_message(ack)}"
        )


@register("learner")
async def check_reconnect_resend(t: LearnerTarget) -> None:
    """New socket, same peer_id and epoch -> WELCOME.next_seq past the acked seqs; old seq -> duplicate."""
    a = t.peer("reconnect")
    await a.hello()
    for seq in (1, 2):
        await _send_and_ack(t, a, seq)
    a.in_session = False  # a dropped connection says no BYE
    a.close()
    b = t.peer("reconnect", peer_id=a.peer_id, epoch=a.epoch)
    w = await b.hello()
    if w.next_seq != 3:
        raise CheckFailed(
            f"after batches 1 and 2 were ACKed, WELCOME.next_seq on reconnect is {w.next_seq}, "
            "expected 3"
        )
    await b.await_credit()
    await b.send_batch(t.batch(1))
    ack = await _ack_of(b, 1, "ACK for batch 1 resent after the reconnect")
    if 1 not in ack.duplicates:
        raise CheckFailed(
            f"batch 1 resent on the new socket was not reported as a duplicate: "
            f"{wire.describe_message(ack)}"
        )


@register("learner")
async def check_credit_limit(t: LearnerTarget) -> None:
    """credits+1 batches without waiting -> exactly those beyond the granted window get CREDIT_EXCEEDED.

    The window is replayed from the replies (``credit_window``). If the learner kept granting
    credits while the burst was in flight, nothing was beyond it; the check then uses up the
    learner's room with extra sessions until one is welcomed with 0 credits, and sends from that.
    """
    p = t.peer("credit")
    w = await p.hello()
    seqs = list(range(1, w.credits + 2))
    for s in seqs:
        await p.send_batch(t.batch(s))
    r = await _verdicts(p, w.credits, seqs)
    t.details.update(
        welcome_credits=w.credits,
        burst=len(seqs),
        rejected=r.rejected,
        credits_granted_during_burst=r.granted_later,
    )
    if r.rejected:
        t.note(f"batches {r.rejected} of {len(seqs)} were beyond the window and rejected")
        return
    # Everything was legitimately accepted: the learner refilled the window as fast as it was used.
    for i in range(MAX_EXTRA_PEERS):
        q = t.peer(f"credit-extra{i}")
        wq = await q.hello()
        if wq.credits == 0:
            await q.send_batch(t.batch(1))
            rq = await _verdicts(q, 0, [1])  # fails if accepted without a grant seen before it
            t.details.update(extra_sessions=i + 1)
            if rq.rejected:
                t.note(
                    f"window refilled during the burst; session {i + 2} got 0 credits and its batch "
                    "was rejected"
                )
            else:
                t.note(
                    f"not exercised: session {i + 2} got 0 credits, then a grant before its batch"
                )
            return
    t.note(
        f"not exercised: the learner refilled the window during the burst and gave credits to "
        f"{MAX_EXTRA_PEERS} extra sessions"
    )


async def _verdicts(p: Peer, initial: int, seqs: list[int]) -> credit_window.Replay:
    """Collect replies until every seq has a verdict, then a short quiet period; replay the window."""
    answered = set(seqs)

    def done(recs: list[Received]) -> bool:
        got = set()
        for rec in recs:
            if isinstance(rec.msg, Ack):
                got.update(rec.msg.seqs)
            elif isinstance(rec.msg, Error):
                got.add(rec.msg.ref_seq)
        return answered <= got

    recs = await p.collect(p.timeout, until=done)
    recs += await p.collect(QUIET_S)
    r = credit_window.replay(initial, seqs, recs)
    if r.problems:
        raise CheckFailed("; ".join(r.problems) + f" (received: {wire.describe(recs)})")
    return r


def _truncated(frames: Frames, index: int, nbytes: int) -> Frames:
    """Frames with frame ``index`` shortened by ``nbytes`` (one int32 token: lengths disagree)."""
    out = list(frames)
    out[index] = bytes(memoryview(frames[index]).cast("B"))[:-nbytes]
    return out


def _malformed_cases(t: LearnerTarget) -> list[tuple[str, Frames, ErrorCode, int]]:
    """(name, frames, expected code, seq the error must reference or 0) for each broken message."""
    hb = wire.type_byte(MsgType.HEARTBEAT)
    ok_header = wire.pack({"time": 1.0, "policy_version": 0})
    cases: list[tuple[str, Frames, ErrorCode, int]] = [
        ("unknown type byte", [b"\xee", ok_header], ErrorCode.UNKNOWN_TYPE, 0),
        ("one frame only", [hb], ErrorCode.MALFORMED, 0),
        ("garbage header", [hb, b"\xc1\xc1 not msgpack"], ErrorCode.MALFORMED, 0),
        ("header is a list", [hb, wire.pack([1.0, 0])], ErrorCode.MALFORMED, 0),
        (
            "msgpack ext type",
            [hb, wire.pack({"time": msgpack.ExtType(42, b"\x00"), "policy_version": 0})],
            ErrorCode.MALFORMED,
            0,
        ),
    ]

    def set_first(value: float) -> Callable[[np.ndarray], np.ndarray]:
        def edit(a: np.ndarray) -> np.ndarray:
            a[0] = value  # token 0 of the response is a model token (mask 1)
            return a

        return edit

    result = codec.encode(
        ValidateResult(
            "conformance-bad",
            0,
            sources=[SourceMetrics("conformance", 1, 1.0, 1.0, terminations={"answered": 1})],
        )
    )
    cases.append(
        (
            "VALIDATE_RESULT with count -1",
            wire.with_header(result, lambda h: h["sources"][0].update(count=-1)),
            ErrorCode.INVALID_FIELD,
            0,
        )
    )
    seq = 100
    batch_cases = [
        ("mask value 2", lambda f: wire.with_column(f, "response_mask", set_first(2))),
        ("positive logprob", lambda f: wire.with_column(f, "rollout_logprobs", set_first(0.5))),
        ("NaN logprob", lambda f: wire.with_column(f, "rollout_logprobs", set_first(math.nan))),
        ("length mismatch", lambda f: _truncated(f, wire.COLUMN_FRAME["response_ids"], 4)),
        (
            "missing trajectory_id",
            lambda f: wire.with_header(f, lambda h: h["meta"].pop("trajectory_id")),
        ),
    ]
    for name, corrupt in batch_cases:
        seq += 1
        cases.append((name, corrupt(t.batch(seq)), ErrorCode.INVALID_FIELD, seq))
    return cases


@register("learner")
async def check_malformed(t: LearnerTarget) -> None:
    """Broken frames and invalid fields -> typed ERRORs (INVALID_FIELD with a field path); the session survives."""
    p = t.peer("malformed")
    await p.hello()
    problems = []
    for name, frames, code, seq in _malformed_cases(t):
        await p.send(frames)
        try:
            err = await _error_for(p, f"ERROR {code.name} for {name}", seq)
        except CheckFailed as e:
            problems.append(f"{name}: {e.reason}")
            continue
        if err.code != code:
            problems.append(f"{name}: expected {code.name}, got {wire.describe_message(err)}")
        elif code is ErrorCode.INVALID_FIELD and not err.field:
            problems.append(f"{name}: INVALID_FIELD names no field path")
        elif seq and err.ref_seq != seq:
            problems.append(f"{name}: ERROR ref_seq is {err.ref_seq}, expected {seq}")
        if err.fatal:
            problems.append(f"{name}: the ERROR is marked fatal")
    try:
        await _send_and_ack(t, p, 1)
    except CheckFailed as e:
        problems.append(f"after the malformed messages, a valid batch: {e.reason}")
    if problems:
        raise CheckFailed("; ".join(problems))


@register("learner")
async def check_oversize(t: LearnerTarget) -> None:
    """Over WELCOME.limits.max_message_bytes -> TOO_LARGE; over max_trajectories_per_batch -> TOO_LARGE."""
    p = t.peer("oversize")
    lim = (await p.hello()).limits
    problems = []
    if lim.max_message_bytes > BIG_MESSAGE_SKIP_BYTES:
        t.note(
            f"byte-size variant skipped: max_message_bytes is {lim.max_message_bytes / 2**20:.0f} MiB "
            f"(> {BIG_MESSAGE_SKIP_BYTES >> 20} MiB)"
        )
    else:
        # One trajectory whose prompt alone makes the message 1 byte too big (zero pages: no copy).
        frames = t.batch(1)
        other = sum(memoryview(f).nbytes for i, f in enumerate(frames) if i != 2)
        # the header only grows
        n_prompt = max(1, math.ceil((lim.max_message_bytes + 1 - other) / 4))
        frames = wire.with_header(frames, lambda h: h["meta"].__setitem__("prompt_len", [n_prompt]))
        frames[2] = np.zeros(n_prompt, np.int32)
        size = codec.frame_bytes(frames)
        await p.send(frames)
        err = await _error_for(p, f"ERROR TOO_LARGE for a {size}-byte message", 1)
        if err.code != ErrorCode.TOO_LARGE:
            problems.append(
                f"message of {size} bytes (limit {lim.max_message_bytes}): expected TOO_LARGE, "
                f"got {wire.describe_message(err)}"
            )
        t.details["oversize_message_bytes"] = size
    n = lim.max_trajectories_per_batch + 1
    if n > MAX_COUNT_VARIANT:
        t.note(f"count variant skipped: max_trajectories_per_batch is {n - 1}")
    else:
        frames = wire.batch_frames(2, t.trajectories(n, prompt_len=1, response_len=1))
        if codec.frame_bytes(frames) > lim.max_message_bytes:
            t.note(
                "count variant skipped: a batch of that many trajectories exceeds max_message_bytes"
            )
        else:
            await p.send(frames)
            err = await _error_for(p, f"ERROR TOO_LARGE for a batch of {n} trajectories", 2)
            if err.code != ErrorCode.TOO_LARGE:
                problems.append(
                    f"batch of {n} trajectories (limit {n - 1}): expected TOO_LARGE, "
                    f"got {wire.describe_message(err)}"
                )
    if problems:
        raise CheckFailed("; ".join(problems))


@register("learner")
async def check_heartbeat(t: LearnerTarget) -> None:
    """While idle, the learner sends HEARTBEAT at least every ~2x WELCOME.heartbeat_interval_s.

    Waits for two heartbeats (so it takes up to ~4 intervals, whatever --timeout says) and sends
    its own heartbeats meanwhile so the learner keeps the session.
    """
    p = t.peer("heartbeat")
    w = await p.hello()
    interval = w.heartbeat_interval_s
    limit = 2 * interval + max(0.25, 0.1 * interval)
    last, gaps = p.welcome_at, []
    for i in range(2):
        rec = await p.expect(
            f"HEARTBEAT #{i + 1} (interval {interval} s)",
            lambda r: r.is_(Heartbeat),
            timeout=limit,
            deadline=last + limit,
            keepalive_s=interval,
            fail_on_error="while idle",
        )
        gaps.append(round(rec.at - last, 3))
        last = rec.at
    t.details.update(heartbeat_interval_s=interval, gaps_s=gaps)


@register("learner")
async def check_weights(t: LearnerTarget) -> None:
    """HELLO with policy_version -1 -> WEIGHTS_ANNOUNCE + all chunks; checksums verify; WEIGHTS_APPLIED ok."""
    p = t.peer("weights")
    await p.hello(policy_version=-1)
    rec = await p.expect(
        "WEIGHTS_ANNOUNCE after HELLO with policy_version -1",
        lambda r: r.is_(WeightsAnnounce),
        fail_on_error="weights",
    )
    ann = rec.msg
    assert isinstance(ann, WeightsAnnounce)
    asm, done, chunks = WeightAssembler(), None, 0
    started = time.monotonic()
    try:
        done = asm.announce(ann)
        while done is None:
            rec = await p.expect(
                f"WEIGHTS_CHUNK {chunks + 1}/{ann.num_chunks} of version {ann.version}",
                lambda r: isinstance(r.msg, WeightsChunk) and r.msg.transfer_id == ann.transfer_id,
                fail_on_error="weights",
            )
            assert isinstance(rec.msg, WeightsChunk)
            chunks += 1
            done = asm.chunk(rec.msg)
    except ProtocolError as e:
        raise CheckFailed(f"weights of version {ann.version} do not verify: {e}") from None
    t.details.update(
        version=ann.version,
        tensors=len(ann.tensors),
        chunks=ann.num_chunks,
        bytes=sum(s.nbytes for s in ann.tensors),
        transfer_s=round(time.monotonic() - started, 3),
    )
    await p.send_msg(WeightsApplied(ann.version, ann.transfer_id, True, "", 0.0))
    # Barrier: the learner answers in order, so an ACK for a later batch means no ERROR is coming.
    await p.await_credit()
    await p.send_batch(t.batch(1))
    await _ack_of(p, 1, "ACK for a batch sent after WEIGHTS_APPLIED")


@register("learner")
async def check_validation_request(t: LearnerTarget) -> None:
    """A VALIDATE_REQUEST goes only to a peer offering "validation"; answered, the session goes on.

    The learner validates on its own schedule: when no request comes within --timeout the check
    passes with a note that it was not exercised. A request that comes is answered with a
    well-formed VALIDATE_RESULT, after which a batch must still be ACKed (no ERROR for the result);
    a peer in session without the capability must receive no VALIDATE_REQUEST meanwhile.
    """
    plain = t.peer("validation-plain")
    await plain.hello()
    p = t.peer("validation")
    w = await p.hello(capabilities=(VALIDATION_CAPABILITY,))
    started = time.monotonic()
    deadline, rec = started + p.timeout, None
    while rec is None and time.monotonic() < deadline:  # in slices: both sessions are kept alive
        try:
            rec = await p.expect(
                "VALIDATE_REQUEST",
                lambda r: r.is_(ValidateRequest),
                deadline=min(deadline, time.monotonic() + w.heartbeat_interval_s),
                fail_on_error="while waiting for a VALIDATE_REQUEST",
            )
        except CheckFailed as e:
            if not e.reason.startswith("no VALIDATE_REQUEST within"):
                raise
            for q in (p, plain):
                await q.send_msg(Heartbeat(time.time()))
    if rec is None:
        t.note(
            f"not exercised: no VALIDATE_REQUEST within {p.timeout:.1f} s (the learner validates on its "
            "own schedule)"
        )
    else:
        req = rec.msg
        assert isinstance(req, ValidateRequest)
        t.details.update(
            request_id=req.request_id,
            policy_version=req.policy_version,
            timeout_s=req.timeout_s,
            after_s=round(time.monotonic() - started, 3),
        )

        await p.send_msg(synthetic_validation(req, req.policy_version))
        try:
            await _send_and_ack(t, p, 1)
        except CheckFailed as e:
            raise CheckFailed(
                f"after a VALIDATE_RESULT answering {req.request_id!r}: {e.reason}"
            ) from None
        t.note(f"request {req.request_id!r} for policy version {req.policy_version} answered")
    await _send_and_ack(t, plain, 1)  # barrier: everything sent to it before this ACK has arrived
    stray = [r for r in plain.log if r.type == MsgType.VALIDATE_REQUEST]
    if stray:
        raise CheckFailed(
            f"a peer whose HELLO did not offer {VALIDATION_CAPABILITY!r} was sent "
            f"{stray[0].describe()}"
        )


@register("learner")
async def check_validation_unsolicited(t: LearnerTarget) -> None:
    """A VALIDATE_RESULT for a request never sent -> ERROR UNEXPECTED (not fatal); the session goes on."""
    p = t.peer("validation-unsolicited")
    await p.hello(capabilities=(VALIDATION_CAPABILITY,))
    rid = f"conformance-unasked-{uuid.uuid4().hex[:8]}"
    await p.send_msg(ValidateResult(rid, 0))
    err = await _error_for(p, "ERROR UNEXPECTED for a VALIDATE_RESULT nobody asked for")
    problems = []
    if err.code != ErrorCode.UNEXPECTED:
        problems.append(f"expected ERROR UNEXPECTED, got {wire.describe_message(err)}")
    if err.fatal:
        problems.append("the ERROR is marked fatal")
    try:
        await _send_and_ack(t, p, 1)
    except CheckFailed as e:
        problems.append(f"after the unsolicited result, a valid batch: {e.reason}")
    if problems:
        raise CheckFailed("; ".join(problems))


@register("learner")
async def check_bye(t: LearnerTarget) -> None:
    """After BYE, a batch on the same socket -> ERROR HELLO_REQUIRED."""
    p = t.peer("bye")
    await p.hello()
    await p.send_msg(Bye("conformance: bye check"))
    p.in_session = False
    await p.send(t.batch(1))
    err = await _error_for(p, "ERROR HELLO_REQUIRED for a batch sent after BYE", 1)
    if err.code != ErrorCode.HELLO_REQUIRED:
        raise CheckFailed(
            f"expected ERROR HELLO_REQUIRED for a batch after BYE, got {wire.describe_message(err)}"
        )
