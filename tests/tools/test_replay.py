"""bin/replay on recordings made here from scripted episodes: the real tool agent (calculator,
finish), the real code agent (sandboxed python, state masking), the math reward and the tiny
model's tokenizer; only generation is scripted. Inspect (markers, tool calls, HTML), rerun (an
untouched recording reproduces exactly; a tampered tool output or reward is found with its
position) and stream (to an in-process reference learner over ZeroMQ)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "rollout"))  # scripted.py: the scripted engine

from scripted import ScriptedEngine  # noqa: E402

from tools.replay.cli import main  # noqa: E402

pytestmark = pytest.mark.integration

SERVER = "rs0"
ROWS = [
    {"question": "What is 2 + 3? Use the calculator.", "answer": "5", "data_source": "arithmetic"},
    {"question": "What is 7 * 6? Use the calculator.", "answer": "42", "data_source": "arithmetic"},
    {
        "question": "What is 6 * 7? Use python.",
        "answer": "42",
        "data_source": "arithmetic",
        "agent": "code",
    },
    {
        "question": "What is the secret number in the document?",
        "answer": "4242",
        "data_source": "longdoc",
        "agent": "statelm",
        "documents": [
            {
                "title": "report",
                "text": "Filler text. " * 40 + "The secret number is 4242. " + "More filler. " * 30,
            }
        ],
    },
]


def call(name: str, **args: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


SCRIPTS = {
    "e0-i0-0": [call("calculator", expression="2 + 3"), "The answer is \\boxed{5}."],
    "e0-i0-1": [call("calculator", expression="2 + 3"), call("finish", answer="5")],
    "e0-i1-0": [call("calculator", expression="7 * 6"), "The answer is \\boxed{41}."],
    "e0-i1-1": ["I think it is \\boxed{42}."],
    # The code agent: code runs mid-turn; <state> spans are masked out (mask 0) though sampled.
    "e0-i2-0": [
        "<state>plan</state>Compute. <code>print(6 * 7)</code>",
        "So \\boxed{42}. <answer>42</answer>",
    ],
    "e0-i2-1": ["<code>print(6 * 7)</code>", "<state>ok</state>\\boxed{42}<answer>42</answer>"],
    # StateLM: each deletion closes a segment (snapshot trajectories e0-i3-<i>-0, -1, then the final -2).
    "e0-i3-0": [
        call("loadDocument", doc_id=0),
        call("readChunk", doc_id=0, chunk=1),
        call("note", key="secret", summary="the number", content="4242"),
        call("deleteContext", msg_id=5),
        call("readNote", key="secret"),
        call("deleteContext", msg_id=4),
        call("finish", answer="4242"),
    ],
    "e0-i3-1": [
        call("checkBudget"),
        call("deleteContext", msg_id=2),
        call("finish", answer="4243"),
    ],
}
TRAJECTORIES = [
    *(k for k in SCRIPTS if not k.startswith("e0-i3")),
    "e0-i3-0-0",
    "e0-i3-0-1",
    "e0-i3-0-2",
    "e0-i3-1-0",
    "e0-i3-1-1",
]


def write_batch(directory: Path, n: int, trajectories: list[Any]) -> Path:
    from protocol.sender import encode_batch
    from rollout_service.recording import batch_path, write_batch_file

    path = batch_path(directory, n)
    write_batch_file(path, encode_batch(n, trajectories), server_id=SERVER, seq=n, durable=False)
    return path


async def record(config: Any, recordings: Path) -> None:
    """Run the scripted groups through the real agents and rewards; one batch file per group."""
    from transformers import AutoTokenizer

    from rollout_service.agents.base import AgentDeps
    from rollout_service.agents.parsers import HermesParser
    from rollout_service.agents.rendering import ChatRenderer
    from rollout_service.data import PromptSource
    from rollout_service.groups import RewardChoice, run_group
    from rollout_service.server import (
        agent_limits,
        build_agent_deps,
        check_names,
        sampling_settings,
    )

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path))
    engine = ScriptedEngine(renderer.tok, [])
    engine.per_request = SCRIPTS.__getitem__
    source = PromptSource.from_config(config.data, shard_index=0, shard_count=1)
    check_names(config, {"tool_agent", "code", "statelm"})
    base = AgentDeps(
        engine=engine,
        renderer=renderer,
        sampling=sampling_settings(config),
        limits=agent_limits(config),
        parser=HermesParser(),
    )
    deps = build_agent_deps(config, base, {"tool_agent", "code", "statelm"}, None)
    recordings.mkdir(parents=True)
    for i, r in enumerate(source.rows):
        result = await run_group(
            group_uid=f"e0-i{i}",
            row=r.row,
            n=2,
            agent_type=r.agent_type,
            data_source=r.data_source,
            deps=deps[r.agent_type],
            rewards=RewardChoice("math"),
            server_id=SERVER,
        )
        write_batch(recordings, i + 1, result.trajectories)


@pytest.fixture(scope="module")
def run_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RUN_DIR with recordings/rs0/ (4 batches) and the server's saved config, as a server leaves them."""
    from common.config import dump_config, load_config

    tmp = tmp_path_factory.mktemp("replay")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    run = tmp / "run"
    config = load_config(
        REPO / "configs" / "rollout_tiny.yaml",
        [
            f"actor_rollout_ref.model.path={tiny_model}",
            f"data.train_files=[{data}]",
            f"trainer.run_dir={run}",
            f"rollout_server.server_id={SERVER}",
            "actor_rollout_ref.rollout.n=2",
            'agents.code.mask_spans=[{start: "<state>", end: "</state>"}]',
            "agents.statelm.chunk_chars=400",
            # room for StateLM's eight tool schemas in the prompt (the tiny tokenizer is nearly bytes)
            "data.max_prompt_length=4096",
            "data.max_response_length=2048",
            "actor_rollout_ref.rollout.max_model_len=8192",
            "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=256",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=10",
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=1000",
            # the reruns run the recorded code again: beside another test worker on a loaded
            # 2-core machine a sandboxed run once took longer than the default 10 s, and the rerun
            # then rightly reported a divergence that was the machine's, not the replay's
            "tools.python.timeout_s=60",
        ],
    )
    saved = run / "rollout-server" / SERVER / "config.resolved.yaml"
    saved.parent.mkdir(parents=True)
    saved.write_text(dump_config(config))
    anyio.run(record, config, run / "recordings" / SERVER)
    return run


