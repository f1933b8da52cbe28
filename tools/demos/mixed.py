"""Warm-up demonstrations of the mixed demo (``bin/warmup --agent mixed``): three agents, one model.

Design: each row (tools/demos/mixed_data) is demonstrated by the agent of its source, tokenised
exactly as that agent grows its context in a rollout, with the tools the run uses:
- ``arithmetic``: the calculator episode of tools.warmup (call, the real result, the boxed
  number), its prompt showing the tools the source's ``data.datasets[].tools`` names (else every
  tool of ``multi_turn.tools``), as the rollout server shows them;
- ``qa``: a tool-agent episode: ``search`` with the town named in the question, the search tool's
  real passages (truncated as the tool agent truncates a response) appended as the tool turn, then
  ``finish`` with the founder's name, copied from the first passage;
- ``code``: the code agent's episode of tools.demos.code (print(EXPR) between the code tags, the
  sandbox's output, the number between the answer tags).
The tools are built in-process from the config named by ``WARMUP_CONFIG``, with the overrides of
``WARMUP_OVERRIDES`` (tools/demos/mixed.sh: the run's own file and corpus; by default
configs/demo_mixed.yaml): its corpus, top_k, passage and response limits and tags, whatever
``tools.remote`` says: a tool server serves the same tools with the same options, so the texts are
the ones the run shows. The
``tools`` argument of the builder (bin/warmup's ``--tools``) is not used. With ``guess_fraction``
f, a row whose seeded draw falls below f skips its tool and answers wrong (a wrong number, another
town's founder).
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any

from rollout_service.agents.parsers import hermes_call_text
from rollout_service.agents.tool_agent import truncate
from rollout_service.server import source_tools as per_source
from rollout_service.tools.base import ToolContext
from rollout_service.tools.factory import build_local_tools
from tools.demos import Demonstration
from tools.demos.calculator import build_demonstrations as calculator_demonstrations
from tools.demos.code import code_episode, warmup_config, wrong_number

if TYPE_CHECKING:
    from common.config import Config
    from rollout_service.agents.rendering import ChatRenderer

DEFAULT_CONFIG = "configs/demo_mixed.yaml"
_TOWN = re.compile(r"Who founded (.+?)\?")


def town_of(question: str) -> str:
    """The town a make_agent_data question asks about: "Who founded Arbor? ..." -> "Arbor"."""
    m = _TOWN.search(question)
    if m is None:
        raise ValueError(f"no 'Who founded ...?' in question {question!r}")
    return m.group(1).strip()


def load() -> Config:

    config = warmup_config(DEFAULT_CONFIG)
    assert config is not None  # a default was given
    return config


def source_tools(config: Config, source: str) -> list[str]:
    """The tools the tool agent offers on ``source``'s rows, as the rollout server picks them:
    its ``data.datasets[].tools``, else ``multi_turn.tools``."""

    default = config.actor_rollout_ref.rollout.multi_turn.tools
    return list(per_source(config).get(("tool_agent", source), default))


def local_tools(config: Config) -> dict[str, Any]:
    """Every tool of the tool agent's sources (in config order) and python, built in-process."""

    names = [*config.actor_rollout_ref.rollout.multi_turn.tools]
    for tools in per_source(config).values():
        names += tools
    return build_local_tools(config, list(dict.fromkeys([*names, "python"])))


def _call(tool: Any, args: dict[str, Any], row: dict[str, Any], episode_id: str) -> Any:
    import anyio

    return anyio.run(tool.call, args, ToolContext(episode_id=episode_id, row=row))


def qa_episode(
    i: int,
    row: dict[str, Any],
    renderer: ChatRenderer,
    tools: dict[str, Any],
    schemas: list[dict[str, Any]],
    config: Config,
    *,
    guess: str | None = None,
) -> Demonstration:
    """search(town) -> its passages -> finish(founder), or with ``guess`` only finish(guess).
    The first passage must name the row's answer: a demonstration is right."""

    tok, mt = renderer.tok, config.actor_rollout_ref.rollout.multi_turn
    town = town_of(str(row["question"]))
    ids = renderer.prompt_ids([{"role": "user", "content": str(row["question"])}], schemas)
    spans: list[tuple[int, int]] = []

    def model(name: str, args: dict[str, Any]) -> None:
        piece = [
            *tok.encode(hermes_call_text(name, args), add_special_tokens=False),
            renderer.eos_id,
        ]
        spans.append((len(ids), len(piece)))
        ids.extend(piece)

    if guess is None:
        model("search", {"query": town})
        found = _call(tools["search"], {"query": town}, row, f"warmup-{i}")
        shown = truncate(found.text, mt.max_tool_response_length, mt.tool_response_truncate_side)
        first = shown.split("\n\n")[0]
        if not found.ok or str(row["answer"]) not in first:
            raise ValueError(
                f"row {i}: search({town!r}) does not show {row['answer']!r} first: {shown!r}"
            )
        ids.extend(renderer.tool_delta_ids([{"role": "tool", "content": shown}]))
    answer = str(row["answer"]) if guess is None else guess
    model("finish", {"answer": answer})
    train = [False] * len(ids)
    for start, n in spans:
        train[start - 1 : start - 1 + n] = [True] * n
    return Demonstration(ids, train, town, answer)


def build_demonstrations(
    rows: list[dict[str, Any]],
    renderer: ChatRenderer,
    tools: dict[str, Any],
    *,
    guess_fraction: float = 0.0,
    seed: int = 0,
    config: Config | None = None,
) -> list[Demonstration]:
    """One episode per row by its source's agent (module docstring)."""

    del tools  # built from the config: see the module docstring
    config = config if config is not None else load()
    built = local_tools(config)
    agent_tools = {
        src: {n: built[n] for n in source_tools(config, src)} for src in ("arithmetic", "qa")
    }
    founders = sorted({str(r["answer"]) for r in rows if r.get("data_source") == "qa"})
    rng = random.Random(seed)
    demos = []
    for i, row in enumerate(rows):
        source = row.get("data_source")
        skip = rng.random() < guess_fraction
        if source == "arithmetic":
            demos += calculator_demonstrations(
                [row],
                renderer,
                agent_tools["arithmetic"],
                guess_fraction=float(skip),
                seed=rng.randrange(2**31),
            )
        elif source == "qa":
            others = [f for f in founders if f != str(row["answer"])] or ["Nobody Known"]
            guess = rng.choice(others) if skip else None
            qa_tools = agent_tools["qa"]
            schemas = [t.schema for t in qa_tools.values()]
            demos.append(qa_episode(i, row, renderer, qa_tools, schemas, config, guess=guess))
        elif source == "code":
            guess_n = wrong_number(int(str(row["answer"])), rng) if skip else None
            demos.append(
                code_episode(i, row, renderer, built["python"], config.agents.code, guess=guess_n)
            )
        else:
            raise ValueError(f"row {i}: data_source {source!r} is not arithmetic, qa or code")
    return demos
