"""Warm-up demonstrations of the code agent (``bin/warmup --agent code``): run code, copy results.

Design: one episode per row of tools/demos/code_data, tokenised exactly as
``rollout_service.agents.code_agent.CodeAgent`` grows its context:
- the prompt: the agent's system prompt (its tags filled in) and the question, rendered without
  tool schemas (the code agent shows none);
- model piece 1: ``<code>\\nprint(EXPR)\\n</code>`` with no end token (generation stops on the
  closing tag, a stop string, and the turn goes on);
- context (mask 0): the sandbox's real output (the ``python`` tool is called) wrapped as the agent
  wraps it, ``\\n<execution_results>\\nOUT\\n</execution_results>\\n``, encoded as plain text
  (``renderer.text_ids``);
- model piece 2: ``<answer>OUT</answer>`` and the end token: the agent ends the episode as
  ``answered`` and the math reward compares OUT with the row's answer.
The tags are the configured ones: ``options`` (an ``agents.code`` section), else the section of the
config file named by the ``WARMUP_CONFIG`` environment variable (tools/demos/code.sh sets it;
``WARMUP_OVERRIDES`` adds ``key=value`` overrides), else the defaults. A model that never saw the
run's tags writes nothing the agent parses, as an untrained model does: every episode ends
``no_tool_call`` with no answer, and the code reward says "no code found in the response". With
``guess_fraction`` f, a row whose seeded draw falls below f is instead an episode that answers a
wrong number without running code.
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

from common.config.agents import CodeAgentConfig
from common.config.loader import load_config
from rollout_service.agents.code_agent import SYSTEM_PROMPT
from rollout_service.tools.base import ToolContext
from tools.demos import Demonstration

if TYPE_CHECKING:
    from common.config import Config
    from rollout_service.agents.rendering import ChatRenderer

CONFIG_ENV = "WARMUP_CONFIG"
OVERRIDES_ENV = "WARMUP_OVERRIDES"


def warmup_config(default: str | None = None) -> Config | None:
    """The run's config for a warm-up: the file named by $WARMUP_CONFIG (else ``default``; neither:
    None) with the overrides of $WARMUP_OVERRIDES (``key=value`` words, shell-quoted), unchecked."""
    import shlex

    path = os.environ.get(CONFIG_ENV) or default
    if not path:
        return None
    return load_config(path, shlex.split(os.environ.get(OVERRIDES_ENV, "")), check_paths=False)


def agent_options(options: CodeAgentConfig | None = None) -> CodeAgentConfig:
    """``options``, else the ``agents.code`` section of the warm-up's config, else the defaults."""

    if options is not None:
        return options
    config = warmup_config()
    return config.agents.code if config is not None else CodeAgentConfig()


def system_prompt(o: CodeAgentConfig) -> str:

    return SYSTEM_PROMPT.format(
        cs=o.code_start_tag,
        ce=o.code_end_tag,
        rs=o.result_start_tag,
        re=o.result_end_tag,
        as_=o.answer_start_tag,
        ae=o.answer_end_tag,
    )


def code_text(expression: str, o: CodeAgentConfig) -> str:
    return f"{o.code_start_tag}\nprint({expression})\n{o.code_end_tag}"


def result_text(output: str, o: CodeAgentConfig) -> str:
    """What the agent appends after a code block (code_agent.CodeAgent.run: ``shown``)."""
    return f"\n{o.result_start_tag}\n{output}\n{o.result_end_tag}\n"


def answer_text(answer: str, o: CodeAgentConfig) -> str:
    return f"{o.answer_start_tag}{answer}{o.answer_end_tag}"


def run_code(python: Any, code: str, row: dict[str, Any], episode_id: str) -> Any:
    """The python tool's real result for ``code`` (a ToolResult)."""
    import anyio

    return anyio.run(python.call, {"code": code}, ToolContext(episode_id=episode_id, row=row))


def code_episode(
    i: int,
    row: dict[str, Any],
    renderer: ChatRenderer,
    python: Any,
    o: CodeAgentConfig,
    *,
    guess: int | None = None,
) -> Demonstration:
    """The episode of one row: code, its output, the answer (or, with ``guess``, only that
    number as the answer). The sandbox must print the row's answer: a demonstration is right."""
    tok = renderer.tok
    expression = str(row["expression"])
    messages = [
        {"role": "system", "content": system_prompt(o)},
        {"role": "user", "content": str(row["question"])},
    ]
    ids = renderer.prompt_ids(messages, None)
    spans: list[tuple[int, int]] = []  # (start, length) of the model's pieces

    def model(text: str, *, end: bool) -> None:
        piece = tok.encode(text, add_special_tokens=False) + ([renderer.eos_id] if end else [])
        spans.append((len(ids), len(piece)))
        ids.extend(piece)

    if guess is not None:
        model(answer_text(str(guess), o), end=True)
        answer = str(guess)
    else:
        model(code_text(expression, o), end=False)
        result = run_code(python, f"print({expression})", row, f"warmup-{i}")
        if not result.ok or result.text != str(row["answer"]).strip():
            said = row["answer"]
            raise ValueError(
                f"row {i}: print({expression}) gives {result.text!r}, the row: {said!r}"
            )
        ids.extend(renderer.text_ids(result_text(result.text, o)))
        model(answer_text(result.text, o), end=True)
        answer = result.text
    train = [False] * len(ids)
    for start, n in spans:
        train[start - 1 : start - 1 + n] = [True] * n
    return Demonstration(ids, train, expression, answer)


def wrong_number(right: int, rng: random.Random) -> int:
    return right + rng.choice([-1, 1]) * rng.randint(1, 50)


def build_demonstrations(
    rows: list[dict[str, Any]],
    renderer: ChatRenderer,
    tools: dict[str, Any],
    *,
    guess_fraction: float = 0.0,
    seed: int = 0,
    options: CodeAgentConfig | None = None,
) -> list[Demonstration]:
    """One code episode per row (module docstring); ``tools`` must hold ``python``."""
    if "python" not in tools:
        raise ValueError("the code demonstrations run the python tool: pass --tools python")
    o = agent_options(options)
    rng = random.Random(seed)
    demos = []
    for i, row in enumerate(rows):
        guess = (
            wrong_number(int(str(row["answer"])), rng) if rng.random() < guess_fraction else None
        )
        demos.append(code_episode(i, row, renderer, tools["python"], o, guess=guess))
    return demos
