"""bin/train: a whole training job on this machine from one config, supervised until it ends.

Design: the command checks the config (``--check`` stops there), plans the children
(`launcher.plan`) and hands them to the supervisor (`launcher.supervisor`), which starts them,
follows the run through the event channel and metrics.jsonl, and stops them all however it ends.
Every import past argument parsing is lazy, so ``--help`` stays instant.

Ending: the learner exiting 0 with every step done is success; the children are stopped (see
`launcher.children.stop_all`), the curves are drawn and a summary printed (exit 0). A dead
rollout server is restarted on its shard (its cursor and spool resume it) up to
`launch.max_restarts` times, and so is a dead tool server, on the port the rollout servers were
given; the learner dying, restarts running out, the rollout servers (or a restarted tool server)
not answering within `launch.connect_timeout_s`, or a step count short of the total stop
everything (exit 1, naming the process and its log). SIGINT/SIGTERM stop everything
(exit 130); a second one skips the grace period. A bad config exits 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from common import disk_full  # stdlib only


def main(argv: Sequence[str] | None = None) -> int:
    # lazy: this module is bin/train's command line, whose --help stays instant
    from common.cli import build_parser

    parser = build_parser(
        "train",
        "Run a whole training job on this machine: the learner, launch.rollout_servers rollout "
        "servers (and a tool server with launch.tool_server=true), all from one config and one run "
        "directory; shows progress, restarts rollout servers and the tool server that die, "
        "stops everything on Ctrl-C, and draws RUN_DIR/training_curves.png at the end.",
    )
    args = parser.parse_intermixed_args(argv)  # options may follow the overrides

    # lazy: this module is bin/train's command line, whose --help stays instant
    from common.config import ConfigError, dump_config, load_config
    from common.logging import configure_logging, format_from_env, get_logger
    from common.rundir import prepare_run_dir
    from launcher.plan import check_launch, plan_run

    try:
        config = load_config(args.config, args.overrides, check_paths=True)
        check_launch(config, args.config, args.overrides)
        # lazy: this module is bin/train's command line, whose --help stays instant
        from common.cli import (
            LEARNER_PREFLIGHT,
            TOOL_SERVER_PREFLIGHT,
            TRAIN_CHECK_PREFLIGHT,
            TRAIN_ROLLOUT_PREFLIGHT,
            check_preflight,
            print_aliases,
        )

        # What the learner (its metric sinks), the rollout servers (names, every row of the data)
        # and the tool server would refuse at start: checked before anything starts, since it
        # would otherwise fail only after Ray started, or in rollout servers, one after another.
        preflights = [
            LEARNER_PREFLIGHT,
            TRAIN_CHECK_PREFLIGHT if args.check else TRAIN_ROLLOUT_PREFLIGHT,
            *([TOOL_SERVER_PREFLIGHT] if config.launch.tool_server else []),
        ]
        if args.check:
            print_aliases(config)
        if status := max(check_preflight(p, config) for p in preflights):
            return status
        if args.check:
            sys.stdout.write(dump_config(config))
            return 0
        plan = plan_run(args.config, args.overrides, config, args.log_format)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        if "model.path" in str(exc) and (hint := model_hint(args.config)):
            print(f"the model this config needs is made by: {hint}", file=sys.stderr)
        return 2
    prepare_run_dir(plan.config, plan.run_dir)
    configure_logging(
        args.log_format or format_from_env(plan.config.logging.format),
        plan.config.logging.level,
        component="train",
        file=plan.run_dir / "logs" / "train.jsonl",
    )
    # lazy: this module is bin/train's command line, whose --help stays instant
    from launcher.supervisor import Supervisor

    log = get_logger("launcher")
    try:
        return Supervisor(plan, log).run()
    except KeyboardInterrupt:  # a Ctrl-C after the children were stopped (while plotting)
        return 130
    except OSError as e:  # the children are stopped by now; a full disk ends bin/train's writes
        if (full := disk_full.find(e)) is None:
            raise
        log.error("stopped: the disk is full", error=disk_full.describe(full))
        return disk_full.EXIT_DISK_FULL


MODEL_HINT = "# model made by:"
"""A config's header line naming the command that writes its model (configs/gpu_e2e.yaml)."""


def model_hint(config_file: str | None) -> str | None:
    """The command a config names for making its model, for the error when the model is missing."""
    if config_file is None:
        return None
    try:
        lines = open(config_file, encoding="utf-8").read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(MODEL_HINT):
            return line[len(MODEL_HINT) :].strip()
    return None
