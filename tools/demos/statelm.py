"""Warm-up demonstrations of the StateLM agent (``bin/warmup --agent statelm``).

Design: a demonstration is not re-derived from the agent's rendering rules, it is *played*: the
real ``StateLMAgent`` runs the episode with the config's tools and limits (configs/demo_statelm.yaml,
or ``$STATELM_DEMO_CONFIG``) against a scripted engine that answers each turn with the text of the
right action. So the prompt, the tool responses (msg ids, JSON, notes listing, deletion stubs) and
every re-rendered segment prompt are the agent's own, token for token, and a turn that would not
fit the config's budget fails here instead of teaching something a rollout cannot do. Each segment
of the episode (every deletion closes one) is one ``Demonstration``: its prompt, then its response
with the loss on the model's tokens (mask 1) only.

The right episode of a tools.demos.statelm_data row: for each chunk, readChunk; on the chunk with
the fact, note(key=NOTE_KEY, summary=code, content=code); then deleteContext of that chunk's
message (its msg_id is in the tool response); the last chunk holds the question; readNote(
NOTE_KEY) brings the code back (after the deletions it is only in external memory) and finish(code)
answers. With ``guess_fraction`` f, an episode's seeded draw below f notes a wrong code instead (and
so answers it): the warmed model copies the fact into its note only some of the time, a choice
that RL learns from the reward, which reaches the note only through the snapshot trajectory the
deletion closed. Every episode takes the same actions otherwise: a choice between actions (note or
not) at the tool name's first token left a 2-layer model writing blends of both names
("deleteteeCont", "noteteCont") at temperature 1 after 300 warm-up steps.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import load_config
from rollout_service.agents.base import AgentDeps
from rollout_service.agents.episode import Episode
from rollout_service.agents.parsers import PARSERS, hermes_call_text
from rollout_service.agents.statelm import StateLMAgent
from rollout_service.engine.base import Generation, SamplingSettings
from rollout_service.server import agent_limits, sampling_settings
from rollout_service.tools.factory import build_local_tools
from tools.demos import Demonstration
from tools.demos.statelm_data import CODES

if TYPE_CHECKING:
    from rollout_service.agents.rendering import ChatRenderer

NOTE_KEY = "code"  # one key for every row: the note's only varying token is the digit
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_statelm.yaml"


def config_path() -> Path:
    return Path(os.environ.get("STATELM_DEMO_CONFIG") or CONFIG)


class ScriptedEngine:
    """Answers each turn with ``next_text(ep)`` encoded as the model would emit it (+ eos)."""

    policy_version = 0

    def __init__(self, renderer: ChatRenderer, next_text: Callable[[], str]) -> None:
        self.renderer, self.next_text = renderer, next_text

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:

        text = self.next_text()
        ids = [*self.renderer.text_ids(text), self.renderer.eos_id]
        if len(ids) > sampling.max_tokens:
            raise ValueError(
                f"the demonstrated turn {text!r} takes {len(ids)} tokens, the config's budget "
                f"allows {sampling.max_tokens} here: raise max_tokens_per_turn or the response length"
            )
        return Generation(ids, [0.0] * len(ids), [0] * len(ids), "stop")

    async def abort(self, request_ids: Sequence[str]) -> None:
        return None


def episode_actions(
    row: dict[str, Any], ep: Episode, *, chunk_chars: int, guess: str | None, delete: bool = True
) -> Callable[[], str]:
    """The right actions for ``row`` as a function returning the next turn's text; msg ids are read
    from the episode's live context, as the model reads them from the tool responses. ``delete``
    False: an episode that keeps every chunk it read (the budget should end it)."""

    n = -(-len(row["documents"][0]["text"]) // chunk_chars)

    noted = str(row["answer"]) if guess is None else guess

    def plan() -> Iterator[str]:
        for k in range(n):
            yield hermes_call_text("readChunk", {"doc_id": 0, "chunk": k})
            read = StateLMAgent.context(ep).history[-1]  # the readChunk response
            if k == int(row["fact_chunk"]):
                yield hermes_call_text(
                    "note", {"key": NOTE_KEY, "summary": noted, "content": noted}
                )
            if k < n - 1 and delete:
                yield hermes_call_text("deleteContext", {"msg_id": read.msg_id})
        # the note's content comes back as the last thing before the answer, as the fact ends its
        # chunk before the note: the same fixed-distance copy writes both (from the notes listing
        # at the prompt's top, 500 warm-up steps did not teach the tiny model to copy)
        yield hermes_call_text("readNote", {"key": NOTE_KEY})
        yield hermes_call_text("finish", {"answer": noted})

    turns = plan()
    return lambda: next(turns)


def play_episode(
    row: dict[str, Any],
    renderer: ChatRenderer,
    config: Any,
    *,
    guess: str | None = None,
    delete: bool = True,
    episode_id: str = "warmup",
) -> Episode:
    """Run the real StateLM agent on ``row`` with the scripted right actions (or the guess); an
    episode that does not end answered with them is refused, unless ``delete`` is False (no
    deletions: returned however it ended)."""
    import anyio

    ep = Episode(episode_id, f"{episode_id}-group", row, agent_type="statelm")
    deps = AgentDeps(
        engine=ScriptedEngine(
            renderer,
            episode_actions(
                row, ep, chunk_chars=config.agents.statelm.chunk_chars, guess=guess, delete=delete
            ),
        ),
        renderer=renderer,
        sampling=sampling_settings(config),
        limits=agent_limits(config),
        tools=build_local_tools(config, config.agents.statelm.tools, key="agents.statelm.tools"),
        parser=PARSERS.get(config.actor_rollout_ref.rollout.multi_turn.format)(),
        options=config.agents.statelm,
    )
    anyio.run(StateLMAgent(deps).run, ep)
    want = str(row["answer"]) if guess is None else str(guess)
    if delete and (ep.termination != "answered" or ep.final_answer != want):
        raise ValueError(
            f"{episode_id}: the demonstrated episode ended {ep.termination!r} with answer "
            f"{ep.final_answer!r} (expected answered, {want!r}): the config's budget does not fit it"
        )
    return ep


def segment_demonstrations(ep: Episode, row: dict[str, Any]) -> list[Demonstration]:
    """One Demonstration per segment: prompt + response, the loss on mask-1 tokens."""
    demos = []
    for seg in ep.all_segments():
        ids = [*seg.prompt_ids, *seg.response_ids]
        train = [False] * len(ids)
        for i, m in enumerate(seg.mask):
            if m:
                train[len(seg.prompt_ids) + i - 1] = True
        demos.append(Demonstration(ids, train, NOTE_KEY, str(row["answer"])))
    return demos


def load_demo_config(path: Path | None = None) -> Any:

    return load_config(path or config_path(), check_paths=False)


def build_demonstrations(
    rows: list[dict[str, Any]],
    renderer: ChatRenderer,
    tools: dict[str, Any],
    *,
    guess_fraction: float = 0.0,
    seed: int = 0,
) -> list[Demonstration]:
    """The segments of one played episode per row (see the module's docstring). ``tools`` must be
    the config's StateLM tools in its order (the prompt shows their schemas); the tool objects
    themselves are built from the config (readChunk needs its chunk_chars)."""
    config = load_demo_config()
    names = list(config.agents.statelm.tools)
    if list(tools) != names:
        raise ValueError(
            f"bin/warmup --tools {','.join(tools)}: the StateLM demo's prompt shows the tools of "
            f"{config_path()} (agents.statelm.tools): pass --tools {','.join(names)}"
        )
    rng = random.Random(seed)
    demos: list[Demonstration] = []
    for i, row in enumerate(rows):
        guess = None
        if rng.random() < guess_fraction:
            guess = rng.choice([c for c in CODES if c != str(row["answer"])])
        ep = play_episode(row, renderer, config, guess=guess, episode_id=f"warmup-{i}")
        demos += segment_demonstrations(ep, row)
    return demos
