#!/usr/bin/env python3
"""The agent loop's cost per turn on the rollout server's event loop, against the tokenizer work a
turn cannot avoid.

Design: ``--episodes`` tool-agent episodes run concurrently on one asyncio loop, as a rollout
server runs them, in groups of ``--group`` samples of one prompt. The engine is the scripted one,
answering each turn with pre-tokenised ids (a model's sampled ids cost the loop nothing to make):
two calculator calls, then an answer, each turn padded to ``--turn-tokens``. What the loop does
per turn is then the agent's own work: rendering the prompt, decoding the turn to parse it, the
tool call, rendering and tokenising the tool turn, the episode's bookkeeping. The bound is the
tokenizer work no renderer avoids, timed in the same run: one chat-template rendering per group's
prompt, one decode per turn and one encode per tool result. ``ratio`` = bound / loop, the median
of ``--repeat`` rounds, alternated (1.0: the loop costs what the tokenizer costs); also the loop's
milliseconds a turn. The last line of stdout is one JSON object. ``.venv/bin/python
bench/agent_turns.py`` (a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from rollout_service.agents import AGENTS  # noqa: E402  (after the checkout is on the path)
from rollout_service.agents.base import AgentDeps, AgentLimits  # noqa: E402
from rollout_service.agents.episode import Episode  # noqa: E402
from rollout_service.agents.parsers import HermesParser  # noqa: E402
from rollout_service.agents.rendering import ChatRenderer  # noqa: E402
from rollout_service.engine.base import Generation, SamplingSettings  # noqa: E402
from rollout_service.engine.scripted import ScriptedEngine  # noqa: E402
from rollout_service.tools.calculator import Calculator  # noqa: E402
from tools.make_tiny_model import make_tiny_model  # noqa: E402

EXPRESSIONS = {"(3 + 4) * 12": "84", "84 / 2": "42"}
"""The calls of an episode, and what the calculator answers."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/agent_turns.py", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--episodes", type=int, default=256, help="concurrent episodes a round")
    p.add_argument("--group", type=int, default=8, help="episodes per prompt")
    p.add_argument("--turn-tokens", type=int, default=128, help="tokens of a model turn, about")
    p.add_argument("--repeat", type=int, default=5, help="rounds of each side")
    p.add_argument("--model", default=None, help="tokenizer dir (default: the tiny model)")
    return p.parse_args(argv)


def turns(tok: Any, turn_tokens: int) -> list[list[int]]:
    """The three model turns of every episode, as ids ending with eos."""
    filler = " ".join(["step"] * max(0, turn_tokens - 30))
    texts = [
        *(
            f'{filler} <tool_call>{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}'
            "</tool_call>"
            for e in EXPRESSIONS
        ),
        f"{filler} The answer is \\boxed{{42}}.",
    ]
    return [[*tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in texts]


def question(i: int) -> dict[str, str]:
    return {
        "question": f"Problem {i}: what is (3 + 4) * 12 / 2? Use the calculator.",
        "answer": "42",
    }


async def agent_round(renderer: ChatRenderer, script: list[list[int]], args: Any) -> float:
    engine = ScriptedEngine(renderer.tok, [])
    engine.record = False
    engine.per_request = lambda _episode: [
        Generation(list(ids), [-0.5] * len(ids), [0] * len(ids), "stop") for ids in script
    ]
    calculator = Calculator()
    deps = AgentDeps(
        engine=engine,
        renderer=ChatRenderer(renderer.tok),  # a fresh one: nothing cached from the last round
        sampling=SamplingSettings(max_tokens=4 * args.turn_tokens),
        limits=AgentLimits(response_length=16 * args.turn_tokens, max_model_len=32768),
        tools={calculator.name: calculator},
        parser=HermesParser(),
    )
    agent = AGENTS.get("tool_agent")(deps)
    episodes = [
        Episode(f"e{i}", f"g{i // args.group}", question(i // args.group), agent_type="tool_agent")
        for i in range(args.episodes)
    ]
    start = time.perf_counter()
    await asyncio.gather(*(agent.run(e) for e in episodes))
    seconds = time.perf_counter() - start
    if any(e.turns != 3 for e in episodes):
        raise RuntimeError(f"episodes ended after {sorted({e.turns for e in episodes})} turns")
    return seconds


def bound_round(renderer: ChatRenderer, script: list[list[int]], args: Any) -> float:
    """The tokenizer work of the same episodes, without the agent around it."""
    tok, schema = renderer.tok, [Calculator().schema]
    start = time.perf_counter()
    for g in range(args.episodes // args.group):
        messages = [{"role": "user", "content": question(g)["question"]}]
        tok.apply_chat_template(messages, tools=schema, tokenize=True, add_generation_prompt=True)
    for _ in range(args.episodes):
        for ids in script:
            tok.decode(ids[:-1], skip_special_tokens=False)
        for answer in EXPRESSIONS.values():
            tok.encode(answer, add_special_tokens=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer  # lazy: keeps --help instant

    with tempfile.TemporaryDirectory(prefix="bench-agent-turns-") as tmp:
        model = Path(args.model) if args.model else make_tiny_model(Path(tmp) / "model")
        tok = AutoTokenizer.from_pretrained(str(model))
    renderer = ChatRenderer(tok)
    script = turns(tok, args.turn_tokens)
    asyncio.run(agent_round(renderer, script, args))  # warm-up of both sides
    bound_round(renderer, script, args)
    loop_s, bound_s = [], []
    for _ in range(args.repeat):
        loop_s.append(asyncio.run(agent_round(renderer, script, args)))
        bound_s.append(bound_round(renderer, script, args))
    n_turns = 3 * args.episodes
    ratios = [b / a for a, b in zip(loop_s, bound_s, strict=True)]
    result = {
        "bench": "agent_turns",
        "config": vars(args),
        "turns": n_turns,
        "loop_ms_per_turn": [round(s / n_turns * 1e3, 4) for s in loop_s],
        "bound_ms_per_turn": [round(s / n_turns * 1e3, 4) for s in bound_s],
        "ratio": round(statistics.median(ratios), 4),
        "ratios": [round(r, 4) for r in ratios],
    }
    print(
        f"agent loop {statistics.median(loop_s) / n_turns * 1e3:.3f} ms a turn against the "
        f"tokenizer's {statistics.median(bound_s) / n_turns * 1e3:.3f} ms: ratio {result['ratio']}"
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
