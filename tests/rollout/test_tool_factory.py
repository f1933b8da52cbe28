"""Building tool sets from the config: options from `tools.*`, local and remote tools giving the
same results for the same calls, and start-up errors that name the key to change."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_tool_server import tool_server  # type: ignore[import-not-found]

from common.config import Config, load_config
from rollout_service.tools import ToolContext
from rollout_service.tools.factory import TOOL_OPTIONS, build_local_tools, build_tools, close_tools
from rollout_service.tools.python_exec import PythonTool
from rollout_service.tools.remote import RemoteTool
from rollout_service.tools.search import SearchTool

CTX = ToolContext(episode_id="ep-factory")
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("python", {"code": "print(2 ** 10)"}),
    ("python", {"code": "raise SystemExit(3)"}),
    ("python", {"source": "print(1)"}),
    ("search", {"query": "lava volcano"}),
    ("search", {"query": "zygomorphic"}),
    ("search", {"query": " "}),
    ("calculator", {"expression": "sqrt(16) * 2"}),
    ("calculator", {"expression": "1 / 0"}),
]


def make_config(tmp: Path, *overrides: str) -> Config:
    corpus = tmp / "corpus.jsonl"
    if not corpus.exists():
        corpus.write_text(
            json.dumps({"title": "Mount Erebus", "text": "An active volcano with a lava lake."})
            + "\n"
            + json.dumps({"title": "Tea", "text": "An aromatic beverage from Camellia leaves."})
            + "\n"
        )
    return load_config(
        None,
        [
            "actor_rollout_ref.model.path=m",
            "data.train_files=t.jsonl",
            f"tools.search.corpus={corpus}",
            "tools.python.timeout_s=5",
            "tools.python.max_output_chars=300",
            *overrides,
        ],
        check_paths=False,
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A tool server (python, search, calculator) and the directory of its corpus."""
    tmp = tmp_path_factory.mktemp("factory")
    with tool_server(tmp, timeout_s=5, max_output_chars=300) as (_, url, _):
        yield url, tmp


def test_local_tools_get_their_options_from_the_config(tmp_path: Path) -> None:
    config = make_config(tmp_path, "tools.search.top_k=2")
    tools = build_local_tools(config, ["python", "search", "calculator", "python"])
    assert list(tools) == ["python", "search", "calculator"]
    python, search = tools["python"], tools["search"]
    assert (
        isinstance(python, PythonTool)
        and python.limits.timeout_s == 5
        and python.max_output_chars == 300
    )
    assert isinstance(search, SearchTool) and search.top_k == 2
    assert set(TOOL_OPTIONS) >= {"python", "search"}


@pytest.mark.anyio
@pytest.mark.integration
async def test_remote_and_local_tools_are_interchangeable(served: tuple[str, Path]) -> None:
    url, tmp = served
    names = ["python", "search", "calculator", "finish"]
    local = build_tools(make_config(tmp), names)
    remote = build_tools(
        make_config(tmp, f"tools.remote.url={url}", "tools.remote.names=[python,search]"), names
    )
    # names empty: all served
    everything = build_tools(make_config(tmp, f"tools.remote.url={url}"), names)
    try:
        assert not any(isinstance(t, RemoteTool) for t in local.values())
        assert [n for n, t in remote.items() if isinstance(t, RemoteTool)] == ["python", "search"]
        assert [n for n, t in everything.items() if isinstance(t, RemoteTool)] == [
            "python",
            "search",
            "calculator",
        ]
        assert remote["python"].client is remote["search"].client  # type: ignore[attr-defined]  # one client
        for tools in (remote, everything):
            assert list(tools) == names
            for name in names:
                assert tools[name].schema == local[name].schema
            for name, args in CALLS:
                here, there = await local[name].call(args, CTX), await tools[name].call(args, CTX)
                assert (here.text, here.ok, here.terminal, here.answer) == (
                    there.text,
                    there.ok,
                    there.terminal,
                    there.answer,
                ), (name, args)
                assert here.metrics.keys() == there.metrics.keys()
    finally:
        await close_tools(remote)
        await close_tools(everything)
        await close_tools(local)  # nothing remote: a no-op