def recorded(run: Path) -> list[Any]:
    from rollout_service.recording import read_recording

    return [t for _, ts in read_recording(run / "recordings" / SERVER) for t in ts]


def copy_run(run: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run, dest)
    return dest


def rewrite(run: Path, change: Any) -> None:
    """Apply ``change(trajectory)`` to every recorded trajectory (arrays made writable) and save."""
    from rollout_service.recording import batch_files, read_recording

    directory = run / "recordings" / SERVER
    for n, path in batch_files(directory):
        ((_, trajectories),) = read_recording(path)
        for t in trajectories:
            for name in (
                "prompt_ids",
                "response_ids",
                "response_mask",
                "rollout_logprobs",
                "versions",
            ):
                setattr(t, name, np.array(getattr(t, name)))
            change(t)
        write_batch(directory, n, trajectories)


# -- inspect -------------------------------------------------------------------------------------------


def test_recording_holds_multi_turn_tool_and_code_episodes(run_dir: Path) -> None:
    by_id = {t.trajectory_id: t for t in recorded(run_dir)}
    assert sorted(by_id) == sorted(TRAJECTORIES)
    assert by_id["e0-i0-0"].num_turns == 2 and by_id["e0-i0-0"].reward == 1.0
    assert by_id["e0-i1-0"].reward == 0.0 and by_id["e0-i0-1"].termination == "answered"
    code = by_id["e0-i2-0"]
    runs = np.flatnonzero(np.diff(code.response_mask.astype(int)) == 1)
    # masked state, then model runs split by output
    assert code.response_mask[0] == 0 and len(runs) >= 2
    segments = [by_id[f"e0-i3-0-{k}"] for k in range(3)]
    assert [(t.snapshot_index, t.is_snapshot) for t in segments] == [
        (0, True),
        (1, True),
        (2, False),
    ]
    assert {t.reward for t in segments} == {1.0} and by_id["e0-i3-1-1"].reward == 0.0


def test_inspect_plain_text_marks_model_and_tool_spans_and_lists_calls(
    run_dir: Path, capsys: Any
) -> None:
    assert main(["inspect", str(run_dir), "--no-color", "--trajectory", "e0-i0-0"]) == 0
    out = capsys.readouterr().out
    assert "trajectory e0-i0-0" in out and "legend:" in out
    # the call is sampled, the reply is not
    assert "[model]<tool_call>" in out and "[/model][tool]" in out
    assert (
        "[tool]\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n[/tool]"
        in out
    )
    assert 'calculator({"expression": "2 + 3"})' in out
    assert (
        "group           e0-i0" in out
        and "reward          1" in out
        and "termination     no_tool_call" in out
    )
    assert "policy versions 0..0" in out and "[prompt]<|im_start|>system" in out


