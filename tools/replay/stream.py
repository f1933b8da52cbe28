"""``bin/replay stream``: send a recording to a learner again, as its rollout server did.

Design: the real protocol client (``RolloutConnection`` + ``RolloutClient`` over ZeroMQ) with the
identities of the run's model (``common.identity.wire_identities``, so the learner's tokenizer
check is the one a rollout server passes), a fresh epoch, and the recorded batches submitted in
file order; credits, resends across reconnects and deduplication are the protocol's. Every file is
read and validated before connecting, so a damaged recording fails before the learner sees any of
it. At most ``window`` batches are held unacknowledged in memory at a time. The trajectories go
unchanged (ids included), so the learner trains on exactly the recorded ones; a learner that has
already seen a trajectory id drops it silently (its intake deduplicates), so stream to a fresh
learner to train on exactly the recording.

Weights: a learner publishes every new version to every connected peer. The connection machine
assembles and verifies each transfer (it answers a failed one with WEIGHTS_APPLIED ok=false, as
the spec requires); the complete weights are dropped, and no WEIGHTS_APPLIED ok=true is sent:
that message means "generation now uses these weights" (protocol/SPEC.md section 8), which a
replay never does. The HELLO announces the newest version found in the recording, so a learner at
that version or below sends nothing at connect time. The learner never waits for WEIGHTS_APPLIED.

Outcome: exit status 0 once every batch is acknowledged; 1 when the learner refuses a batch or the
connection for good, says BYE with batches unacknowledged, or nothing is acknowledged for
``timeout_s`` seconds (the reason is printed).
"""

from __future__ import annotations

import functools
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

from common.identity import wire_identities
from common.peer_auth import wait_for_token
from protocol.batch import Trajectories
from protocol.driver import RolloutClient
from protocol.errors import ErrorCode
from protocol.events import (
    BatchAcked,
    BatchRejected,
    Connected,
    PeerClosed,
    WeightsFailed,
    WeightsReceived,
)
from protocol.sender import RolloutConnection, SenderState
from protocol.zmq_auth import CurveClientKeys
from protocol.zmq_transport import client_factory
from rollout_service.recording import BatchFileError, read_batch_file
from tools.replay import locate


@dataclass
class StreamResult:
    batches: int = 0
    trajectories: int = 0
    acked: int = 0
    acked_trajectories: int = 0
    duplicates: int = 0
    weight_versions: list[int] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.acked == self.batches


def prescan(files: list[Path], verify: bool = True) -> tuple[int, int]:
    """(trajectories, newest sampled version) of all files; ReplayError at the first bad one."""
    n, newest = 0, 0

    for f in files:
        try:
            _, msg = read_batch_file(f, verify=verify)
        except BatchFileError as e:
            raise locate.ReplayError(str(e)) from None
        trajs = msg.trajectories
        n += len(trajs)
        if isinstance(trajs, Trajectories) and len(versions := trajs.columns["versions"]):
            newest = max(newest, int(versions.max()))
    return n, newest


