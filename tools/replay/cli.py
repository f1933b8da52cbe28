"""Command line of ``bin/replay``: ``inspect``, ``stream`` and ``rerun`` of recorded trajectories.

Parses arguments with nothing heavy imported (``--help`` is instant); each subcommand imports its
module only when it runs. Exit status: 0 success; 1 the command's negative outcome (nothing
matched, a batch refused or not acknowledged, a rerun that diverged or could not rerun an
episode); 2 usage or set-up error (not a recording, no config or model, bad config); 130
interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys

EPILOG = """\
PATH is a run directory (RUN_DIR, holding recordings/<server_id>/), one recording directory
(RUN_DIR/recordings/<server_id>) or one batch file (batch-<n>.msgpack). Recordings are written by a
rollout server started with rollout_server.record=true. The tokenizer, the data and the agents come
from the config the server saved (RUN_DIR/rollout-server/<server_id>/config.resolved.yaml, else
RUN_DIR/config.resolved.yaml); --config and --model override it. Relative paths in that config are
relative to the directory the server ran in.

examples:
  bin/replay inspect runs/tiny-cpu --limit 3
  bin/replay inspect runs/tiny-cpu/recordings/rs0 --trajectory e0-i17-2 --html /tmp/e0-i17.html
  bin/replay stream runs/tiny-cpu/recordings/rs0 --to tcp://127.0.0.1:5555 \
      --token-file runs/LEARNER_RUN/learner.token
  bin/replay rerun runs/tiny-cpu --json
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="replay",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
        description="Recorded trajectories for offline debugging: show them, stream them "
        "to a learner, or rerun their episodes and compare.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="{inspect,stream,rerun}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "path", metavar="PATH", help="run directory, recording directory or batch file"
        )
        p.add_argument(
            "--model",
            metavar="DIR",
            help="model directory (tokenizer) instead of the run's actor_rollout_ref.model.path",
        )
        p.add_argument(
            "--config", metavar="FILE", help="the rollout server's config instead of the saved one"
        )
        p.add_argument(
            "--unchecked",
            action="store_true",
            help="read batch files whose checksums do not match (edited or damaged) anyway",
        )

    p = sub.add_parser(
        "inspect",
        help="show recorded trajectories (terminal, plain text or HTML)",
        description="Show recorded trajectories: a header per trajectory, the prompt, and the "
        "response with model tokens (mask 1) and tool/context tokens (mask 0) told "
        "apart by colour, or by [model]...[/model] / [tool]...[/tool] markers when "
        "the output is not a terminal or with --no-color.",
    )
    common(p)
    p.add_argument(
        "--trajectory",
        metavar="ID",
        help="only this trajectory (an episode id shows all its segments)",
    )
    p.add_argument("--group", metavar="UID", help="only this group (prompt)")
    p.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="show at most N trajectories (default 20; all with --html)",
    )
    p.add_argument(
        "--html", metavar="OUT", help="write one self-contained HTML page to OUT instead"
    )
    p.add_argument(
        "--no-color", action="store_true", help="plain text with markers even on a terminal"
    )

    p = sub.add_parser(
        "stream",
        help="send a recording to a learner as its rollout server did",
        description="Send the recorded batches, in order, to a learner over the real protocol "
        "(same trajectory ids), respecting credits and waiting for every "
        "acknowledgement. Exit 0 when all are acknowledged, 1 otherwise.",
    )
    common(p)
    p.add_argument("--to", required=True, metavar="tcp://HOST:PORT", help="the learner's address")
    p.add_argument(
        "--server-id",
        metavar="ID",
        help="peer id to connect as (default replay-<recorded server id>)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="give up after S seconds without an acknowledgement (default 120)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=8,
        metavar="N",
        help="batches held unacknowledged at most (default 8)",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="the target learner's token (its RUN_DIR/learner.token), which a learner with "
        "transport.auth: token, the default without CURVE, requires at the handshake",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = sub.add_parser(
        "rerun",
        help="rerun the recorded episodes (real agents, tools, rewards) and compare",
        description="Rerun every recorded episode through the agent loop, tools and reward "
        "functions of the run's config with an engine that plays back the recorded "
        "model tokens, and compare with the recording. Exit 0 when nothing "
        "diverged, 1 on any divergence or episode that could not be rerun. Tools on "
        "a tool server (tools.remote.url) need that server running.",
    )
    common(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--concurrency", type=int, default=8, metavar="N", help="groups rerun at once (default 8)"
    )
    p.add_argument(
        "--shared-limits",
        action="store_true",
        help="rate-limited tools take tokens from the run's own buckets (default: buckets of the "
        "rerun's own, with the same limits, so a rerun never waits on a live run's tokens)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides, e.g. tools.remote.url=...",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # lazy: this module is bin/replay's command line, whose --help stays instant
    from common.logging import configure_logging
    from tools.replay.locate import ReplayError

    # Agents and tools log through structlog; only what goes wrong belongs next to a report.
    configure_logging("console", "warning", component="replay", stream=sys.stderr)
    # a warning per call about its own timeouts
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        if args.command == "inspect":
            # lazy: this module is bin/replay's command line, whose --help stays instant
            from tools.replay import show

            return show.run(
                args.path,
                trajectory=args.trajectory,
                group=args.group,
                limit=args.limit,
                html_out=args.html,
                model=args.model,
                config=args.config,
                color=False if args.no_color else None,
                verify=not args.unchecked,
            )
        if args.command == "stream":
            # lazy: this module is bin/replay's command line, whose --help stays instant
            from tools.replay import stream

            return stream.run(
                args.path,
                to=args.to,
                server_id=args.server_id,
                model=args.model,
                config=args.config,
                timeout_s=args.timeout,
                window=args.window,
                as_json=args.json,
                token_file=args.token_file,
                verify=not args.unchecked,
            )
        # lazy: this module is bin/replay's command line, whose --help stays instant
        from tools.replay import rerun

        return rerun.run(
            args.path,
            config=args.config,
            model=args.model,
            overrides=args.overrides,
            as_json=args.json,
            concurrency=args.concurrency,
            shared_limits=args.shared_limits,
            verify=not args.unchecked,
        )
    except ReplayError as e:
        print(f"replay {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
