"""Batches of trajectories held column-wise, the form they travel in.

``Trajectories`` is a read-only sequence of ``Trajectory`` backed by the five token columns (one
array each, the batch's arrays concatenated) and the per-trajectory scalars as lists. It is what
the codec decodes into and what it encodes from without a copy: the decoded token arrays are views
into the received frames, and ``Trajectory`` objects (slices of those views) are only made when
someone asks for them. The learner, which wants columns to build padded tensors anyway, never has
to pay for 256 little objects per batch.

``TrajectoryBuilder`` is the producer's half: a rollout server appends each trajectory as its
episode finishes, which copies its arrays into growing column buffers once, at that moment (spread
over the seconds an episode takes), so handing a full batch to the protocol copies nothing more.
A plain ``list[Trajectory]`` is accepted everywhere too and is concatenated when encoded.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from protocol.trajectory import COLUMNS, META_ORDER, SCALARS, Trajectory


class Trajectories(Sequence[Trajectory]):
    """A batch: ``meta`` maps each field of ``META_ORDER`` to a list with one value per trajectory;
    ``columns`` maps each token column to its concatenated array (canonical or accepted dtype)."""

    __slots__ = ("_items", "columns", "meta")

    def __init__(self, meta: dict[str, list[Any]], columns: dict[str, np.ndarray]) -> None:
        self.meta, self.columns = meta, columns
        self._items: list[Trajectory] | None = None

    @classmethod
    def from_list(cls, trajs: Sequence[Trajectory]) -> Trajectories:
        """Concatenate trajectory objects (one copy of every array, cast to the canonical dtypes)."""
        if isinstance(trajs, Trajectories):
            return trajs
        for t in trajs:
            n = len(t.response_ids)
            if not len(t.response_mask) == len(t.rollout_logprobs) == len(t.versions) == n:
                raise ValueError(f"trajectory {t.trajectory_id}: response arrays differ in length")
        meta: dict[str, list[Any]] = {k: [getattr(t, k) for t in trajs] for k in SCALARS}
        meta["reward"] = [float(r) for r in meta["reward"]]
        meta["prompt_len"] = [len(t.prompt_ids) for t in trajs]
        meta["response_len"] = [len(t.response_ids) for t in trajs]
        columns = {}
        for name, attr, dtype, _ in COLUMNS:
            parts = [getattr(t, attr) for t in trajs]
            # One pass: concatenate casts while it copies.
            columns[name] = (
                np.concatenate(parts, dtype=dtype, casting="unsafe")
                if parts
                else np.empty(0, dtype)
            )
        return cls(meta, columns)

    # -- sequence --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.meta["trajectory_id"])

    @overload
    def __getitem__(self, i: int) -> Trajectory: ...
    @overload
    def __getitem__(self, i: slice) -> list[Trajectory]: ...
    def __getitem__(self, i: int | slice) -> Trajectory | list[Trajectory]:
        return self.materialize()[i]

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.materialize())

    def __repr__(self) -> str:
        return f"Trajectories({len(self)} trajectories, {self.token_count} tokens)"

    def materialize(self) -> list[Trajectory]:
        """The trajectory objects (made once; their arrays are views into the columns)."""
        if self._items is None:
            self._items = _split(self.meta, self.columns)
        return self._items

    # -- column-wise helpers (no objects made) -------------------------------------------------------------
    @property
    def ids(self) -> list[str]:
        return self.meta["trajectory_id"]

    @property
    def token_count(self) -> int:
        return sum(self.meta["prompt_len"]) + sum(self.meta["response_len"])

    def canonical_arrays(self) -> list[np.ndarray]:
        """The token columns in wire order and canonical dtypes: no copy when they already are."""
        return [
            np.ascontiguousarray(self.columns[name], dtype=dtype) for name, _, dtype, _ in COLUMNS
        ]


def as_columns(trajs: Sequence[Trajectory]) -> Trajectories:
    return trajs if isinstance(trajs, Trajectories) else Trajectories.from_list(trajs)


def token_count(trajs: Sequence[Trajectory]) -> int:
    if isinstance(trajs, Trajectories):
        return trajs.token_count
    return sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)


def _split(meta: dict[str, list[Any]], columns: dict[str, np.ndarray]) -> list[Trajectory]:
    pofs = list(itertools.accumulate(meta["prompt_len"], initial=0))
    rofs = list(itertools.accumulate(meta["response_len"], initial=0))
    bounds = {"prompt_ids": (pofs[:-1], pofs[1:])}
    views = []
    for name, _, _, _ in COLUMNS:
        starts, ends = bounds.get(name) or (rofs[:-1], rofs[1:])
        a = columns[name]
        views.append([a[i:j] for i, j in zip(starts, ends, strict=True)])
    tids, gids, *rest = (meta[k] for k in SCALARS)
    # Positional construction: a kwargs dict per trajectory would cost more than the rest.
    return list(map(Trajectory, tids, gids, *views, *rest))


class TrajectoryBuilder:
    """Accumulates trajectories into column buffers; ``build`` hands them over as ``Trajectories``.

    Buffers grow geometrically, so appending is amortised O(tokens); ``build`` trims them to their
    used length (views, no copy) and starts fresh buffers for the next batch.
    """

    def __init__(self, capacity_tokens: int = 1 << 16) -> None:
        self._cap0 = max(16, capacity_tokens)
        self._reset()

    def _reset(self) -> None:
        self._meta: dict[str, list[Any]] = {k: [] for k in META_ORDER}
        self._bufs = {name: np.empty(self._cap0, dtype) for name, _, dtype, _ in COLUMNS}
        self._used = {"prompt_ids": 0, "response": 0}

    def __len__(self) -> int:
        return len(self._meta["trajectory_id"])

    @property
    def token_count(self) -> int:
        return self._used["prompt_ids"] + self._used["response"]

    def append(self, t: Trajectory) -> None:
        n = len(t.response_ids)
        if not len(t.response_mask) == len(t.rollout_logprobs) == len(t.versions) == n:
            raise ValueError(f"trajectory {t.trajectory_id}: response arrays differ in length")
        p = len(t.prompt_ids)
        p0, r0 = self._used["prompt_ids"], self._used["response"]
        for name, attr, _, _ in COLUMNS:
            start, size = (p0, p) if name == "prompt_ids" else (r0, n)
            buf = self._bufs[name]
            if start + size > len(buf):
                grown = np.empty(max(2 * len(buf), start + size), buf.dtype)
                grown[:start] = buf[:start]
                self._bufs[name] = buf = grown
            buf[start : start + size] = getattr(t, attr)  # casts to the canonical dtype
        self._used["prompt_ids"], self._used["response"] = p0 + p, r0 + n
        m = self._meta
        for k in SCALARS:
            m[k].append(getattr(t, k))
        m["reward"][-1] = float(t.reward)
        m["prompt_len"].append(p)
        m["response_len"].append(n)

    def build(self) -> Trajectories:
        """The batch so far (the builder starts empty again)."""
        p, r = self._used["prompt_ids"], self._used["response"]
        columns = {
            name: self._bufs[name][: p if name == "prompt_ids" else r] for name, _, _, _ in COLUMNS
        }
        out = Trajectories(self._meta, columns)
        self._reset()
        return out
