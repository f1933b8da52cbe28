"""Checks of a rollout server (``--role rollout-server``): the suite plays the learner.

One rollout server connects to the suite's ROUTER and the checks run in registration order on that
connection, each starting from the state the previous one left (an open session, some batches
unacknowledged); a check that finds no session fails with "not run". The last check ends the
server with a fatal VERSION_MISMATCH. Timing: the WELCOME asks for heartbeats every 0.2 s and a
3.0 s timeout, so waiting out a reconnect costs seconds, not the production ten. (Not shorter: a
server busy admitting its first episodes on a loaded 2-core machine can miss a beat, time the
session out and reconnect, and every later check would then talk to a dead connection.)
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path

import msgpack

from common.safetensors_buffers import load_dir
from protocol import codec
from protocol.errors import ErrorCode
from protocol.messages import (
    VALIDATION_CAPABILITY,
    Bye,
    Error,
    Heartbeat,
    Hello,
    MsgType,
    TrajectoryBatch,
    ValidateRequest,
    ValidateResult,
    WeightsAnnounce,
    WeightsApplied,
    WeightsChunk,
)
from protocol.reference import reference_weights
from protocol.version import PROTOCOL_VERSION
from protocol.weights import NamedBuffer, plan_transfer
from tools.conformance import wire
from tools.conformance.fake_learner import FakeLearner
from tools.conformance.registry import CheckFailed, register
from tools.conformance.wire import Received

QUIET_S = 1.0  # how long "nothing more may arrive" is watched


def _is(cls: type):
    return lambda r: isinstance(r.msg, cls)


@register("rollout-server")
async def check_handshake(fl: FakeLearner) -> None:
    """A valid HELLO arrives (within --wait); it is answered with WELCOME credits=1, heartbeat 0.2/3.0 s."""
    rec = await fl.next(
        "HELLO from a rollout server", lambda r: r.type == MsgType.HELLO, timeout=fl.wait
    )
    if not isinstance(rec.msg, Hello):
        raise CheckFailed(f"the HELLO does not decode: {rec.describe()}")
    h = rec.msg
    problems = []
    if h.protocol_version[0] != PROTOCOL_VERSION.major:
        problems.append(
            f"HELLO.protocol_version {h.protocol_version}, this suite speaks {PROTOCOL_VERSION}"
        )
    if h.role != "rollout-server":
        problems.append(f"HELLO.role is {h.role!r}")
    if not h.epoch:
        problems.append("HELLO.epoch is empty")
    fl.first_hello = h
    fl.details.update(
        peer_id=h.peer_id,
        epoch=h.epoch,
        policy_version=h.policy_version,
        model=h.model.name,
        tokenizer=h.tokenizer.name,
        capabilities=h.capabilities,
    )
    if problems:
        raise CheckFailed("; ".join(problems))
    await fl.welcome(rec, credits=1, next_seq=1)
    # it asks for the current weights, as a learner that has some would send
    if h.policy_version < 0:
        await _send_transfer(fl, fl.policy_version)
        fl.note(f"HELLO asked for weights (policy_version -1): sent version {fl.policy_version}")


async def _generated_batch(fl: FakeLearner, what: str) -> Received:
    """The session's next batch, which must first be generated: waited for like a validation run.

    A real engine on a loaded machine may take longer than --timeout to finish a group, while its
    heartbeats show that the session lives. So the wait runs up to --timeout + --wait, and ends
    at once on a HELLO or an ERROR (the session was lost) or after --timeout s of silence.
    """
    return await fl.next(
        what,
        fl.from_session(TrajectoryBatch),
        timeout=fl.timeout + fl.wait,
        fail_if=lambda r: isinstance(r.msg, Error | Hello),
        silence=fl.timeout,
    )


@register("rollout-server")
async def check_credit_respected(fl: FakeLearner) -> None:
    """With 1 credit exactly 1 batch arrives (none more for ~1 s); an ACK granting 2 -> at most 2 more."""
    s = fl.require_session()
    first = await _generated_batch(fl, "TRAJECTORY_BATCH (WELCOME granted 1 credit)")
    extra = await fl.collect(QUIET_S, fl.from_session(TrajectoryBatch))
    if extra:
        raise CheckFailed(
            f"{len(extra)} more batch(es), {wire.describe(extra)}, arrived while the only credit "
            f"was in use (batch {first.as_(TrajectoryBatch).seq} not yet acknowledged)"
        )
    await fl.ack([first.as_(TrajectoryBatch).seq], 2)
    more = [await _generated_batch(fl, "TRAJECTORY_BATCH after an ACK granting 2 credits")]
    while True:  # until QUIET_S passes without a batch
        got = await fl.collect(QUIET_S, fl.from_session(TrajectoryBatch))
        more += got
        if not got or len(more) > 2:
            break
    if len(more) > 2:
        raise CheckFailed(
            f"{len(more)} batches ({wire.describe(more)}) arrived after an ACK granting 2 credits"
        )
    fl.details.update(batches_after_grant=len(more), unacked=s.unacked)


@register("rollout-server")
async def check_batch_valid(fl: FakeLearner) -> None:
    """Every batch so far decodes and validates (limits from WELCOME, vocab from HELLO, logprob 0 where mask 0)."""
    s = fl.require_session()
    if fl.invalid_batches:
        raise CheckFailed(
            f"{len(fl.invalid_batches)} invalid batch(es); first: {fl.invalid_batches[0]}"
        )
    if not s.batches:
        raise CheckFailed("no batch received yet")
    trajs = [t for b in s.batches.values() for t in b.trajectories]
    if s.received != len(s.batches):
        raise CheckFailed(
            f"{s.received} batches received but only {len(s.batches)} distinct seqs "
            "(a seq was reused without a reconnect)"
        )
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    fl.note(f"{len(s.batches)} batches, {len(trajs)} trajectories, {tokens} tokens")
    fl.details.update(batches=len(s.batches), trajectories=len(trajs), tokens=tokens)


@register("rollout-server")
async def check_heartbeat(fl: FakeLearner) -> None:
    """Idle (everything acknowledged, no credits), the server sends HEARTBEAT within ~2x the interval."""
    s = fl.require_session()
    await fl.ack(s.unacked, 0)
    limit = 2 * fl.heartbeat_interval_s + 0.25
    last, gaps = time.monotonic(), []
    for i in range(3):
        since = last
        rec = await fl.next(
            f"HEARTBEAT #{i + 1} (interval {fl.heartbeat_interval_s} s, allowed gap {limit:.2f} s)",
            lambda r, since=since: fl.from_session(Heartbeat)(r) and r.at >= since,
            timeout=max(0.0, last + limit - time.monotonic()),
        )
        gaps.append(round(rec.at - last, 3))
        last = rec.at
    fl.details.update(gaps_s=gaps)


def _malformed() -> list[tuple[str, wire.Frames]]:
    hb = wire.type_byte(MsgType.HEARTBEAT)
    batch = wire.batch_frames(1, [wire.tiny_trajectory("conformance-unexpected")])
    return [
        ("unknown type byte", [b"\xee", wire.pack({})]),
        ("one frame only", [hb]),
        ("garbage header", [hb, b"\xc1\xc1 not msgpack"]),
        ("header is a list", [hb, wire.pack([1.0, 0])]),
        ("msgpack ext type", [hb, wire.pack({"time": msgpack.ExtType(42, b"\x00")})]),
        (
            "ACK with negative credits",
            [wire.type_byte(MsgType.ACK), wire.pack({"seqs": [], "credits": -5})],
        ),
        (
            "ACK with a string seq",
            [wire.type_byte(MsgType.ACK), wire.pack({"seqs": ["1"], "credits": 0})],
        ),
        ("TRAJECTORY_BATCH sent to a rollout server", batch),
        ("undecodable ERROR (must not be answered)", [wire.type_byte(MsgType.ERROR), b"\xc1"]),
    ]


@register("rollout-server")
async def check_malformed_tolerated(fl: FakeLearner) -> None:
    """Garbage and invalid messages are answered with ERROR (or ignored); an ACK with credit still yields a batch."""
    s = fl.require_session()
    for _name, frames in _malformed():
        await fl.send(s.identity, frames)
    await fl.ack([], 1)
    sent = time.monotonic()

    def gave_up(r: Received) -> bool:  # reconnected, said goodbye, or declared the session dead
        return isinstance(r.msg, Hello | Bye) or r.error_code() in (
            ErrorCode.VERSION_MISMATCH,
            ErrorCode.INCOMPATIBLE_MODEL,
        )

    seen: list[Received] = []

    def until_batch(r: Received) -> bool:
        seen.append(r)
        return fl.from_session(TrajectoryBatch)(r) and r.at >= sent

    await fl.next(
        "TRAJECTORY_BATCH after the malformed messages and an ACK granting 1 credit",
        until_batch,
        fail_if=gave_up,
    )
    errors = [r for r in seen if isinstance(r.msg, Error)]
    bounced = [r for r in errors if r.as_(Error).ref_type == MsgType.ERROR]
    if bounced:
        raise CheckFailed(
            f"an undecodable ERROR was answered with {bounced[0].describe()}: two peers doing "
            "that bounce errors forever"
        )
    fl.note(f"answered {len(errors)} of {len(_malformed())} with ERROR")
    fl.details.update(errors=[r.describe() for r in errors])


@register("rollout-server")
async def check_resend_after_reconnect(fl: FakeLearner) -> None:
    """Learner silent -> the server times out, sends HELLO on a new connection, resends unacked batches (same seqs)."""
    s = fl.require_session()
    if not s.unacked:
        await fl.ack([], 1)
        await fl.next("TRAJECTORY_BATCH to leave unacknowledged", fl.from_session(TrajectoryBatch))
    unacked = s.unacked
    originals = {seq: [t.trajectory_id for t in s.batches[seq].trajectories] for seq in unacked}
    fl.pump = False  # silence: no heartbeats, no answers
    wait = fl.timeout + 3 * fl.heartbeat_timeout_s
    rec = await fl.next(
        f"HELLO after {fl.heartbeat_timeout_s} s of learner silence", _is(Hello), timeout=wait
    )
    s.closed = True
    h = rec.msg
    assert isinstance(h, Hello)
    if h.peer_id != s.hello.peer_id or h.epoch != s.hello.epoch:
        raise CheckFailed(
            f"the new HELLO changed peer_id/epoch ({s.hello.peer_id}/{s.hello.epoch} -> "
            f"{h.peer_id}/{h.epoch}): the learner could not deduplicate the resends"
        )
    if rec.identity == s.identity:
        fl.note("the new HELLO came on the same connection, not a new one")
    new = await fl.welcome(rec, credits=len(unacked), next_seq=min(unacked))
    resent: list[Received] = []
    while {r.as_(TrajectoryBatch).seq for r in resent} != set(unacked):
        if len(resent) >= len(unacked):  # all credits used: a server sending on would loop us
            got = [r.as_(TrajectoryBatch).seq for r in resent]
            raise CheckFailed(
                f"after the reconnect batches {got} arrived for the unacknowledged {unacked}: "
                f"{sorted(set(unacked) - set(got))} not resent"
            )
        resent.append(
            await fl.next(
                f"resend of unacknowledged batch(es) {unacked} (WELCOME.next_seq={min(unacked)}, "
                f"credits={len(unacked)})",
                fl.from_session(TrajectoryBatch),
            )
        )
        seq = resent[-1].as_(TrajectoryBatch).seq
        if seq not in originals:
            raise CheckFailed(
                f"after the reconnect batch {seq} arrived, not one of the unacknowledged {unacked}"
            )
        if [t.trajectory_id for t in resent[-1].as_(TrajectoryBatch).trajectories] != originals[
            seq
        ]:
            raise CheckFailed(f"batch {seq} was resent with other trajectories than the first time")
    await fl.ack(sorted(unacked), 0)
    fl.details.update(
        resent=unacked, new_connection=rec.identity != s.identity, session=new.identity.hex()
    )


def _load_weights(directory: str | None) -> list[NamedBuffer]:
    if directory is None:
        return reference_weights()

    return load_dir(Path(directory))


async def _send_transfer(
    fl: FakeLearner, version: int, *, corrupt: bool = False
) -> tuple[WeightsAnnounce, list[WeightsChunk]]:
    """Send policy ``version`` to the current session; ``corrupt`` flips the first data byte."""
    if fl.weights is None:
        fl.weights = _load_weights(fl.weights_from)
    total = sum(t.data.nbytes for t in fl.weights)
    chunk_bytes = 32 << 10 if total < 4 << 20 else 16 << 20  # several chunks either way
    ann, chunks = plan_transfer(version, fl.weights, chunk_bytes=chunk_bytes)
    if corrupt:
        first = bytearray(memoryview(chunks[0].frames[0]).cast("B"))
        first[0] ^= 0xFF
        chunks[0] = dataclasses.replace(chunks[0], frames=(bytes(first), *chunks[0].frames[1:]))
    identity = fl.require_session().identity
    for m in (ann, *chunks):
        await fl.send(identity, codec.encode(m))
    return ann, chunks


@register("rollout-server")
async def check_weights(fl: FakeLearner) -> None:
    """A transfer -> WEIGHTS_APPLIED ok=True for its version; a corrupted one -> ok=False or CHECKSUM_MISMATCH."""
    fl.require_session()
    version = fl.policy_version + 1
    started = time.monotonic()
    ann, chunks = await _send_transfer(fl, version)
    total = sum(t.nbytes for t in ann.tensors)
    rec = await fl.next(
        f"WEIGHTS_APPLIED for version {version} ({len(ann.tensors)} tensors, {total} bytes)",
        lambda r: isinstance(r.msg, WeightsApplied) and r.msg.transfer_id == ann.transfer_id,
        fail_if=lambda r: isinstance(r.msg, Error),
    )
    applied = rec.msg
    assert isinstance(applied, WeightsApplied)
    if not applied.ok or applied.version != version:
        raise CheckFailed(
            f"valid weights of version {version}: got WEIGHTS_APPLIED(version={applied.version}, "
            f"ok={applied.ok}, error={applied.error!r})"
        )
    fl.policy_version = version
    fl.details.update(
        version=version,
        tensors=len(ann.tensors),
        bytes=total,
        chunks=len(chunks),
        applied_after_s=round(time.monotonic() - started, 3),
    )
    bad_version = version + 1
    ann2, _ = await _send_transfer(fl, bad_version, corrupt=True)

    def verdict(r: Received) -> bool:
        if isinstance(r.msg, WeightsApplied):
            return r.msg.transfer_id == ann2.transfer_id
        return isinstance(r.msg, Error) and r.msg.code == ErrorCode.CHECKSUM_MISMATCH

    rec = await fl.next(
        f"WEIGHTS_APPLIED ok=False or ERROR CHECKSUM_MISMATCH for corrupted version {bad_version}",
        verdict,
        fail_if=_is(Error),
    )
    if isinstance(rec.msg, WeightsApplied) and rec.msg.ok:
        raise CheckFailed(
            f"a transfer with a corrupted byte (version {bad_version}) was applied (ok=True)"
        )


@register("rollout-server")
async def check_validation(fl: FakeLearner) -> None:
    """VALIDATE_REQUEST (if HELLO offers "validation") -> exactly one well-formed VALIDATE_RESULT of its id.

    The server runs its validation set, which may take a while: the result is waited for up to
    --timeout + --wait seconds, as long as the session lives (a HELLO or --timeout s without a
    message from it fail at once). An ok result must be for the requested policy version or
    newer, and every source's termination counts must add up to its episode count.
    """
    s = fl.require_session()
    if VALIDATION_CAPABILITY not in s.hello.capabilities:
        fl.note(f"not exercised: HELLO does not offer {VALIDATION_CAPABILITY!r}")
        return
    req = ValidateRequest(
        f"conformance-{uuid.uuid4().hex[:8]}", fl.policy_version, fl.timeout + fl.wait
    )
    started = time.monotonic()
    await fl.send_msg(s.identity, req)
    rec = await fl.next(
        f"VALIDATE_RESULT for request {req.request_id} (policy version {req.policy_version})",
        lambda r: r.type == MsgType.VALIDATE_RESULT and r.identity == s.identity,
        timeout=fl.timeout + fl.wait,
        # A server that timed the session out (e.g. starved of CPU for longer than the
        # heartbeat timeout) reconnects with HELLO and never sees the request, which went to the
        # old connection; nothing else would end this wait before --timeout + --wait.
        fail_if=lambda r: isinstance(r.msg, Error | Hello),
        silence=fl.timeout,
    )
    res = rec.msg
    if not isinstance(res, ValidateResult):
        raise CheckFailed(f"the VALIDATE_RESULT does not decode: {rec.describe()}")
    problems = []
    if res.request_id != req.request_id:
        problems.append(
            f"VALIDATE_RESULT.request_id is {res.request_id!r}, the request was {req.request_id!r}"
        )
    if res.ok and res.policy_version < req.policy_version:
        problems.append(
            f"ok result for policy version {res.policy_version}, version {req.policy_version} was "
            "requested (and is applied)"
        )
    for src in res.sources if res.ok else []:
        if sum(src.terminations.values()) != src.count:
            problems.append(
                f"source {src.data_source!r}: termination counts {src.terminations} do not add up to "
                f"count {src.count}"
            )
    extra = await fl.collect(
        QUIET_S, lambda r: r.type == MsgType.VALIDATE_RESULT and r.identity == s.identity
    )
    if extra:
        problems.append(
            f"{len(extra)} more VALIDATE_RESULT(s) after the first: {wire.describe(extra)}"
        )
    fl.details.update(
        request_id=req.request_id,
        ok=res.ok,
        error=res.error,
        count=res.count,
        sources=[src.data_source for src in res.sources],
        shard=[res.shard_index, res.shard_count],
        answered_after_s=round(time.monotonic() - started, 3),
    )
    if problems:
        raise CheckFailed("; ".join(problems))
    what = (
        f"{res.count} episodes over {len(res.sources)} source(s)"
        if res.ok
        else f"failed: {res.error}"
    )
    fl.note(f"answered in {time.monotonic() - started:.1f} s: {what}")


@register("rollout-server")
async def check_version_mismatch(fl: FakeLearner) -> None:
    """Forced re-HELLO answered with fatal ERROR VERSION_MISMATCH -> no TRAJECTORY_BATCH for ~1 s."""
    s = fl.require_session()
    nxt = await fl.next(
        "any message (to answer with HELLO_REQUIRED)", lambda r: r.identity == s.identity
    )
    s.closed, fl.pump = True, False
    await fl.error(
        s.identity,
        ErrorCode.HELLO_REQUIRED,
        "conformance: session closed, send HELLO again",
        ref=nxt,
    )
    rec = await fl.next(
        "HELLO after ERROR HELLO_REQUIRED",
        _is(Hello),
        timeout=fl.timeout + 2 * fl.heartbeat_timeout_s,
    )
    h = rec.msg
    assert isinstance(h, Hello)
    ours = f"{PROTOCOL_VERSION.major + 1}.0"
    await fl.error(
        rec.identity,
        ErrorCode.VERSION_MISMATCH,
        f"this learner speaks protocol {ours}, the rollout server {'.'.join(map(str, h.protocol_version))}; "
        "major versions must match",
        ref=rec,
    )
    sent = time.monotonic()
    after = await fl.collect(QUIET_S, lambda r: r.at >= sent)
    batches = [r for r in after if r.type == MsgType.TRAJECTORY_BATCH]
    if batches:
        raise CheckFailed(
            f"{len(batches)} TRAJECTORY_BATCH arrived after a fatal VERSION_MISMATCH "
            f"(received: {wire.describe(after)})"
        )
    hellos = [r for r in after if isinstance(r.msg, Hello)]
    if hellos:
        fl.note(f"sent {len(hellos)} more HELLO(s) after the fatal error")
