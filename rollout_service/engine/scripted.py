"""A scripted engine: the turns are given, not sampled; tokenising is real.

Design: the same ``Engine`` protocol as vLLM (``base.py``), so the rollout server, the agent loops
and the launcher run unchanged where the model's samples are not what is under test: launcher
signals, Ray placement, data formats, agent configs (``rollout_server.engine: scripted``). It
starts in the time it takes to load a tokenizer, has no child process, and takes weights as chunks
or as the learner's safetensors file (read and recorded, never applied: there is no model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from rollout_service.engine.base import Generation, SamplingSettings, UpdateMode, WeightUpdateError

if TYPE_CHECKING:
    from common.config import ActorRolloutRefConfig
    from protocol.weights import ModelManifest

DEFAULT_TURN = "The answer is \\boxed{0}."
"""What a server's scripted engine answers every turn: a final answer in the form the math reward
parses, so episodes end on their first turn whatever the agent."""


class ScriptedEngine:
    """Returns the given turns in order: each a text (tokenised, ending with eos) or a Generation.
    An ``Engine``: weight chunks and files are recorded in ``loaded``; it names no manifest (a
    subclass may)."""

    weight_manifest: ModelManifest | None = None
    last_update_timings: Mapping[str, float] = {}

    def __init__(
        self, tokenizer: Any, turns: Sequence[str | Generation], *, version: int = 0
    ) -> None:
        self.tok, self.turns, self.version = tokenizer, list(turns), version
        self.calls: list[tuple[list[int], SamplingSettings]] = []
        self.loaded: list[tuple[int, dict[str, bytes], str]] = []
        self.repeat_last = False  # keep answering with the last turn once the script is used up
        self.rotate = False  # answer the turns in rotation, one per call, forever
        self._calls_made = 0
        self.respond: Any = None  # or a function of the decoded context -> the turn's text
        self.per_request: Any = None  # or a function of the episode id -> that episode's turns
        self.load_gate: Any = None  # an anyio.Event load_weights waits for, if set
        self.delay_s = 0.0  # seconds each generate call takes
        # Seconds per sampled token, each stamped with the version loaded when it is sampled: a
        # weight update in the middle of a turn splits it, as vLLM's partial rollouts do.
        self.token_s = 0.0
        # Keep every prompt in ``calls`` and the bytes of every update in ``loaded`` (tests read
        # them); a server process keeps only each update's version and tensor names.
        self.record = True

    @classmethod
    def from_config(
        cls, actor_rollout_ref: ActorRolloutRefConfig, turns: Sequence[str] | None = None
    ) -> ScriptedEngine:
        """The engine ``rollout_server.engine: scripted`` builds: the model's tokenizer and
        ``turns`` in rotation, one per generate call (None: ``DEFAULT_TURN`` for every turn).
        Prompts and weight bytes are not kept (``record``)."""
        from transformers import AutoTokenizer

        model = actor_rollout_ref.model
        tokenizer = AutoTokenizer.from_pretrained(
            model.path, trust_remote_code=model.trust_remote_code
        )
        engine = cls(tokenizer, list(turns or [DEFAULT_TURN]))
        engine.repeat_last, engine.record = True, False
        engine.rotate = len(engine.turns) > 1
        return engine

    @property
    def policy_version(self) -> int:
        return self.version

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:
        if self.record:
            self.calls.append((list(prompt_ids), sampling))
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        # a script per episode: request ids are "<episode>-t<turn>"
        if self.per_request is not None:
            episode, turn_no = request_id.rsplit("-t", 1)
            script = self.per_request(episode)
            turn = script[int(turn_no)] if int(turn_no) < len(script) else "(script ended)"
        elif self.respond is not None:
            turn = self.respond(self.tok.decode(list(prompt_ids)))
        elif self.rotate:
            turn = self.turns[self._calls_made % len(self.turns)]
        elif self.repeat_last and len(self.turns) == 1:
            turn = self.turns[0]
        else:
            turn = self.turns.pop(0) if self.turns else "(script ended)"
        self._calls_made += 1
        if isinstance(turn, Generation):
            return turn
        # A turn ending in a stop string stops there, as vLLM does (the ids spelling it are kept,
        # no eos follows); any other turn ends with eos.
        stop_string = next((s for s in sampling.stop if turn.endswith(s)), None)
        ids = self.tok.encode(turn, add_special_tokens=False)
        if stop_string is None:
            ids.append(self.tok.eos_token_id)
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish, stop_string = ids[: sampling.max_tokens], "length", None
        if self.token_s:
            versions = []
            for _ in ids:
                await anyio.sleep(self.token_s)
                versions.append(self.version)
            return Generation(ids, [-0.5] * len(ids), versions, finish, stop_string=stop_string)
        return Generation(
            ids, [-0.5] * len(ids), [self.version] * len(ids), finish, stop_string=stop_string
        )

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass

    async def load_weights(
        self, version: int, tensors: list[tuple[str, Any]], *, mode: UpdateMode
    ) -> float:
        # a test holds the update back (a slow load)
        if self.load_gate is not None:
            await self.load_gate.wait()
        kept = {name: bytes(memoryview(a)) if self.record else b"" for name, a in tensors}
        self.loaded.append((version, kept, mode))
        self.version = version
        return 0.001

    async def load_weights_file(self, version: int, path: str, *, mode: UpdateMode) -> float:
        """Reads the learner's safetensors file (a missing or broken file fails the update, as it
        does in vLLM) and records its tensors as ``load_weights`` does."""
        from safetensors.numpy import load_file

        try:
            tensors = await anyio.to_thread.run_sync(load_file, path)
        except Exception as e:
            raise WeightUpdateError(f"cannot read weights file {path}: {e}") from e
        return await self.load_weights(version, list(tensors.items()), mode=mode)

    async def shutdown(self) -> None:
        pass