async def stream(
    files: list[Path],
    address: str,
    *,
    peer_id: str,
    model_dir: Path,
    curve: Any = None,
    token: str | Callable[[], Awaitable[str]] | None = None,
    heartbeat_interval_s: float = 1.0,
    heartbeat_timeout_s: float = 10.0,
    timeout_s: float = 120.0,
    window: int = 8,
    progress: Any = None,
    verify: bool = True,
) -> StreamResult:
    """Send ``files`` (batch files, in order) to the learner at ``address`` and wait for every ACK."""
    import anyio

    res = StreamResult(batches=len(files))
    res.trajectories, newest = await anyio.to_thread.run_sync(prescan, files, verify)
    model, tokenizer = wire_identities(model_dir)
    conn = RolloutConnection(
        peer_id=peer_id,
        epoch=uuid.uuid4().hex,
        model=model,
        tokenizer=tokenizer,
        heartbeat_interval_s=heartbeat_interval_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )
    conn.policy_version = newest
    client = RolloutClient(conn, client_factory(address, curve=curve, token=token))
    pending: dict[int, tuple[Path, int]] = {}  # wire seq -> (file, trajectories)
    submitted = anyio.Event()
    changed = anyio.Event()
    last_progress = time.monotonic()
    start = last_progress

    def fail(reason: str) -> None:
        if res.error is None:
            res.error = reason

    async def produce() -> None:
        for f in files:
            while len(pending) >= window:
                await changed.wait()
            _, msg = await anyio.to_thread.run_sync(
                functools.partial(read_batch_file, f, verify=verify)
            )
            seq = await client.submit(msg.trajectories)
            pending[seq] = (f, len(msg.trajectories))
        submitted.set()

    async def watchdog(scope: anyio.CancelScope) -> None:
        while True:
            await anyio.sleep(0.25)
            if time.monotonic() - last_progress > timeout_s:
                state = (
                    "no session with the learner"
                    if conn.state is not SenderState.READY
                    else "session open"
                )
                fail(
                    f"timed out: nothing acknowledged for {timeout_s:g} s ({res.acked} of {res.batches} batches "
                    f"acknowledged; {state}); is a learner listening at {address}?"
                )
                await client.close("replay: timed out")
                scope.cancel()
                return

    async with anyio.create_task_group() as tg:
        await tg.start(client.run)
        tg.start_soon(produce)
        tg.start_soon(watchdog, tg.cancel_scope)
        async for ev in client.events:
            if isinstance(ev, Connected):
                last_progress = time.monotonic()
            elif isinstance(ev, BatchAcked):
                for s in ev.seqs:
                    if (done := pending.pop(s, None)) is not None:
                        res.acked += 1
                        res.acked_trajectories += done[1]
                        if progress is not None:
                            progress(res, done[0])
                res.duplicates += len(ev.duplicates)
                last_progress = time.monotonic()
                changed.set()
                changed = anyio.Event()
                if submitted.is_set() and not pending:
                    await client.close("replay done")
            elif isinstance(ev, BatchRejected):
                path = pending.get(ev.seq, ("?", 0))[0]
                fail(
                    f"the learner refused {path} ({_code(ErrorCode, ev.error.code)}: {ev.error.message})"
                )
                await client.close("replay: a batch was refused")
            elif isinstance(ev, WeightsReceived):
                res.weight_versions.append(ev.weights.version)  # dropped: see the module docstring
            elif isinstance(ev, WeightsFailed):
                res.weight_versions.append(-1)
            elif isinstance(ev, PeerClosed) and (pending or not submitted.is_set()):
                left = res.batches - res.acked
                fail(
                    f"the learner closed the connection ({ev.reason or 'no reason given'}) with {left} "
                    "batches not acknowledged"
                )
                await client.close("replay: learner left")
        tg.cancel_scope.cancel()
    if conn.state is SenderState.FAILED and conn.fatal_error is not None:
        err = conn.fatal_error
        fail(f"the learner refused this connection ({_code(ErrorCode, err.code)}: {err.message})")
    if res.error is None and res.acked < res.batches:
        fail(f"the connection ended with {res.batches - res.acked} batches not acknowledged")
    res.seconds = time.monotonic() - start
    return res


def _code(codes: Any, code: int) -> str:
    return codes(code).name if code in codes._value2member_map_ else f"error {code}"


