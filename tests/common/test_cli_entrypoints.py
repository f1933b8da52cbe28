"""bin/learner and bin/rollout-server: exit statuses, --check, start-up cost, the run path."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from common import cli
from common.config import load_config

REPO = Path(__file__).resolve().parents[2]
LEARNER = REPO / "bin" / "learner"
ROLLOUT_SERVER = REPO / "bin" / "rollout-server"
HEAVY = ("torch", "vllm", "ray", "transformers", "verl")


def run_bin(script: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    # sys.executable is the venv python that runs the tests.
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent(f"""\
            actor_rollout_ref:
              model: {{path: {model}}}
            data:
              train_files: train.jsonl
            trainer:
              experiment_name: clitest
              run_dir: {tmp_path}/runs/{{experiment_name}}
            """)
    )
    return path


@pytest.mark.integration
def test_help_is_fast_and_imports_nothing_heavy() -> None:
    start = time.perf_counter()
    result = run_bin(LEARNER, "--help")
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert "--check" in result.stdout and "key=value" in result.stdout
    assert elapsed < 1.0, f"--help took {elapsed:.2f} s"
    assert run_bin(ROLLOUT_SERVER, "--help").returncode == 0


@pytest.mark.parametrize("script", [LEARNER, ROLLOUT_SERVER], ids=lambda p: p.name)
@pytest.mark.integration
def test_check_prints_resolved_yaml_and_imports_nothing_heavy(
    script: Path, config_file: Path
) -> None:
    # Run the real script as __main__ in a child, then report which heavy modules it imported.
    probe = textwrap.dedent(f"""\
        import json, runpy, sys
        sys.argv = [{str(script)!r}, "--config", {str(config_file)!r}, "--check", "trainer.total_epochs=3"]
        try:
            runpy.run_path({str(script)!r}, run_name="__main__")
        except SystemExit as exc:
            status = exc.code
        heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)
        print(json.dumps({{"status": status, "heavy": heavy}}), file=sys.stderr)
        """)
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    report = json.loads(result.stderr.strip().splitlines()[-1])
    assert report == {"status": 0, "heavy": []}, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["trainer"]["total_epochs"] == 3
    assert printed["actor_rollout_ref"]["rollout"]["prompt_length"] == 256  # resolved
    assert not (config_file.parent / "runs").exists(), "--check must not create the run directory"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["trainer.totl_training_steps=3"],
            "trainer.totl_training_steps: unknown key (did you mean total_training_steps?)",
        ),
        (["trainer.total_epochs=abc"], "trainer.total_epochs: must be an integer (got 'abc')"),
        (["data.train_batch_size=-1"], "data.train_batch_size: must be greater than 0 (got -1)"),
        (
            [
                "data.train_files=[]",
                "data.datasets=[{name: a, path: a, ratio: 0.5}, {name: b, path: b, ratio: 0.2}]",
            ],
            "data.datasets: ratios must sum to 1 (got 0.7",
        ),
        (
            ["actor_rollout_ref.model.path=/no/such/model"],
            "actor_rollout_ref.model.path: directory does not exist: /no/such/model",
        ),
        (
            ["transport.curve.enabled=true"],
            "transport.curve.secret_key_file: required when transport.curve.enabled is true",
        ),
    ],
    ids=["unknown-key", "wrong-type", "negative-batch", "ratios", "model-path", "curve"],
)
@pytest.mark.integration
def test_invalid_config_exits_2_with_message(
    config_file: Path, overrides: list[str], expected: str
) -> None:
    result = run_bin(LEARNER, "--config", str(config_file), *overrides)
    assert result.returncode == 2
    assert expected in result.stderr
    assert "command line override" in result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr


@pytest.mark.integration
def test_invalid_file_exits_2_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(
        "actor_rollout_ref: {model: {path: .}}\ndata: {train_files: t}\ntrainer: {totl_training_steps: 1}\n"
    )
    result = run_bin(ROLLOUT_SERVER, "--config", str(path))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"{path}: trainer.totl_training_steps: unknown key (did you mean total_training_steps?)"
    )


@pytest.mark.integration
def test_bad_usage_exits_2() -> None:
    result = run_bin(LEARNER, "--log-format", "xml")
    assert result.returncode == 2 and "invalid choice" in result.stderr


FAKE_APP = """\
import json, logging
from pathlib import Path

def run(config, run_dir):
    logging.getLogger("fake.library").warning("from stdlib")
    Path(run_dir, "ran.json").write_text(json.dumps({
        "server_id": config.rollout_server.server_id,
        "epochs": config.trainer.total_epochs,
    }))
    return config.trainer.total_epochs - 1

