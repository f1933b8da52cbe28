"""A replay engine: the Engine protocol answered from a recording instead of a model.

Design: an episode's model turns are read off its recorded trajectories: the segments in order
(StateLM snapshots ``<episode>-0``, ``-1``, ..., then the final one; an unsegmented episode is one
trajectory named ``<episode>``), and in each the maximal runs of mask-1 tokens. Each ``generate``
call of an episode (request ids are ``<episode_id>-t<k>``) returns the next run with its recorded
logprobs and versions, whatever the context it is given, so a tool output that changed shows up as
that, and the model turns after it stay the recorded ones. A call beyond the recording returns an
empty generation with finish reason ``abort``: the episode ends (``aborted``) and the comparison
reports it, instead of anything hanging.

Finish reasons are what the agent needs to take the recorded path: ``stop`` when the run ends with
an end token (the tokenizer's and the generation config's eos ids, the request's stop ids) or a
stop string of the request (the code agent's closing tag, reported as ``stop_string``); ``length``
when the run is cut by the request's ``max_tokens`` or is the episode's last run of an episode
that ended by length; ``abort`` for the last run of an aborted episode; ``stop`` otherwise.

State masking (the code agent's ``mask_spans``) gives mask 0 to model tokens, which would split a
turn into several runs and hide a turn's masked first tokens; for such episodes (``extend_masked``)
a turn starts where the context it is asked for ends in the recording (while that context matches
the recording) and extends through mask-0 tokens until it meets a stop condition, as generation
did.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rollout_service.engine.base import (
    FinishReason,
    Generation,
    SamplingSettings,
    UpdateMode,
    WeightUpdateError,
)

if TYPE_CHECKING:
    from protocol.weights import ModelManifest


def episode_of(trajectory_id: str, group_uid: str) -> tuple[str, int | None]:
    """(episode id, segment number or None) of a trajectory id: ``<uid>-<i>`` or ``<uid>-<i>-<k>``.
    An id of another shape is taken as its own episode."""
    rest = trajectory_id[len(group_uid) + 1 :] if trajectory_id.startswith(group_uid + "-") else ""
    parts = rest.split("-")
    if len(parts) == 1 and parts[0].isdigit():
        return f"{group_uid}-{parts[0]}", None
    if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
        return f"{group_uid}-{parts[0]}", int(parts[1])
    return trajectory_id, None


@dataclass
class RecordedEpisode:
    episode_id: str
    group_uid: str
    segments: list[Any] = field(default_factory=list)  # trajectories, ordered by snapshot_index

    @property
    def index(self) -> int | None:
        """Its number in the group (``<uid>-<i>``), None for a foreign id."""
        tail = self.episode_id[len(self.group_uid) + 1 :]
        return (
            int(tail)
            if self.episode_id.startswith(self.group_uid + "-") and tail.isdigit()
            else None
        )

    def problem(self) -> str | None:
        """Why the recording cannot drive a rerun of this episode; None when it can."""
        idx = [t.snapshot_index for t in self.segments]
        total = self.segments[-1].reward_extras.get("segments", len(self.segments))
        if idx != list(range(len(idx))) or total != len(idx) or self.segments[-1].is_snapshot:
            return (
                f"only segments {idx} of {total} were recorded (agents.statelm.max_segments keeps "
                "some): the model turns of the others are unknown"
            )
        return None

    @property
    def model_tokens(self) -> int:
        return int(sum(int(t.response_mask.sum()) for t in self.segments))


def group_episodes(trajectories: Iterable[Any]) -> dict[str, RecordedEpisode]:
    """Recorded trajectories by episode id, in recording order, segments sorted."""
    episodes: dict[str, RecordedEpisode] = {}
    for t in trajectories:
        eid, _ = episode_of(t.trajectory_id, t.group_uid)
        episodes.setdefault(eid, RecordedEpisode(eid, t.group_uid)).segments.append(t)
    for ep in episodes.values():
        ep.segments.sort(key=lambda t: t.snapshot_index)
    return episodes


def stop_ids(model_dir: str | Path, renderer: Any) -> set[int]:
    """Token ids generation stops on: the template's end of turn and the generation config's eos."""
    ids = {renderer.eos_id}
    gc = Path(model_dir) / "generation_config.json"
    if gc.is_file():
        eos = json.loads(gc.read_text(encoding="utf-8")).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return ids


@dataclass
class _Cursor:
    segment: int = 0
    position: int = 0
    calls: int = 0
    beyond: int = 0  # calls past the end of the recording


_FINISH_OF_TERMINATION: dict[str, FinishReason] = {"aborted": "abort", "length": "length"}


class ReplayEngine:
    """Plays back recorded model turns per episode (see the module docstring). An ``Engine`` that
    takes no weights: the recording fixes every token and its version."""

    weight_manifest: ModelManifest | None = None
    last_update_timings: Mapping[str, float] = {}

    def __init__(
        self,
        episodes: dict[str, RecordedEpisode],
        renderer: Any,
        *,
        stop_token_ids: Iterable[int] = (),
        extend_masked: Iterable[str] = (),
    ) -> None:
        self.episodes, self.renderer = episodes, renderer
        self.stop_token_ids = set(stop_token_ids) | {renderer.eos_id}
        self.extend_masked = set(extend_masked)
        self.cursors: dict[str, _Cursor] = {}
        versions = [
            int(t.versions.max()) for e in episodes.values() for t in e.segments if len(t.versions)
        ]
        self._version = max(versions, default=0)

    @property
    def policy_version(self) -> int:
        return self._version

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass

    async def load_weights(
        self, version: int, tensors: list[tuple[str, np.ndarray]], *, mode: UpdateMode
    ) -> float:
        raise WeightUpdateError("a replay plays back recorded tokens; it takes no weights")

    async def load_weights_file(self, version: int, path: str, *, mode: UpdateMode) -> float:
        raise WeightUpdateError("a replay plays back recorded tokens; it takes no weights")

    async def shutdown(self) -> None:
        pass

    def unused_model_tokens(self, episode_id: str) -> int:
        """Recorded model tokens (mask 1) no generate call returned."""
        ep, cur = self.episodes[episode_id], self.cursors.get(episode_id, _Cursor())
        left = 0
        for k, t in enumerate(ep.segments[cur.segment :], start=cur.segment):
            mask = t.response_mask[cur.position :] if k == cur.segment else t.response_mask
            left += int(mask.sum())
        return left

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSettings
    ) -> Generation:
        episode_id = request_id.rpartition("-t")[0]
        ep = self.episodes.get(episode_id)
        if ep is None:
            raise KeyError(f"replay: no recorded episode {episode_id!r} (request {request_id!r})")
        cur = self.cursors.setdefault(episode_id, _Cursor())
        cur.calls += 1
        extend = episode_id in self.extend_masked
        if not (extend and self._locate(ep, cur, prompt_ids)) and not self._seek(ep, cur):
            cur.beyond += 1
            return Generation([], [], [], "abort")
        t = ep.segments[cur.segment]
        resp, mask = t.response_ids, t.response_mask
        start, limit = cur.position, min(len(resp), cur.position + sampling.max_tokens)
        ended = False
        if extend:  # through masked model tokens, up to a stop condition
            end = start
            while end < limit and not ended:
                end += 1
                ended = self._ends_turn(resp[start:end].tolist(), sampling)
        else:  # the run of mask-1 tokens
            end = start
            while end < limit and mask[end] == 1:
                end += 1
            ended = self._ends_turn(resp[start:end].tolist(), sampling)
        cur.position = end
        ids = resp[start:end].tolist()
        stop_string = self._stop_string(ids, sampling)
        if ended or stop_string is not None:
            finish = "stop"
        elif end - start >= sampling.max_tokens:
            finish = "length"
        elif self._at_end(ep, cur):
            finish = _FINISH_OF_TERMINATION.get(t.termination, "stop")
        else:
            finish = "stop"
        return Generation(
            ids,
            t.rollout_logprobs[start:end].tolist(),
            t.versions[start:end].tolist(),
            finish,
            stop_token_included=finish == "stop",
            stop_string=stop_string,
        )

    # -- helpers -------------------------------------------------------------------------------------
    @staticmethod
    def _seek(ep: RecordedEpisode, cur: _Cursor) -> bool:
        """Move the cursor to the next model token (across segments); False past the end."""
        while cur.segment < len(ep.segments):
            mask = ep.segments[cur.segment].response_mask
            while cur.position < len(mask) and mask[cur.position] == 0:
                cur.position += 1
            if cur.position < len(mask):
                return True
            cur.segment, cur.position = cur.segment + 1, 0
        return False

    @staticmethod
    def _locate(ep: RecordedEpisode, cur: _Cursor, context: Sequence[int]) -> bool:
        """Put the cursor where ``context`` (prompt + response so far) ends in the recording, when
        it is a prefix of a segment at or after the cursor: a turn that opens with masked model
        tokens starts there, not at the next mask-1 token. False when the context has diverged."""
        ctx = np.asarray(context)
        for k in range(cur.segment, len(ep.segments)):
            t = ep.segments[k]
            n = len(t.prompt_ids)
            p = len(ctx) - n
            if (k, p) < (cur.segment, cur.position) or not 0 <= p < len(t.response_ids):
                continue
            if np.array_equal(ctx[:n], t.prompt_ids) and np.array_equal(
                ctx[n:], t.response_ids[:p]
            ):
                cur.segment, cur.position = k, p
                return True
        return False

    @staticmethod
    def _at_end(ep: RecordedEpisode, cur: _Cursor) -> bool:
        probe = _Cursor(cur.segment, cur.position)
        return not ReplayEngine._seek(ep, probe)

    def _ends_turn(self, ids: list[int], sampling: SamplingSettings) -> bool:
        if not ids:
            return False
        if ids[-1] in self.stop_token_ids or ids[-1] in sampling.stop_token_ids:
            return not sampling.ignore_eos
        return self._stop_string(ids, sampling) is not None

    def _stop_string(self, ids: list[int], sampling: SamplingSettings) -> str | None:
        """The stop string the last token completes, if any."""
        if not sampling.stop or not ids:
            return None
        text, before = self.renderer.decode(ids), len(self.renderer.decode(ids[:-1]))
        for s in sampling.stop:
            at = text.rfind(s)
            if at >= 0 and at + len(s) > before:
                return s
        return None