def run(
    path: str,
    *,
    to: str,
    server_id: str | None = None,
    model: str | None = None,
    config: str | None = None,
    timeout_s: float = 120.0,
    window: int = 8,
    as_json: bool = False,
    out: TextIO | None = None,
    token_file: str | None = None,
    verify: bool = True,
) -> int:
    """Stream the recording(s) ``path`` names to the learner at ``to``; exit status.
    ``token_file``: the learner's token (``transport.auth: token``), presented at the handshake;
    read at each connection, once the learner has made it."""
    import anyio

    out = out or cast(TextIO, sys.stdout)  # typeshed: stdout may be None (pythonw)
    recordings = locate.find(path, verify=verify)
    token: Callable[[], Awaitable[str]] | None = None
    if token_file:

        def warn(message: str, **fields: Any) -> None:
            print(f"replay: {message}: {fields['path']}", file=sys.stderr)

        async def read_token() -> str:
            return await wait_for_token(Path(token_file), warn=warn)

        token = read_token
    if len(recordings) > 1 and server_id is not None:
        raise locate.ReplayError(
            "--server-id names one peer: give one recording directory, not a run with "
            f"{len(recordings)} servers' recordings"
        )
    results = []
    for rec in recordings:
        mdir = locate.model_dir(rec, model=model, config=config)
        cfg = locate.config_file(rec, config)
        curve, hb = _transport(cfg)
        peer = server_id or f"replay-{rec.server_id}"
        progress, finish = _progress(rec, out, quiet=as_json)
        try:
            res = anyio.run(
                functools.partial(
                    stream,
                    rec.files,
                    to,
                    peer_id=peer,
                    verify=verify,
                    model_dir=mdir,
                    curve=curve,
                    token=token,
                    heartbeat_interval_s=hb[0],
                    heartbeat_timeout_s=hb[1],
                    timeout_s=timeout_s,
                    window=window,
                    progress=progress,
                )
            )
        finally:
            finish()
        results.append((rec, peer, res))
        if not as_json:
            status = "ok" if res.ok else f"FAILED: {res.error}"
            versions = ", ".join(map(str, res.weight_versions)) or "none"
            print(
                f"{rec.label} -> {to} as {peer}: {res.acked}/{res.batches} batches ({res.acked_trajectories}/"
                f"{res.trajectories} trajectories) acknowledged, {res.duplicates} resent batches the learner already had, in "
                f"{res.seconds:.1f} s; weights received (dropped): {versions}; {status}",
                file=out,
            )
        if not res.ok:
            break
    if as_json:
        json.dump(
            {
                "ok": all(r.ok for _, _, r in results),
                "streams": [
                    {
                        "recording": rec.label,
                        "peer_id": peer,
                        **{k: v for k, v in vars(r).items()},
                        "ok": r.ok,
                    }
                    for rec, peer, r in results
                ],
            },
            out,
            indent=1,
        )
        out.write("\n")
    return (
        0 if results and all(r.ok for _, _, r in results) and len(results) == len(recordings) else 1
    )


def _transport(cfg: Path | None) -> tuple[Any, tuple[float, float]]:
    """CURVE client keys and heartbeat settings from the run's config (defaults without one)."""
    if cfg is None:
        return None, (1.0, 10.0)
    import yaml

    tree = yaml.safe_load(cfg.read_text(encoding="utf-8")) or {}
    transport = tree.get("transport") or {}
    hb = (
        float(transport.get("heartbeat_interval_s", 1.0)),
        float(transport.get("heartbeat_timeout_s", 10.0)),
    )
    curve = transport.get("curve") or {}
    if not curve.get("enabled"):
        return None, hb

    return CurveClientKeys(
        Path(curve["secret_key_file"]), Path(curve["server_public_key_file"])
    ), hb


def _progress(rec: locate.Recording, out: TextIO, *, quiet: bool) -> tuple[Any, Any]:
    """(callback per acknowledged batch, finish) drawing a rich bar on a terminal, else nothing."""
    if quiet or not sys.stderr.isatty():
        return None, lambda: None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[file]}"),
    )
    task = bar.add_task(f"streaming {rec.server_id}", total=len(rec.files), file="")
    bar.start()

    def advance(res: StreamResult, path: Path) -> None:
        bar.update(task, completed=res.acked, file=path.name)

    return advance, bar.stop
