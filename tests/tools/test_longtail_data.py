"""The long-tail set of tools/make_tiny_data.py (bench/e2e.py's default workload): deterministic for
a seed, heavy-tailed (p99 / median >= 8 of the turns and of the tokens of its right episodes), its
demonstrations right (the real calculator checks every call), and the tool agent plays a right
episode to its end under configs/longtail_e2e.yaml's limits, scored 1 by the math reward."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from tools.make_tiny_data import (
    LONGTAIL_WARMUP,
    LongTailSpec,
    longtail_episode,
    make_longtail_data,
    make_longtail_rows,
)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "rollout"))  # the scripted engine

from scripted import ScriptedEngine  # noqa: E402


def p99_over_median(values: list[float]) -> float:
    v = sorted(values)
    return v[math.ceil(0.99 * len(v)) - 1] / statistics.median(v)


def renderer_and_calculator(model: Path) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoTokenizer

    from rollout_service.agents.rendering import ChatRenderer
    from rollout_service.tools import load_builtin_tools

    return ChatRenderer(AutoTokenizer.from_pretrained(str(model))), {
        "calculator": load_builtin_tools().get("calculator")()
    }


def test_rows_are_deterministic_for_a_seed(tmp_path: Path) -> None:
    assert make_longtail_rows(300, 3) == make_longtail_rows(300, 3)
    assert make_longtail_rows(300, 3) != make_longtail_rows(300, 4)
    a, b = make_longtail_data(tmp_path / "a"), make_longtail_data(tmp_path / "b")
    for name in ("train.jsonl", "val.jsonl", "warmup.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    warm = [json.loads(line)["steps"] for line in (a / "warmup.jsonl").read_text().splitlines()]
    assert (
        statistics.median(warm) == LONGTAIL_WARMUP.steps_median and sum(s >= 13 for s in warm) > 25
    )


def test_budgets_follow_the_documented_heavy_tail() -> None:
    spec = LongTailSpec()
    rows = make_longtail_rows(4000, 0)
    steps = [r["steps"] for r in rows]
    assert (
        min(steps) == 1
        and max(steps) == spec.steps_max
        and statistics.median(steps) == spec.steps_median
    )
    turns = [s + 1 for s in steps]
    assert p99_over_median(turns) >= 8
    chars = [
        sum(len(text) + sum(map(len, tools)) for text, tools in longtail_episode(r)) for r in rows
    ]
    assert p99_over_median(chars) >= 8
    assert {r["step"][0] for r in rows} == {"+", "-"} and {r["data_source"] for r in rows} == {
        "longtail"
    }


def test_episodes_reach_the_answer() -> None:
    for row in make_longtail_rows(50, 1):
        turns = longtail_episode(row)
        assert len(turns) == row["steps"] + 1 and turns[-1] == (
            f"The answer is \\boxed{{{row['answer']}}}.",
            [],
        )
        numbers = [row["number"], *(int(t[1][0]) for t in turns[:-1])]
        # the steps left, packed
        assert [n % 100 for n in numbers] == list(range(row["steps"], -1, -1))
        # one call on the last number
        for (text, tools), n in zip(turns[:-1], numbers, strict=False):
            assert (
                text.count("<tool_call>") == 1
                and f'"expression": "{n} {row["step"]}"' in text
                and len(tools) == 1
            )
        assert str(numbers[-1]) == row["answer"] and int(row["answer"]) >= 1000


def test_demonstrations_are_right_and_heavy_tailed_in_tokens(tiny_model: Path) -> None:
    """The rows bench/e2e.py trains on (256, seed 0), tokenised as the tool agent's context grows:
    response tokens (model + tool) and model tokens have p99 / median >= 8. The warm-up's
    demonstrations of some of them (every call run by the real calculator) hold the same tokens."""
    from tools.demos.calculator import build_demonstrations

    renderer, tools = renderer_and_calculator(tiny_model)
    rows = make_longtail_rows(256, 0)
    response, model = [], []
    for row in rows:
        turns = [
            (
                len(renderer.text_ids(text)) + 1,  # + the end of turn
                len(renderer.tool_delta_ids([{"role": "tool", "content": x} for x in out]))
                if out
                else 0,
            )
            for text, out in longtail_episode(row)
        ]
        model.append(sum(m for m, _ in turns))
        response.append(sum(m + t for m, t in turns))
    assert p99_over_median(response) >= 8 and p99_over_median(model) >= 8
    assert max(response) < 1792  # configs/longtail_e2e.yaml's data.max_response_length
    short = [i for i, row in enumerate(rows) if row["steps"] <= 4][:6]
    # raises if the calculator disagrees
    demos = build_demonstrations([rows[i] for i in short], renderer, tools)
    schema = [tools["calculator"].schema]
    for i, d in zip(short, demos, strict=True):
        prompt = len(
            renderer.prompt_ids([{"role": "user", "content": rows[i]["question"]}], schema)
        )
        assert len(d.ids) - prompt == response[i] and sum(d.train) == model[i]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_tool_agent_plays_a_long_episode_to_the_end(tiny_model: Path) -> None:
    """A right 12-step episode, scripted, through the real tool agent with the bench config's limits
    (one call a turn, 33 turns, 64 tokens a turn), the real calculator and the math reward."""
    import rollout_service.agents.tool_agent  # noqa: F401  (registers the agents)
    from common.config.loader import load_config
    from rollout_service.agents.base import AGENTS, AgentDeps
    from rollout_service.agents.episode import Episode
    from rollout_service.agents.parsers import HermesParser
    from rollout_service.engine.base import SamplingSettings
    from rollout_service.groups import RewardChoice, score
    from rollout_service.rewards import load_builtin_rewards
    from rollout_service.server import agent_limits

    load_builtin_rewards()
    config = load_config(REPO / "configs" / "longtail_e2e.yaml", check_paths=False)
    renderer, tools = renderer_and_calculator(tiny_model)
    row = next(r for r in make_longtail_rows(400, 0) if r["steps"] == 12)
    script = [text for text, _ in longtail_episode(row)]
    deps = AgentDeps(
        engine=ScriptedEngine(renderer.tok, script),
        renderer=renderer,
        sampling=SamplingSettings(max_tokens=1),
        limits=agent_limits(config),
        tools=tools,
        parser=HermesParser(),
    )
    ep = Episode("e1", "g1", row, data_source="longtail", agent_type="tool_agent")
    await AGENTS.get("tool_agent")(deps).run(ep)
    assert (
        ep.termination == "no_tool_call"
        and ep.turns == 13
        and ep.tool_calls == 12
        and ep.tool_errors == 0
    )
    model_text = renderer.decode([t for t, m in zip(ep.response_ids, ep.mask, strict=True) if m])
    assert model_text == "<|im_end|>".join(script) + "<|im_end|>"
    tool_text = renderer.decode([t for t, m in zip(ep.response_ids, ep.mask, strict=True) if not m])
    assert tool_text.count("<tool_response>") == 12
    assert (await score(ep, renderer, RewardChoice("math"))).score == 1.0


def test_bucketed_warmup_batches_and_trimmed_loss(tiny_model: Path) -> None:
    """tools/warmup.py --bucket: each epoch's batches hold rows of similar lengths (every row once,
    a short last batch dropped), seeded; a batch run only up to its longest row has the loss of the
    full-width batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from tools.demos.calculator import build_demonstrations
    from tools.warmup_batches import bucketed_epoch, demo_loss, pack

    renderer, tools = renderer_and_calculator(tiny_model)
    demos = build_demonstrations(make_longtail_rows(21, 0), renderer, tools)
    full, trimmed = pack(demos, renderer.eos_id), pack(demos, renderer.eos_id, trim=True)
    epoch = bucketed_epoch(trimmed, 4, torch.Generator().manual_seed(0))
    assert len(epoch) == 20 and len(set(epoch)) == 20
    assert epoch == bucketed_epoch(trimmed, 4, torch.Generator().manual_seed(0))
    lengths = [len(d.ids) for d in demos]
    spans = sorted(
        (
            min(lengths[i] // 32 for i in epoch[k : k + 4]),
            max(lengths[i] // 32 for i in epoch[k : k + 4]),
        )
        for k in range(0, 20, 4)
    )
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # batches cut the length order
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    # the shortest: trimming cuts most
    rows = sorted(range(len(demos)), key=lambda i: lengths[i])[:4]
    assert trimmed.end(rows) == max(lengths[i] for i in rows) < full.end(rows)
    with torch.no_grad():
        assert (
            abs(float(demo_loss(model, trimmed, rows)) - float(demo_loss(model, full, rows))) < 1e-4
        )