async def run_async(config, run_dir):
    return 0

def crash(config, run_dir):
    raise RuntimeError("boom")

def disk_full(config, run_dir):  # deep in a task group, behind another error, as writes fail
    import errno
    try:
        raise OSError(errno.ENOSPC, "No space left on device", "/full/run/journal.bin")
    except OSError as e:
        raise ExceptionGroup("tasks", [ValueError("a task"), RuntimeError("write failed")]) from e
"""


@pytest.fixture
def fake_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "fake_agentrl_app.py").write_text(FAKE_APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fake_agentrl_app"


def test_run_saves_resolved_config_and_calls_target(
    config_file: Path, fake_app: str, restore_logging: None
) -> None:
    status = cli.main(
        ["--config", str(config_file), "--log-format", "json", "trainer.total_epochs=3"],
        prog="learner",
        description="test",
        target=f"{fake_app}:run",
        component="learner",
    )
    assert status == 2  # the target's own return value
    run_dir = config_file.parent / "runs" / "clitest"
    saved = load_config(run_dir / "config.resolved.yaml", check_paths=False)
    assert saved.trainer.total_epochs == 3
    assert json.loads((run_dir / "ran.json").read_text())["epochs"] == 3
    records = [
        json.loads(line) for line in (run_dir / "logs" / "learner.jsonl").read_text().splitlines()
    ]
    assert {r["component"] for r in records} == {"learner"}
    assert any(r["event"] == "from stdlib" and r["logger"] == "fake.library" for r in records)
    assert any(r["event"] == "starting" for r in records)


def test_rollout_server_gets_its_own_run_subdirectory(
    config_file: Path, fake_app: str, restore_logging: None
) -> None:
    status = cli.main(
        ["--config", str(config_file), "rollout_server.server_id=rs-1"],
        prog="rollout-server",
        description="test",
        target=f"{fake_app}:run_async",
        component="rollout-server",
        resolve=cli.resolve_rollout_server,
    )
    assert status == 0
    run_dir = config_file.parent / "runs" / "clitest" / "rollout-server" / "rs-1"
    assert (
        load_config(run_dir / "config.resolved.yaml", check_paths=False).rollout_server.server_id
        == "rs-1"
    )
    record = json.loads((run_dir / "logs" / "rollout-server.jsonl").read_text().splitlines()[0])
    assert record["server_id"] == "rs-1" and record["component"] == "rollout-server"


def test_derived_server_id_is_saved(
    config_file: Path, fake_app: str, restore_logging: None
) -> None:
    cli.main(
        ["--config", str(config_file)],
        prog="rollout-server",
        description="test",
        target=f"{fake_app}:run",
        component="rollout-server",
        resolve=cli.resolve_rollout_server,
    )
    (server_dir,) = (config_file.parent / "runs" / "clitest" / "rollout-server").iterdir()
    ran = json.loads((server_dir / "ran.json").read_text())
    assert ran["server_id"] == server_dir.name and server_dir.name.endswith(
        f"-{__import__('os').getpid()}"
    )


def _run_learner(config_file: Path, target: str) -> tuple[int, dict[str, Any]]:
    """The exit status of the learner's CLI running ``target``, and its last log record."""
    status = cli.main(
        ["--config", str(config_file)],
        prog="learner",
        description="test",
        target=target,
        component="learner",
    )
    log = (config_file.parent / "runs" / "clitest" / "logs" / "learner.jsonl").read_text()
    return status, json.loads(log.splitlines()[-1])


def test_failing_run_exits_1_and_logs_the_error(
    config_file: Path, fake_app: str, restore_logging: None
) -> None:
    status, failure = _run_learner(config_file, f"{fake_app}:crash")
    assert status == 1
    assert failure["event"] == "run failed" and failure["level"] == "error"
    assert "boom" in json.dumps(failure["exception"])


def test_a_full_disk_exits_74_with_one_line_naming_the_path(
    config_file: Path, fake_app: str, restore_logging: None
) -> None:
    status, stop = _run_learner(config_file, f"{fake_app}:disk_full")
    assert status == 74
    assert stop["event"] == "stopped: the disk is full" and "exception" not in stop
    assert stop["error"] == "No space left on device: /full/run/journal.bin"


def test_load_target_rejects_malformed_names() -> None:
    with pytest.raises(ValueError, match=r"package\.module:function"):
        cli.load_target("learner.app.run")


TOOL_SERVER = REPO / "bin" / "tool-server"
TRAIN = REPO / "bin" / "train"


