"""Trajectories and the one declaration of their wire schema.

A trajectory is one sequence the learner trains on: an agent episode, or one segment of it when the
agent edits its own context (StateLM snapshots share the episode's ``group_uid``).

``FIELDS`` declares every per-trajectory field once: its validation kind, default, and where it
travels. Everything else is derived from it: the ``Trajectory`` constructor order the batch builds
objects in, the token columns, the numeric columns, the header's string and map fields, the
dtypes a receiver accepts (``protocol.columns`` validates both batch forms from these tables).
Three placements:

- ``token``: per-token arrays, one binary frame per column (the batch's arrays concatenated);
- ``number``: one number per trajectory. Since 1.5 one binary frame per column, like the tokens
  (numpy validates it in one pass); a 1.3/1.4 peer sends them as header lists (``meta``);
- ``header``: strings and maps, header lists (``meta``) in both forms.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np

TERMINATIONS = ("answered", "no_tool_call", "length", "max_turns", "tool_error", "aborted")

# ``Trajectory.actions``: what the agent did in the episode, as counts. These names, plus
# ``tool_calls/<tool>`` per tool; receivers ignore names they do not know.
ACTION_COUNTS = (
    "tool_calls",
    "tool_errors",
    "snapshots",
    "deletions",
    "sandbox_runs",
    "sandbox_errors",
)
TOOL_CALLS_PREFIX = "tool_calls/"


@dataclass(eq=False)
class Trajectory:
    trajectory_id: str
    group_uid: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray  # 1: model token (trained on), 0: tool/env token
    # logprob of each sampled token under the rollout policy; 0 where mask 0
    rollout_logprobs: np.ndarray
    versions: np.ndarray  # policy version that produced each response token
    reward: float = 0.0
    snapshot_index: int = 0
    is_snapshot: bool = False
    source_server: str = ""
    data_source: str = ""
    agent_type: str = ""
    termination: str = "answered"
    num_turns: int = 1
    reward_extras: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # Counts of the agent's actions over the whole episode (``ACTION_COUNTS``). Only the episode's
    # final trajectory carries them (StateLM snapshot trajectories carry {}), so summing over a
    # batch counts each episode once whichever of its segments were kept.
    actions: dict[str, float] = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        return int(self.versions.min()) if len(self.versions) else -1


_REQUIRED: Any = object()
Placement = Literal["token", "number", "header"]


@dataclass(frozen=True)
class Field:
    """One per-trajectory field on the wire. ``kind`` names its value rule (``protocol.columns``);
    ``dtypes``: for binary columns, the canonical dtype first, then the others receivers accept."""

    name: str
    kind: str
    placement: Placement
    default: Any = _REQUIRED
    dtypes: tuple[str, ...] = ()
    minimum: int = 0  # for counts and lengths
    omit_when_empty: bool = False  # header maps left out when empty for every trajectory

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    @property
    def dtype(self) -> str:
        return self.dtypes[0]


_INT = ("int32", "int64")
# In ``Trajectory`` order (the batch constructs objects positionally); the two lengths last, they
# are derived from the token arrays and are no attribute. The order of the ``header`` and ``number``
# entries is also the order of the 1.3/1.4 ``meta`` map (golden vectors pin it).
FIELDS: tuple[Field, ...] = (
    Field("trajectory_id", "str", "header"),
    Field("group_uid", "str", "header"),
    Field("prompt_ids", "ids", "token", dtypes=_INT),
    Field("response_ids", "ids", "token", dtypes=_INT),
    Field("response_mask", "mask", "token", dtypes=("uint8", "bool")),
    Field("rollout_logprobs", "logprobs", "token", dtypes=("float32", "float64")),
    Field("versions", "count", "token", dtypes=_INT),
    Field("reward", "float", "number", dtypes=("float64", "float32")),
    Field("snapshot_index", "count", "number", 0, _INT),
    Field("is_snapshot", "bool", "number", False, ("uint8", "bool")),
    Field("source_server", "str", "header", ""),
    Field("data_source", "str", "header", ""),
    Field("agent_type", "str", "header", ""),
    Field("termination", "termination", "header", "answered"),
    Field("num_turns", "count", "number", 1, _INT),
    Field("reward_extras", "scalars", "header", {}),
    Field("timings", "floats", "header", {}),
    Field("actions", "counts", "header", {}, omit_when_empty=True),
    Field("prompt_len", "count", "number", dtypes=_INT, minimum=1),
    Field("response_len", "count", "number", dtypes=_INT),
)
BY_NAME = {f.name: f for f in FIELDS}
ATTRIBUTES = tuple(f.name for f in fields(Trajectory))
assert tuple(f.name for f in FIELDS[: len(ATTRIBUTES)]) == ATTRIBUTES, "Trajectory fields moved"

# (column, attribute, canonical dtype, dtypes a receiver accepts): the token frames, in wire order.
COLUMNS: tuple[tuple[str, str, str, frozenset[str]], ...] = tuple(
    (f.name, f.name, f.dtype, frozenset(f.dtypes)) for f in FIELDS if f.placement == "token"
)
TOKEN_NAMES = tuple(c[0] for c in COLUMNS)
# Per-trajectory fields, in the order of the 1.3/1.4 ``meta`` map; the 1.5 number frames follow the
# token frames in the order of ``NUMBERS``, the rest stay in ``meta``.
META_ORDER = tuple(f.name for f in FIELDS if f.placement != "token")
NUMBERS: tuple[Field, ...] = tuple(f for f in FIELDS if f.placement == "number")
HEADER_FIELDS: tuple[Field, ...] = tuple(f for f in FIELDS if f.placement == "header")
# Per-trajectory values that become ``Trajectory`` attributes (all of META_ORDER but the lengths).
SCALARS = tuple(n for n in META_ORDER if n in ATTRIBUTES)
