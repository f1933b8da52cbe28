"""A stand-in rollout server for learner process tests: real protocol, real ZeroMQ, no engine.

Sends ``--groups`` groups of ``--n`` synthetic trajectories (valid tokens of the tiny model's
vocabulary, a masked tool span in the middle, rewards that depend on the group) as one batch per
group, survives learner restarts (the protocol reconnects and resends what was not acknowledged),
applies every weight transfer it gets, and writes what happened to ``--out`` as JSON lines:
{"acked": [ids]} when a batch is acknowledged, {"weights": version} per transfer. It exits on
SIGTERM or when the learner says BYE.
"""

from __future__ import annotations

import argparse
import json
import signal
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import numpy as np

from common.peer_auth import wait_for_token
from protocol.driver import RolloutClient
from protocol.events import BatchAcked, PeerClosed, WeightsReceived
from protocol.reference import REFERENCE_MODEL, synthetic_trajectory, tokenizer_from_dir
from protocol.sender import RolloutConnection
from protocol.zmq_transport import client_factory


async def main(args: argparse.Namespace) -> None:
    out = open(args.out, "a", buffering=1)
    conn = RolloutConnection(
        peer_id=args.peer_id,
        epoch=uuid.uuid4().hex,
        model=REFERENCE_MODEL,
        tokenizer=tokenizer_from_dir(args.model),
    )
    token: Callable[[], Awaitable[str]] | None = None
    if args.token_file is not None:  # the learner's token (transport.auth: token), when it exists

        async def read_token() -> str:
            return await wait_for_token(args.token_file)

        token = read_token

    client = RolloutClient(conn, client_factory(args.connect, token=token), reconnect_delay_s=0.2)
    rng = np.random.default_rng(args.seed)
    by_seq: dict[int, list[str]] = {}
    async with anyio.create_task_group() as tg:
        await tg.start(client.run)

        async def produce() -> None:
            for g in range(args.groups):
                uid = f"{args.peer_id}-g{g}"
                trajs = []
                for i in range(args.n):
                    t = synthetic_trajectory(
                        rng,
                        server=args.peer_id,
                        prompt_len=8,
                        response_len=12,
                        version=conn.policy_version,
                        vocab=500,
                    )
                    t.trajectory_id, t.group_uid, t.reward = f"{uid}-{i}", uid, float(i % 2)
                    trajs.append(t)
                seq = await client.submit(trajs)
                by_seq[seq] = [t.trajectory_id for t in trajs]

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    await client.close("stopped")
                    tg.cancel_scope.cancel()

        tg.start_soon(produce)
        tg.start_soon(stop_on_signal)
        async for ev in client.events:
            if isinstance(ev, BatchAcked):
                for s in ev.seqs:
                    out.write(json.dumps({"acked": by_seq.get(s, [])}) + "\n")
            elif isinstance(ev, WeightsReceived):
                client.weights_applied(ev.weights.version, ev.weights.transfer_id, ok=True)
                out.write(json.dumps({"weights": ev.weights.version}) + "\n")
            elif isinstance(ev, PeerClosed) and args.exit_on_bye:
                break
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--connect", required=True)
    ap.add_argument(
        "--model", required=True, help="model directory (its tokenizer identity is announced)"
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--peer-id", default="feeder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exit-on-bye", action="store_true")
    ap.add_argument(
        "--token-file", type=Path, help="the learner's token file (RUN_DIR/learner.token)"
    )
    anyio.run(main, ap.parse_args())