def _data(tmp_path: Path) -> tuple[Path, Path]:
    """A good data file and one whose rows name what does not exist, or are not UTF-8."""
    good = tmp_path / "good.jsonl"
    good.write_text(
        '{"question": "a?", "answer": 1}\n{"question": "b?", "answer": 2, "reward_fn": "qa_em"}\n'
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(
        b'{"question": "a?", "answer": 1}\n'
        b'{"question": "b?", "answer": 1, "agent": "no_such_agent", "reward_fn": "no_such_reward"}\n'
    )
    return good, bad


@pytest.mark.integration
def test_check_refuses_unknown_names_and_bad_data_like_the_real_start(
    config_file: Path, tmp_path: Path
) -> None:
    good, bad = _data(tmp_path)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"question": "a?", "answer": 1}\n{"question": "caf\xe9?", "answer": 1}\n')
    result = run_bin(
        ROLLOUT_SERVER,
        "--config",
        str(config_file),
        "--check",
        f"data.train_files=[{good},{bad},{latin1}]",
        "rollout_server.reward_fn=no_such_default",
        "actor_rollout_ref.rollout.multi_turn.tools=[calculator,no_such_tool]",
    )
    assert result.returncode == 2, result.stderr
    err = result.stderr
    assert f"{bad}: line 2: field 'agent': unknown agent type 'no_such_agent'; known:" in err
    assert f"{bad}: line 2: field 'reward_fn': unknown reward function 'no_such_reward'" in err
    assert "rollout_server.reward_fn: unknown reward function 'no_such_default'" in err
    assert "actor_rollout_ref.rollout.multi_turn.tools: unknown tool 'no_such_tool'" in err
    assert f"data.train_files.2: {latin1}: line 2: not UTF-8" in err
    assert result.stdout == ""  # nothing resolved is printed for a config that would not start
    # A row over data.max_row_bytes fails --check too, naming file, line, size and limit.
    result = run_bin(
        ROLLOUT_SERVER,
        "--config",
        str(config_file),
        "--check",
        f"data.train_files={good}",
        "data.max_row_bytes=40",
    )
    assert result.returncode == 2
    size = len(good.read_bytes().splitlines()[1])
    assert (
        f"{good}: line 2: row of {size} bytes is larger than data.max_row_bytes=40" in result.stderr
    )


@pytest.mark.integration
def test_check_passes_good_data_and_only_warns_about_validation_files(
    config_file: Path, tmp_path: Path
) -> None:
    good, bad = _data(tmp_path)
    result = run_bin(
        ROLLOUT_SERVER,
        "--config",
        str(config_file),
        "--check",
        f"data.train_files={good}",
        f"data.val_files=[{bad},{tmp_path / 'elsewhere.jsonl'}]",
    )
    assert result.returncode == 0, result.stderr
    assert "warning: " in result.stderr and "unknown agent type 'no_such_agent'" in result.stderr
    assert "elsewhere.jsonl: no such data file on this machine" in result.stderr
    assert yaml.safe_load(result.stdout)["data"]["train_files"] == [str(good)]


@pytest.mark.integration
def test_tool_server_and_train_check_names_too(config_file: Path, tmp_path: Path) -> None:
    result = run_bin(
        TOOL_SERVER,
        "--config",
        str(config_file),
        "--check",
        "tool_server.tools=[python,no_such_tool]",
    )
    assert result.returncode == 2
    assert "tool_server.tools: unknown tool 'no_such_tool'" in result.stderr
    _, bad = _data(tmp_path)
    result = run_bin(TRAIN, "--config", str(config_file), "--check", f"data.train_files={bad}")
    assert result.returncode == 2
    assert "unknown agent type 'no_such_agent'" in result.stderr


@pytest.mark.integration
def test_train_reads_every_row_and_needs_its_data_here(config_file: Path, tmp_path: Path) -> None:
    # A bad row past the rollout server's peek once started the learner, Ray and six rollout
    # server launches before the run exited 1: bin/train reads every row before it starts anything.
    rows = tmp_path / "long.jsonl"
    lines = ['{"question": "q?", "answer": 1}'] * 300
    lines[249] = '{"question": "q?", "answer": 1, "agent": "no_such_agent"}'
    rows.write_text("\n".join(lines) + "\n")
    server = run_bin(
        ROLLOUT_SERVER, "--config", str(config_file), "--check", f"data.train_files={rows}"
    )
    assert server.returncode == 0, server.stderr  # a standalone server's check peeks
    result = run_bin(TRAIN, "--config", str(config_file), "--check", f"data.train_files={rows}")
    assert result.returncode == 2
    assert f"{rows}: line 250: field 'agent': unknown agent type 'no_such_agent'" in result.stderr
    # The servers bin/train starts here read their data here: a missing file is refused at start
    # (--check only warns: the data may be made before the run).
    missing = tmp_path / "missing.jsonl"
    result = run_bin(TRAIN, "--config", str(config_file), f"data.train_files={missing}")
    assert result.returncode == 2
    assert f"{missing}: no such data file (the rollout servers run here)" in result.stderr


