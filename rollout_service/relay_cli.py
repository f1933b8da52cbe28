"""``bin/weight-relay``'s command line: parsed before anything heavy is imported (``--help`` is
instant); the relay itself is ``rollout_service.relay``."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bin/weight-relay",
        description="Weight relay for one host: takes each policy version from the learner (or "
        "the relay before it in the chain), forwards it to the next relay, and hands it to the "
        "rollout servers of this host as a slot file on /dev/shm.",
    )
    p.add_argument("--learner", required=True, help="the learner's address, tcp://HOST:PORT")
    p.add_argument("--bind", default="tcp://0.0.0.0:0", help="where relays behind this one connect")
    p.add_argument(
        "--advertise",
        default="",
        help="--bind as other hosts reach it (default: --bind, a wildcard as this host's name)",
    )
    p.add_argument("--peer-id", default="", help="default: relay-<host>-<pid>")
    p.add_argument("--host", default="", help="host key of this machine (default: common.hostkey)")
    p.add_argument("--weights-dir", default="/dev/shm", help="where slot files go")
    p.add_argument("--keep", type=int, default=2, help="verified versions kept on disk")
    p.add_argument("--curve-secret-key", default="", help="this relay's CURVE certificate")
    p.add_argument("--curve-server-key", default="", help="the learner's public certificate")
    p.add_argument(
        "--token-file", default="", help="the learner's token file (RUN_DIR/learner.token)"
    )
    p.add_argument("--stall-after-chunks", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import anyio

    # lazy: this module is bin/weight-relay's command line, whose --help stays instant
    from protocol.zmq_auth import CurveClientKeys
    from rollout_service.relay import RelayRefused, WeightRelay

    relays: list[WeightRelay] = []

    async def serve() -> None:
        # Made inside the event loop: a relay with a token serves CURVE, whose ZAP authenticator
        # answers handshakes from this loop.
        relay = WeightRelay(
            learner=args.learner,
            bind=args.bind,
            advertise=args.advertise,
            peer_id=args.peer_id,
            host=args.host,
            weights_dir=args.weights_dir,
            keep=args.keep,
            stall_after_chunks=args.stall_after_chunks,
            curve=CurveClientKeys(Path(args.curve_secret_key), Path(args.curve_server_key))
            if args.curve_secret_key
            else None,
            token_file=args.token_file,
        )
        relays.append(relay)
        print(f"weight relay {relay.node.peer_id} at {relay.node.address}", flush=True)
        await relay.run()

    # SIGTERM unwinds like Ctrl-C: the slot files go (SlotFiles.close, also registered atexit)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        anyio.run(serve)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        refused = e.split(RelayRefused)[0] if isinstance(e, ExceptionGroup) else None
        if not isinstance(e, RelayRefused) and refused is None:
            raise
        print(f"weight relay: {refused.exceptions[0] if refused else e}", file=sys.stderr)
        return 2
    finally:
        for relay in relays:
            relay.files.close()
    return 0
