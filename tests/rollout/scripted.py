"""Unit-test fakes for the agent loop: a scripted engine, simple tools, and a renderer on the tiny
model's real tokenizer (tokenising is real; only generation is scripted)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.weights import ModelManifest
from rollout_service.engine.base import Generation, SamplingSettings, UpdateMode, WeightUpdateError
from rollout_service.tools.base import ToolContext, ToolResult


class ScriptedEngine:
    """Returns the given turns in order: each a text (tokenised, ending with eos) or a Generation.
    An ``Engine``: weight chunks are recorded in ``loaded``; it has no file hand-over and no
    manifest (a subclass may give both)."""

    weight_manifest: ModelManifest | None = None
    last_update_timings: Mapping[str, float] = {}

    def __init__(
        self, tokenizer: Any, turns: Sequence[str | Generation], *, version: int = 0
    ) -> None:
        self.tok, self.turns, self.version = tokenizer, list(turns), version
        self.calls: list[tuple[list[int], SamplingSettings]] = []
        self.loaded: list[tuple[int, dict[str, bytes], str]] = []
        self.repeat_last = False  # keep answering with the last turn once the script is used up
        self.respond: Any = None  # or a function of the decoded context -> the turn's text
        self.per_request: Any = None  # or a function of the episode id -> that episode's turns
        self.load_gate: Any = None  # an anyio.Event load_weights waits for, if set
        self.delay_s = 0.0  # seconds each generate call takes
        # Seconds per sampled token, each stamped with the version loaded when it is sampled: a
        # weight update in the middle of a turn splits it, as vLLM's partial rollouts do.
        self.token_s = 0.0

    @property
    def policy_version(self) -> int:
        return self.version

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:
        self.calls.append((list(prompt_ids), sampling))
        if self.delay_s:
            import anyio

            await anyio.sleep(self.delay_s)
        if (
            self.per_request is not None
        ):  # a script per episode: request ids are "<episode>-t<turn>"
            episode, turn_no = request_id.rsplit("-t", 1)
            script = self.per_request(episode)
            turn = script[int(turn_no)] if int(turn_no) < len(script) else "(script ended)"
        elif self.respond is not None:
            turn = self.respond(self.tok.decode(list(prompt_ids)))
        elif self.repeat_last and len(self.turns) == 1:
            turn = self.turns[0]
        else:
            turn = self.turns.pop(0) if self.turns else "(script ended)"
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
            import anyio

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
        if self.load_gate is not None:  # a test holds the update back (a slow load)
            await self.load_gate.wait()
        self.loaded.append((version, {name: bytes(memoryview(a)) for name, a in tensors}, mode))
        self.version = version
        return 0.001

    async def load_weights_file(self, version: int, path: str, *, mode: UpdateMode) -> float:
        raise WeightUpdateError(f"{type(self).__name__} cannot load weights from a file")

    async def shutdown(self) -> None:
        pass


@dataclass
class EchoTool:
    name: str = "echo"
    text: str | None = None  # fixed reply; None: echo the "text" argument
    ok: bool = True
    terminal: bool = False
    raises: bool = False
    seen: list[dict[str, Any]] = field(default_factory=list)

    @property
    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "echo",
                "parameters": {"type": "object", "properties": {}},
            },
        }

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        self.seen.append(args)
        if self.raises:
            raise RuntimeError("tool bug")
        text = self.text if self.text is not None else str(args.get("text", ""))
        return ToolResult(
            text, ok=self.ok, terminal=self.terminal, answer=text if self.terminal else None
        )