# ---------------------------------------------------------------- bin/* from any shell


def _bare_env() -> dict[str, str]:
    """What `env -i PATH=/usr/bin:/bin HOME=$HOME` leaves: no venv activated, no PYTHONPATH."""
    import os

    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}


def _system_python() -> str:
    import shutil

    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no python3 on /usr/bin:/bin")
    return python


@pytest.mark.integration
def test_entrypoints_run_from_a_shell_without_the_venv(config_file: Path) -> None:
    """The issue's check (`env -i PATH=/usr/bin:/bin HOME=$HOME bin/rollout-server --config F
    --check`): a plain shell (the shebang finds the system python3) re-runs the entrypoint with
    .venv/bin/python; --help stays fast through the re-exec."""
    _system_python()
    result = subprocess.run(
        [str(LEARNER), "--config", str(config_file), "--check"],
        env=_bare_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert "rollout_server:" in result.stdout
    for name in (
        "rollout-server",
        "train",
        "learner",
        "tool-server",
        "plot",
        "conformance",
        "replay",
        "doctor",
        "weight-relay",
    ):
        start = time.perf_counter()
        result = subprocess.run(
            [str(REPO / "bin" / name), "--help"],
            env=_bare_env(),
            capture_output=True,
            text=True,
            timeout=30,
            cwd=REPO,
        )
        assert result.returncode == 0, (name, result.stderr)
        assert "usage" in result.stdout.lower()
        assert time.perf_counter() - start < 2.0, name


@pytest.mark.integration
def test_missing_venv_says_run_setup(tmp_path: Path) -> None:
    """A checkout without .venv, run by a Python without the project's packages: one line that
    says to run bin/setup, not a ModuleNotFoundError."""
    import shutil

    python = _system_python()
    if (
        subprocess.run(
            [python, "-c", "import structlog"], capture_output=True, env=_bare_env()
        ).returncode
        == 0
    ):
        pytest.skip("the system python has the project's packages: nothing to refuse")
    (tmp_path / "bin").mkdir()
    (tmp_path / "common").mkdir()
    shutil.copy(ROLLOUT_SERVER, tmp_path / "bin" / "rollout-server")
    shutil.copy(REPO / "common" / "venv.py", tmp_path / "common" / "venv.py")
    (tmp_path / "common" / "__init__.py").write_text("")
    result = subprocess.run(
        [python, str(tmp_path / "bin" / "rollout-server"), "--help"],
        env=_bare_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "run bin/setup" in result.stderr and "ModuleNotFoundError" not in result.stderr


@pytest.mark.integration
def test_check_refuses_a_sink_whose_package_is_missing(config_file: Path) -> None:
    """trainer.logger=[..., wandb] without wandb installed: refused by --check (bin/learner and
    bin/train) and at start before Ray, with the install hint, not a traceback after Ray."""
    import importlib.util

    from learner.sinks import WANDB_MISSING, missing_sink_packages

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    assert missing_sink_packages(["console", "jsonl", "wandb", "wandb"]) == [WANDB_MISSING]
    for script in (LEARNER, TRAIN):
        result = run_bin(
            script,
            "--config",
            str(config_file),
            "--check",
            "trainer.logger=[console,wandb]",
            "launch.rollout_servers=1",
        )
        assert result.returncode == 2, (script.name, result.stderr)
        assert "pip install wandb" in result.stderr and "Traceback" not in result.stderr
    assert (
        run_bin(
            LEARNER, "--config", str(config_file), "--check", "trainer.logger=[console]"
        ).returncode
        == 0
    )
    # The start, before Ray: the learner's run target refuses it first.
    from common.config import load_config as load
    from learner.app import run

    config = load(str(config_file), ["trainer.logger=[console,wandb]"], check_paths=False)
    assert run(config, config_file.parent) == 2


def test_a_full_disk_without_a_path_names_the_code_that_wrote() -> None:
    from common import disk_full

    try:
        raise OSError(28, "No space left on device")
    except OSError as e:
        said = disk_full.describe(e)
    assert said.startswith("No space left on device: a file written at ")
    assert "test_cli_entrypoints.py:" in said
