"""Command line of the conformance suite (``bin/conformance``).

Parses arguments with nothing heavy imported (``--help`` is instant), then runs the suite and
prints the report. Exit status: 0 all checks passed, 1 a check failed, 2 usage or set-up error
(unknown check, address that cannot be bound or connected), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

EPILOG = """\
roles:
  learner         The suite connects to the learner listening at --target and plays rollout
                  servers (fresh DEALER sockets and peer_ids per check). Example:
                    bin/conformance --role learner --target tcp://127.0.0.1:5555
                  A learner that checks tokenizers needs --model-dir (the model it trains).

  rollout-server  The suite BINDS a ROUTER at --target and plays the learner. Start the rollout
                  server under test with its learner address set to that same address (before or
                  after the suite: it waits --wait seconds for the HELLO), e.g.
                    bin/conformance --role rollout-server --target tcp://127.0.0.1:5555 &
                    python -m protocol.reference rollout-server --connect tcp://127.0.0.1:5555
                  The checks run in order on that one connection; the WELCOME asks for heartbeats
                  every 0.2 s (timeout 3.0 s). The last check answers a HELLO with a fatal
                  VERSION_MISMATCH, after which a conforming server stops sending.

exit status: 0 all passed, 1 a check failed, 2 usage or set-up error.
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="conformance",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
        description="Protocol conformance suite: checks a live learner or rollout server against protocol/.",
    )
    ap.add_argument(
        "--target",
        metavar="tcp://HOST:PORT",
        help="learner role: the learner's address; rollout-server role: address to bind",
    )
    ap.add_argument(
        "--role",
        required=True,
        choices=["learner", "rollout-server"],
        help="which kind of endpoint is under test",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to wait for each expected reply (default 5)",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this check (repeatable, or comma-separated); see --list",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of lines")
    ap.add_argument("--list", action="store_true", help="list the checks of --role and exit")
    ap.add_argument(
        "--wait",
        type=float,
        default=30.0,
        metavar="S",
        help="rollout-server role: seconds to wait for the server to connect (default 30)",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        metavar="S",
        help="seconds for the whole run (default: none): a check still running then fails, naming "
        "what it waited for, and the rest are not run; set it below a CI job's own timeout",
    )
    ap.add_argument(
        "--weights-from",
        metavar="DIR",
        help="rollout-server role: transfer the *.safetensors weights in DIR (the model the "
        "server serves) instead of a small synthetic set",
    )
    ap.add_argument(
        "--model-dir",
        metavar="DIR",
        help="learner role: send this model's and tokenizer's identity in HELLO",
    )
    ap.add_argument(
        "--token-file",
        metavar="FILE",
        help="learner role: present the token in FILE at the handshake, as a learner with "
        "transport.auth: token (the default without CURVE) requires (RUN_DIR/learner.token)",
    )
    return ap


def _token(path: str) -> str:
    from pathlib import Path

    # lazy: this module is bin/conformance's command line, whose --help stays instant
    from common.peer_auth import read_token

    return read_token(Path(path))


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    only = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    if not args.target and not args.list:
        ap.error("--target is required")
    if args.timeout <= 0 or args.wait <= 0 or (args.deadline is not None and args.deadline <= 0):
        ap.error("--timeout, --wait and --deadline must be > 0")

    # lazy: this module is bin/conformance's command line, whose --help stays instant
    from tools.conformance import report, runner

    if args.list:
        for c in runner.registry.checks(args.role):
            print(f"{c.name:<24} {c.summary}")
        return 0
    try:
        checks = runner.select(args.role, only)
    except ValueError as e:
        ap.error(str(e))
    width = max(len(c.name) for c in checks)

    def on_listening(address: str) -> None:
        print(
            f"conformance: listening on {address}; waiting up to {args.wait:g} s for a rollout server",
            file=sys.stderr,
            flush=True,
        )

    def on_result(r: runner.Result) -> None:
        if not args.json:
            print(report.line(r, width), flush=True)

    token = None
    if args.token_file:
        try:
            token = _token(args.token_file)
        except (OSError, ValueError) as e:
            ap.error(f"--token-file: {e}")
    opts = runner.SuiteOptions(
        role=args.role,
        target=args.target,
        timeout=args.timeout,
        only=only,
        wait=args.wait,
        weights_from=args.weights_from,
        model_dir=args.model_dir,
        token=token,
        deadline=args.deadline,
    )
    import zmq

    try:
        rep = runner.run(opts, on_listening=on_listening, on_result=on_result)
    except zmq.ZMQError as e:
        print(f"conformance: cannot use {args.target}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("conformance: interrupted", file=sys.stderr)
        return 130
    print(report.as_json(rep) if args.json else report.summary(rep), flush=True)
    return 0 if rep.failed == 0 else 1
