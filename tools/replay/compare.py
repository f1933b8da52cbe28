"""Comparing rerun trajectories with recorded ones, and the report.

Design: a ``Divergence`` names the trajectory, the field and what differs; token columns report
both lengths, the first differing position and the decoded text around it (the tokens before it,
then the recorded and the rerun tokens from it on), which is usually enough to see *what* changed:
a tool output, a reward's reading of the answer, a template. Fields compared: the three token
columns (prompt_ids, response_ids, response_mask) and the logprob / version columns (they come
from the recording, so they differ only where the token structure moved), reward, reward_extras
(keys that are not deterministic by design are left out: ``NONDETERMINISTIC_EXTRAS``), termination,
turns, segment place (snapshot_index, is_snapshot), agent type and data source, and per episode the
set of segments. Timings are never compared.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

CONTEXT_TOKENS = 16
NONDETERMINISTIC_EXTRAS = frozenset({"remax_baseline"})  # the greedy episode is not recorded
SCALAR_FIELDS = (
    "termination",
    "num_turns",
    "snapshot_index",
    "is_snapshot",
    "agent_type",
    "data_source",
)


@dataclass
class Divergence:
    episode_id: str
    trajectory_id: str
    field: str
    detail: str
    position: int | None = None
    recorded: Any = None
    rerun: Any = None
    before: str | None = None  # decoded tokens before ``position``

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """Index of the first difference of two arrays (the shorter length if one is a prefix); None if equal."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    if len(diff):
        return int(diff[0])
    return None if len(a) == len(b) else n


def _tokens(
    episode_id: str,
    tid: str,
    name: str,
    rec: np.ndarray,
    new: np.ndarray,
    decode: Any,
    text_of: tuple[np.ndarray, np.ndarray] | None = None,
) -> Divergence | None:
    pos = first_difference(rec, new)
    if pos is None:
        return None
    # The mask is shown through the tokens it covers, with the mask values.
    rec_ids, new_ids = text_of if text_of is not None else (rec, new)
    lo, hi = max(0, pos - CONTEXT_TOKENS), pos + CONTEXT_TOKENS
    detail = f"{len(rec)} recorded vs {len(new)} rerun tokens; first difference at position {pos}"
    recorded, rerun = (
        decode(ids[pos:hi].tolist()) if pos < len(ids) else "(the tokens end here)"
        for ids in (rec_ids, new_ids)
    )
    if text_of is not None:
        recorded += f"  (mask {''.join(map(str, rec[pos:hi].tolist()))})"
        rerun += f"  (mask {''.join(map(str, new[pos:hi].tolist()))})"
    return Divergence(
        episode_id, tid, name, detail, pos, recorded, rerun, decode(rec_ids[lo:pos].tolist())
    )


def _close(a: Any, b: Any) -> bool:
    if (
        isinstance(a, float | int)
        and isinstance(b, float | int)
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
    return bool(a == b)


def compare_trajectory(episode_id: str, rec: Any, new: Any, decode: Any) -> list[Divergence]:
    tid = rec.trajectory_id
    out: list[Divergence | None] = [
        _tokens(episode_id, tid, "prompt_ids", rec.prompt_ids, new.prompt_ids, decode),
        _tokens(episode_id, tid, "response_ids", rec.response_ids, new.response_ids, decode),
    ]
    if out[-1] is None:  # same tokens: the mask (and what rides on it) can still differ
        out.append(
            _tokens(
                episode_id,
                tid,
                "response_mask",
                rec.response_mask,
                new.response_mask,
                decode,
                text_of=(rec.response_ids, new.response_ids),
            )
        )
        for name in ("rollout_logprobs", "versions"):
            a, b = getattr(rec, name), getattr(new, name)
            if (pos := first_difference(a, b)) is not None:
                out.append(
                    Divergence(
                        episode_id,
                        tid,
                        name,
                        f"first difference at position {pos}",
                        pos,
                        float(a[pos]),
                        float(b[pos]),
                    )
                )
    if not _close(rec.reward, new.reward):
        out.append(
            Divergence(
                episode_id,
                tid,
                "reward",
                f"recorded {rec.reward:g}, rerun {new.reward:g}",
                recorded=rec.reward,
                rerun=new.reward,
            )
        )
    keys = (set(rec.reward_extras) | set(new.reward_extras)) - NONDETERMINISTIC_EXTRAS
    for key in sorted(keys):
        a, b = rec.reward_extras.get(key), new.reward_extras.get(key)
        if not _close(a, b):
            out.append(
                Divergence(
                    episode_id,
                    tid,
                    f"reward_extras.{key}",
                    f"recorded {a!r}, rerun {b!r}",
                    recorded=a,
                    rerun=b,
                )
            )
    for name in SCALAR_FIELDS:
        a, b = getattr(rec, name), getattr(new, name)
        if a != b:
            out.append(
                Divergence(
                    episode_id, tid, name, f"recorded {a!r}, rerun {b!r}", recorded=a, rerun=b
                )
            )
    return [d for d in out if d is not None]


def compare_episode(
    episode_id: str, recorded: list[Any], rerun: list[Any], decode: Any
) -> list[Divergence]:
    """Every difference between an episode's recorded and rerun trajectories (its segments)."""
    rec_ids, new_ids = [t.trajectory_id for t in recorded], [t.trajectory_id for t in rerun]
    out: list[Divergence] = []
    if rec_ids != new_ids:
        out.append(
            Divergence(
                episode_id,
                episode_id,
                "segments",
                f"recorded {len(rec_ids)} trajectories {rec_ids}, rerun {len(new_ids)} {new_ids}",
                recorded=rec_ids,
                rerun=new_ids,
            )
        )
    by_id = {t.trajectory_id: t for t in rerun}
    for t in recorded:
        if t.trajectory_id in by_id:
            out += compare_trajectory(episode_id, t, by_id[t.trajectory_id], decode)
    return out


# -- report --------------------------------------------------------------------------------------------


def _clip(text: str, n: int = 160) -> str:
    text = repr(text)
    return text if len(text) <= n else text[: n // 2] + " ... " + text[-n // 2 :]


def render_text(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [
        f"rerun of {report['recording']}: {s['episodes']} episodes ({s['trajectories']} trajectories) "
        f"from {s['batches']} batch{'es' if s['batches'] != 1 else ''}; {s['multi_turn_episodes']} with 2+ turns, "
        f"{s['tool_calls']} tool calls in the rerun",
        f"diverged: {s['diverged']} episodes ({s['divergences']} differences); not rerun: {s['not_rerun']}",
    ]
    for ep in report["episodes"]:
        if ep["status"] == "same":
            continue
        calls = "-" if ep["tool_calls"] is None else ep["tool_calls"]
        lines.append(
            f"\n{ep['episode_id']}  [{ep['status']}]  turns {ep['turns']}, tool calls {calls}"
            + (f"  {ep['reason']}" if ep.get("reason") else "")
        )
        for d in ep.get("divergences", []):
            lines.append(f"  {d['trajectory_id']}  {d['field']}: {d['detail']}")
            if "before" in d:
                lines.append(f"      before:   {_clip(d['before'])}")
            if "position" in d and isinstance(d.get("recorded"), str):
                lines.append(f"      recorded: {_clip(d['recorded'])}")
                lines.append(f"      rerun:    {_clip(d['rerun'])}")
    lines.append(
        "\nresult: "
        + (
            "no divergence"
            if not s["diverged"] and not s["not_rerun"]
            else f"{s['diverged']} diverged, {s['not_rerun']} not rerun"
        )
    )
    return "\n".join(lines) + "\n"