def test_unknown_tool_names_the_key_and_the_known_tools(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"actor_rollout_ref\.rollout\.multi_turn\.tools: unknown tool\(s\) 'serch'; known: .*search",
    ) as info:
        build_tools(make_config(tmp_path), ["python", "serch"])
    assert "calculator" in str(info.value)
    with pytest.raises(ValueError, match=r"tool_server\.tools: unknown tool\(s\) 'nope'"):
        build_local_tools(make_config(tmp_path), ["nope"], key="tool_server.tools")


def test_search_without_corpus_names_the_key(tmp_path: Path) -> None:
    config = make_config(tmp_path, "tools.search.corpus=null")
    with pytest.raises(ValueError, match=r"tools\.search\.corpus: required"):
        build_tools(config, ["search"])
    assert list(build_tools(config, ["calculator"])) == ["calculator"]  # only when search is used


@pytest.mark.integration
def test_remote_errors_name_the_key(tmp_path: Path, served: tuple[str, Path]) -> None:
    url, _ = served
    with pytest.raises(
        ValueError, match=r"tools\.remote\.names: 'statelm' not served by the tool server"
    ):
        build_tools(
            make_config(tmp_path, f"tools.remote.url={url}", "tools.remote.names=[statelm]"),
            ["statelm"],
        )
    dead = "http://127.0.0.1:9"  # discard port: nothing answers
    with pytest.raises(ValueError, match=rf"tools\.remote\.url: tool server {dead} unreachable"):
        build_tools(make_config(tmp_path, f"tools.remote.url={dead}"), ["python"])
    # Remote names that this tool set does not use: the server is not even asked.
    local = build_tools(
        make_config(tmp_path, f"tools.remote.url={dead}", "tools.remote.names=[search]"),
        ["calculator"],
    )
    assert list(local) == ["calculator"]


def test_a_source_can_name_its_own_tools(tmp_path: Path) -> None:
    """``data.datasets[].tools``: that source's rows run their agent with those tools (and only
    their schemas in the prompt); other sources keep the agent's; unknown names are refused with
    the dataset's key."""
    from typing import cast

    from rollout_service.agents.base import AgentDeps, deps_for
    from rollout_service.errors import StartupError
    from rollout_service.server import build_agent_deps, check_names

    config_file = tmp_path / "mixed.yaml"
    config_file.write_text(
        "actor_rollout_ref:\n  model: {path: m}\n"
        "  rollout:\n    multi_turn: {tools: [calculator, search, finish]}\n"
        "data:\n  datasets:\n"
        "    - {name: arithmetic, path: a.jsonl, ratio: 0.5, agent_type: tool_agent,"
        " tools: [calculator, finish]}\n"
        "    - {name: qa, path: q.jsonl, ratio: 0.5, agent_type: tool_agent}\n"
        f"tools:\n  search: {{corpus: {make_config(tmp_path).tools.search.corpus}}}\n"
    )
    config = load_config(config_file, [], check_paths=False)
    base = AgentDeps(*cast(Any, (None, None, None, None)))
    deps = build_agent_deps(config, base, {"tool_agent", "code"}, None)
    assert list(deps_for(deps, "tool_agent", "arithmetic").tools) == ["calculator", "finish"]
    assert list(deps_for(deps, "tool_agent", "qa").tools) == ["calculator", "search", "finish"]
    assert list(deps_for(deps, "code", "arithmetic").tools) == ["python"]  # a row's own agent
    # one build: the per-source set shares the agent's tool objects
    assert (
        deps_for(deps, "tool_agent", "arithmetic").tools["calculator"]
        is deps["tool_agent"].tools["calculator"]
    )
    check_names(config, {"tool_agent"})
    bad = load_config(config_file, ["data.datasets.0.tools=[calculater]"], check_paths=False)
    with pytest.raises(StartupError, match=r"data\.datasets\.0\.tools: unknown tool 'calculater'"):
        check_names(bad, {"tool_agent"})
    # a source of the code agent that leaves out its python: refused at start-up, not per episode
    no_python = load_config(
        config_file,
        ["data.datasets.1.agent_type=code", "data.datasets.1.tools=[search]"],
        check_paths=False,
    )
    with pytest.raises(
        StartupError, match=r"data\.datasets\.1\.tools: the code agent cannot run without 'python'"
    ):
        check_names(no_python, {"tool_agent", "code"})
