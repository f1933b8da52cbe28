"""bin/chaos's command line: the options, the refusals before anything starts, the verdict."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import asdict

from tools.chaos.disk import DiskError
from tools.chaos.faults import FAULTS
from tools.chaos.run import Chaos


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="chaos",
        description="Run a real bin/train job (tiny model, CPU) with faults injected at seeded "
        "moments, then check its invariants; one-line verdict, a JSON report with --json, exit 1 "
        "on any violation.",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="runs/chaos", help="where the assets, run and report go")
    ap.add_argument("--steps", type=int, default=12, help="training steps the job must reach")
    ap.add_argument("--faults", type=int, default=4, help="faults injected")
    ap.add_argument(
        "--kinds",
        type=lambda s: [k for k in s.split(",") if k],
        default=list(FAULTS),
        help=f"comma-separated fault kinds (default all: {','.join(FAULTS)})",
    )
    ap.add_argument("--window-s", type=float, default=60.0, help="faults fall in this many seconds")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--save-freq", type=int, default=2)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="for the whole run")
    ap.add_argument("--stop-wait-s", type=float, default=120.0)
    ap.add_argument(
        "--disk-mib", type=int, default=256, help="the run directory's tmpfs (kind disk-full)"
    )
    ap.add_argument("--max-rss-growth-mib", type=float, default=512.0)
    ap.add_argument("--max-fd-growth", type=int, default=64)
    ap.add_argument(
        "--min-observed-s",
        type=float,
        default=120.0,
        help="growth is judged for processes observed at least this long",
    )
    ap.add_argument("--json", action="store_true", help="print the JSON report after the verdict")
    ap.add_argument("override", nargs="*", metavar="key=value", help="more bin/train overrides")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [k for k in args.kinds if k not in FAULTS]
    if unknown:
        print(
            f"chaos: unknown fault kind(s) {unknown}; known: {', '.join(FAULTS)}", file=sys.stderr
        )
        return 2
    chaos = Chaos(args)
    chaos.root.mkdir(parents=True, exist_ok=True)
    # SIGTERM as Ctrl-C: the run stops its job and unmounts its disk on the way out
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        report = chaos.go()
    except DiskError as e:
        print(f"chaos: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("chaos: interrupted; the job was stopped", file=sys.stderr)
        return 130
    doc = {"verdict": report.verdict, **asdict(report)}
    (chaos.root / "chaos.json").write_text(json.dumps(doc, indent=1))
    print(report.verdict)
    for violation in report.violations:
        print(f"  violation: {violation}")
    if args.json:
        print(json.dumps(doc, indent=1))
    return 1 if report.violations else 0
