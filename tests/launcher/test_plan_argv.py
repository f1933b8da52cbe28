"""The command lines bin/train gives its children parse as each child's own CLI parses them."""

from __future__ import annotations

from common.cli import build_parser
from common.cli import main as cli_main
from common.config import load_config
from launcher.plan import plan_run


def test_log_format_reaches_every_child_before_its_own_overrides(job_overrides: list[str]) -> None:
    # `bin/train --log-format json` once put the option between the user's overrides and each
    # server's own, and every server exited "unrecognized arguments".
    overrides = [*job_overrides, "launch.rollout_servers=2", "launch.tool_server=true"]
    plan = plan_run(None, overrides, load_config(None, overrides, check_paths=False), "json")
    assert len(plan.rollouts) == 2 and plan.tool_server is not None
    parser = build_parser("child", "a child of bin/train")
    for child in plan.children:
        args = parser.parse_args(child.argv[2:])  # strict: no option may follow the overrides
        assert args.log_format == "json", child.name
        assert args.overrides[: len(overrides)] == overrides, child.name


def test_an_option_after_the_overrides_is_still_read(capsys) -> None:
    # --check prints the resolved config: the override after --log-format is in it
    status = cli_main(
        [
            "actor_rollout_ref.model.path=m",
            "data.train_files=t.jsonl",
            "trainer.total_training_steps=3",
            "--log-format",
            "json",
            "--check",
            "trainer.seed=7",
        ],
        prog="child",
        description="a child of bin/train",
        target="unused:unused",
        component="test",
        check_paths=False,
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "total_training_steps: 3" in out and "seed: 7" in out