def test_inspect_filters_limits_and_reports_no_match(run_dir: Path, capsys: Any) -> None:
    assert (
        main(["inspect", str(run_dir / "recordings" / SERVER), "--group", "e0-i1", "--limit", "1"])
        == 0
    )
    out = capsys.readouterr().out  # not a terminal: plain markers
    assert out.count("\ntrajectory ") == 1 and "1 more matching trajectories not shown" in out
    assert main(["inspect", str(run_dir), "--trajectory", "nope"]) == 1
    assert "no trajectory matches" in capsys.readouterr().err


def test_inspect_html_is_self_contained_and_escaped(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    assert main(["inspect", str(run_dir), "--html", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count("<section ") == len(TRAJECTORIES) and 'class="legend"' in page
    assert '<span class="model">&lt;tool_call&gt;{&quot;name&quot;: &quot;calculator&quot;' in page
    assert '<span class="tool">' in page and "<tool_call>" not in page  # every text escaped
    assert "<script" not in page and "http" not in page.split("<body>")[0]  # nothing fetched


def test_not_a_recording_is_a_usage_error(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 2
    assert "not a recording" in capsys.readouterr().err
    bad = tmp_path / "batch-0000000001.msgpack"
    bad.write_bytes(b"not msgpack at all")
    assert main(["rerun", str(bad)]) == 2
    assert "not a msgpack batch file" in capsys.readouterr().err


# -- rerun ---------------------------------------------------------------------------------------------


def test_rerun_of_an_untouched_recording_has_no_divergence(run_dir: Path, capsys: Any) -> None:
    assert main(["rerun", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    s = report["summary"]
    assert s["episodes"] == len(SCRIPTS) and s["diverged"] == 0 and s["not_rerun"] == 0
    assert (
        s["multi_turn_episodes"] == 7
        and s["tool_calls"] == 6 + 10
        and s["trajectories"] == len(TRAJECTORIES)
    )
    assert main(["rerun", str(run_dir)]) == 0
    assert "result: no divergence" in capsys.readouterr().out


def test_rerun_does_not_wait_on_the_live_runs_rate_limits(run_dir: Path, capsys: Any) -> None:
    # A rerun once took its tokens from the run's buckets: behind a live run it waited minutes and
    # its calls failed. Here the run's calculator bucket is empty and refills once a minute.
    from common.ratelimit import Bucket, GlobalRateLimiter

    limits = [
        "tools.rate_limits.limits={calculator: {per_minute: 1, burst: 50}}",
        "tools.rate_limits.acquire_timeout_s=1",
    ]
    live = GlobalRateLimiter(run_dir / "ratelimit", {"calculator": Bucket(per_minute=1, burst=50)})
    for _ in range(50):
        live.acquire_blocking("calculator")
    assert main(["rerun", str(run_dir), *limits, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["diverged"] == 0
    # Asked to share the run's buckets, it meets the empty one: the calls fail, and it says so.
    assert main(["rerun", str(run_dir), *limits, "--json", "--shared-limits"]) == 1
    assert json.loads(capsys.readouterr().out)["summary"]["diverged"] > 0


def test_rerun_finds_a_changed_tool_output_with_its_position(
    run_dir: Path, tiny_model: Path, tmp_path: Path, capsys: Any
) -> None:
    from transformers import AutoTokenizer

    run = copy_run(run_dir, tmp_path / "run")
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    five, six = tok.convert_tokens_to_ids("5"), tok.convert_tokens_to_ids("6")
    changed: list[int] = []

    def tamper(t: Any) -> None:
        if t.trajectory_id == "e0-i0-0":
            pos = int(np.flatnonzero((t.response_mask == 0) & (t.response_ids == five))[0])
            t.response_ids[pos] = six  # the calculator "said" 6
            changed.append(pos)

    rewrite(run, tamper)
    assert main(["rerun", str(run), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["diverged"] == 1
    (ep,) = [e for e in report["recordings"][0]["episodes"] if e["status"] == "diverged"]
    (d,) = ep["divergences"]
    assert (
        ep["episode_id"] == "e0-i0-0"
        and d["field"] == "response_ids"
        and d["position"] == changed[0]
    )
    assert (
        d["recorded"].startswith("6")
        and d["rerun"].startswith("5")
        and d["before"].endswith("<tool_response>\n")
    )
    assert main(["rerun", str(run)]) == 1
    text = capsys.readouterr().out
    assert f"first difference at position {changed[0]}" in text and "1 diverged" in text


def test_rerun_finds_a_changed_reward(run_dir: Path, tmp_path: Path, capsys: Any) -> None:
    run = copy_run(run_dir, tmp_path / "run")

    def tamper(t: Any) -> None:
        if t.trajectory_id == "e0-i1-0":
            t.reward = 1.0

    rewrite(run, tamper)
    assert main(["rerun", str(run), "--json"]) == 1
    eps = json.loads(capsys.readouterr().out)["recordings"][0]["episodes"]
    (bad,) = [e for e in eps if e["status"] != "same"]
    assert [d["field"] for d in bad["divergences"]] == ["reward"] and bad["divergences"][0][
        "rerun"
    ] == 0.0


def test_rerun_reports_a_recording_shorter_than_the_episode(
    run_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """A model turn missing from the recording: the engine answers abort, the rerun ends, no hang."""
    run = copy_run(run_dir, tmp_path / "run")

    def tamper(t: Any) -> None:
        if t.trajectory_id == "e0-i0-1":  # keep only the first model turn (the calculator call)
            first_tool = int(np.flatnonzero(t.response_mask == 0)[0])
            for name in ("response_ids", "response_mask", "rollout_logprobs", "versions"):
                setattr(t, name, getattr(t, name)[: first_tool + 5])

    rewrite(run, tamper)
    assert main(["rerun", str(run), "--json"]) == 1
    eps = json.loads(capsys.readouterr().out)["recordings"][0]["episodes"]
    (bad,) = [e for e in eps if e["status"] != "same"]
    fields = {d["field"] for d in bad["divergences"]}
    assert {"response_ids", "termination", "model_turns"} <= fields


def test_rerun_does_not_guess_segments_missing_from_the_recording(
    run_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    from rollout_service.recording import batch_files, read_recording

    run = copy_run(run_dir, tmp_path / "run")
    directory = run / "recordings" / SERVER
    n, path = batch_files(directory)[-1]  # the StateLM group
    ((_, trajectories),) = read_recording(path)
    write_batch(directory, n, [t for t in trajectories if t.trajectory_id != "e0-i3-0-1"])
    assert main(["rerun", str(run), "--json"]) == 1
    eps = json.loads(capsys.readouterr().out)["recordings"][0]["episodes"]
    assert {e["episode_id"]: e["status"] for e in eps if e["status"] != "same"} == {
        "e0-i3-0": "not rerun"
    }
    assert "only segments [0, 2] of 3 were recorded" in eps[-2]["reason"]


# -- stream --------------------------------------------------------------------------------------------


def test_stream_delivers_every_recorded_trajectory_to_a_learner(run_dir: Path, capsys: Any) -> None:
    from anyio.from_thread import start_blocking_portal

    from protocol.reference import ReferenceLearner, reference_weights

    # credits force one batch at a time
    learner = ReferenceLearner(capacity=2, max_credits_per_peer=1)
    with start_blocking_portal() as portal:
        serving, address = portal.start_task(learner.serve)
        # A learner ahead of the recording sends its weights on connect: received, verified, dropped.
        portal.call(
            lambda: learner.server.publish_weights(1, reference_weights(), chunk_bytes=32 << 10)
        )
        try:
            status = main(["stream", str(run_dir), "--to", address, "--json", "--timeout", "30"])
        finally:
            serving.cancel()
    doc = json.loads(capsys.readouterr().out)
    assert status == 0 and doc["ok"], doc
    (s,) = doc["streams"]
    assert (
        s["acked"] == s["batches"] == 4
        and s["peer_id"] == "replay-rs0"
        and s["weight_versions"] == [1]
    )
    assert [t.trajectory_id for t in learner.received] == [
        t.trajectory_id for t in recorded(run_dir)
    ]


def test_stream_without_a_learner_times_out_with_the_reason(run_dir: Path, capsys: Any) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status = main(
        [
            "stream",
            str(run_dir / "recordings" / SERVER),
            "--to",
            f"tcp://127.0.0.1:{port}",
            "--timeout",
            "1.5",
        ]
    )
    out = capsys.readouterr().out
    assert status == 1 and "timed out" in out and "0/4 batches" in out
