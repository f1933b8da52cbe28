"""``bin/replay rerun``: run recorded episodes again through the real agent loop and compare.

Design: everything but the model is the rollout server's own code, built from the config the
server ran with (``locate.load_run_config``) by the server's helpers: ``sampling_settings``,
``agent_limits``, ``build_agent_deps`` (tools, local or remote, with rate limits), ``check_names``,
``RewardChoice``; episodes run through ``groups.run_group`` (agents, rewards, StateLM segment
shaping). The model is a ``ReplayEngine`` that plays back the recorded tokens. ``remax`` is off:
the greedy baseline episode is never recorded.

Data rows: a group uid names the prompt (``rollout_service.data``): ``e{epoch}-i{index}`` is row
``index`` of the configured data (sources concatenated), whatever the shard; ``e{epoch}-m{slot}``
(mixed datasets) is a slot of the epoch's schedule, which ``PromptSource`` rebuilds from the same
config and shard (``position_of_group`` -> ``item_at``). So the data files must be the ones the
run used; a changed file shows up as a divergence (prompt_ids) or a row that cannot be found.

An episode is *not rerun* (reported, and exit status 1) when its row cannot be found, when its group
is incomplete, or when the recording lacks segments of it (``agents.statelm.max_segments``): then
its model turns are unknown; it still runs with its group, but is not compared.
"""

from __future__ import annotations

import functools
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

from common.ratelimit import GlobalRateLimiter, set_shared
from rollout_service.agents.base import AgentDeps, deps_for
from rollout_service.agents.parsers import PARSERS
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.data import DataError, PromptSource
from rollout_service.groups import RewardChoice, run_group
from rollout_service.server import (
    StartupError,
    agent_limits,
    build_agent_deps,
    check_names,
    sampling_settings,
)
from rollout_service.tools.factory import close_tools
from tools.replay import locate
from tools.replay.compare import Divergence, compare_episode, render_text
from tools.replay.engine import RecordedEpisode, ReplayEngine, group_episodes, stop_ids

if TYPE_CHECKING:
    from common.config import Config

_PLAIN_UID = re.compile(r"^e(\d+)-i(\d+)$")


@dataclass
class RowInfo:
    row: dict[str, Any]
    data_source: str
    agent_type: str


def find_row(source: Any, group_uid: str) -> RowInfo | None:
    """The data row (with its data source and agent type) a group uid names; None if none."""
    m = _PLAIN_UID.match(group_uid)
    if m is not None and source.mix is None:
        index = int(m.group(2))
        if index >= len(source.rows):
            return None
        r = source.rows[index]
        return RowInfo(r.row, r.data_source, r.agent_type)
    position = source.position_of_group(group_uid)
    if position is None:
        return None
    item = source.item_at(position)
    return RowInfo(item.row, item.data_source, item.agent_type)


def _group_problem(episodes: list[RecordedEpisode]) -> str | None:
    indices = sorted(ep.index if ep.index is not None else -1 for ep in episodes)
    if indices != list(range(len(episodes))):
        return f"the recorded group holds episodes {indices}, not 0..{len(episodes) - 1}"
    return None


async def rerun_recording(
    rec: locate.Recording, config: Config, *, concurrency: int = 8, shared_limits: bool = False
) -> dict[str, Any]:
    """Rerun every episode of one server's recording; the report as a JSON-able dict.

    Rate-limited tools keep their limits, in buckets of the rerun's own: a rerun does not wait on
    the tokens of a run that may still be live. `shared_limits` takes tokens from the run's own
    buckets instead (when the rerun calls the same metered API as a live run)."""
    import anyio
    from transformers import AutoTokenizer

    model_dir = config.actor_rollout_ref.model.path
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    batches, recorded = 0, []
    for _, trajectories in rec.batches():
        batches += 1
        recorded += trajectories
    episodes = group_episodes(recorded)
    groups: dict[str, list[RecordedEpisode]] = {}
    for ep in episodes.values():
        groups.setdefault(ep.group_uid, []).append(ep)
    server = config.rollout_server
    try:
        source = PromptSource.from_config(
            config.data,
            shard_index=server.shard_index,
            shard_count=server.shard_count,
            state_dir=None,
        )
    except DataError as e:
        raise locate.ReplayError(f"cannot load the run's data: {e}") from None
    rows: dict[str, RowInfo] = {}
    skipped: dict[str, str] = {}  # episode id -> why it is not rerun
    for uid, eps in groups.items():
        info = find_row(source, uid)
        why = (
            f"no data row for group {uid!r} in the configured data (data.train_files / data.datasets)"
            if info is None
            else _group_problem(eps)
        )
        if info is None or why is not None:
            skipped |= {ep.episode_id: why or "" for ep in eps}  # never "": no row, or a problem
            continue
        rows[uid] = info
        # The group's other episodes still rerun and compare (episodes of a group are independent).
        skipped |= {ep.episode_id: p for ep in eps if (p := ep.problem()) is not None}
    agent_types = {info.agent_type for info in rows.values()}
    try:
        check_names(config, agent_types)
    except StartupError as e:
        raise locate.ReplayError(str(e)) from None
    masking = bool(config.agents.code.mask_spans)
    extend = {
        ep.episode_id
        for uid, info in rows.items()
        if info.agent_type == "code" and masking
        for ep in groups[uid]
    }
    engine = ReplayEngine(
        episodes, renderer, stop_token_ids=stop_ids(model_dir, renderer), extend_masked=extend
    )
    limits_cfg = config.tools.rate_limits
    with tempfile.TemporaryDirectory(prefix="replay-") as scratch:
        shared = bool(shared_limits and limits_cfg.limits and rec.run_dir is not None)
        state_root = rec.run_dir if shared and rec.run_dir is not None else Path(scratch)
        # its own buckets: the run's state_dir (possibly shared by several jobs) is not touched
        own = limits_cfg if shared else limits_cfg.model_copy(update={"state_dir": None})
        limiter = GlobalRateLimiter.from_config(own, state_root)
        set_shared(limiter)
        mt = config.actor_rollout_ref.rollout.multi_turn
        base = AgentDeps(
            engine=engine,
            renderer=renderer,
            sampling=sampling_settings(config),
            limits=agent_limits(config),
            parser=PARSERS.get(mt.format)(),
        )
        try:
            deps = build_agent_deps(config, base, agent_types, limiter) if agent_types else {}
        except (ValueError, OSError) as e:
            set_shared(None)
            hint = (
                f" (tools.remote.url={config.tools.remote.url}: is the tool server running?)"
                if config.tools.remote.url
                else ""
            )
            raise locate.ReplayError(f"cannot build the run's tools: {e}{hint}") from None
        rewards = RewardChoice(server.reward_fn, dict(server.reward_by_data_source))
        results: dict[str, Any] = {}
        limit = anyio.Semaphore(max(1, concurrency))

        async def one(uid: str, info: RowInfo) -> None:
            async with limit:
                try:
                    results[uid] = await run_group(
                        group_uid=uid,
                        row=info.row,
                        n=len(groups[uid]),
                        agent_type=info.agent_type,
                        data_source=info.data_source,
                        deps=deps_for(deps, info.agent_type, info.data_source),
                        rewards=rewards,
                        server_id=groups[uid][0].segments[0].source_server or rec.server_id,
                        remax=False,
                    )
                except Exception as e:  # reported for its episodes; the other groups go on
                    results[uid] = e

        try:
            async with anyio.create_task_group() as tg:
                for uid, info in rows.items():
                    tg.start_soon(one, uid, info)
        finally:
            set_shared(None)
            with anyio.CancelScope(shield=True):
                await close_tools({n: t for d in deps.values() for n, t in d.tools.items()})
    return _report(rec, batches, recorded, groups, results, skipped, engine, renderer)


def _report(
    rec: locate.Recording,
    batches: int,
    recorded: list[Any],
    groups: dict[str, list[RecordedEpisode]],
    results: dict[str, Any],
    skipped: dict[str, str],
    engine: ReplayEngine,
    renderer: Any,
) -> dict[str, Any]:
    entries = []
    for uid, eps in groups.items():
        result = results.get(uid)
        rerun_eps = (
            {e.episode_id: e for e in result.episodes}
            if result is not None and not isinstance(result, Exception)
            else {}
        )
        for ep in eps:
            entry: dict[str, Any] = {
                "episode_id": ep.episode_id,
                "group_uid": uid,
                "trajectories": [t.trajectory_id for t in ep.segments],
                "turns": ep.segments[-1].num_turns,
                "tool_calls": None,
            }
            if ep.episode_id in skipped:
                entry |= {"status": "not rerun", "reason": skipped[ep.episode_id]}
            elif result is None:  # its group was never run
                entry |= {"status": "not rerun", "reason": f"no rerun result for group {uid!r}"}
            elif isinstance(result, Exception):
                entry |= {
                    "status": "diverged",
                    "divergences": [
                        Divergence(
                            ep.episode_id,
                            ep.episode_id,
                            "error",
                            f"the rerun raised {type(result).__name__}: {result}",
                        ).to_json()
                    ],
                }
            else:
                mine = [
                    t
                    for t in result.trajectories
                    if t.trajectory_id == ep.episode_id
                    or t.trajectory_id.startswith(ep.episode_id + "-")
                ]
                found = compare_episode(ep.episode_id, ep.segments, mine, renderer.decode)
                cur = engine.cursors.get(ep.episode_id)
                if cur is not None and cur.beyond:
                    found.append(
                        Divergence(
                            ep.episode_id,
                            ep.episode_id,
                            "model_turns",
                            f"the rerun asked for {cur.beyond} model turn(s) more than recorded",
                        )
                    )
                if unused := engine.unused_model_tokens(ep.episode_id):
                    found.append(
                        Divergence(
                            ep.episode_id,
                            ep.episode_id,
                            "model_turns",
                            f"{unused} recorded model tokens were never asked for (the rerun "
                            "episode ended earlier)",
                        )
                    )
                entry["tool_calls"] = (
                    rerun_eps[ep.episode_id].tool_calls if ep.episode_id in rerun_eps else None
                )
                entry["status"] = "diverged" if found else "same"
                if found:
                    entry["divergences"] = [d.to_json() for d in found]
            entries.append(entry)
    summary = {
        "batches": batches,
        "trajectories": len(recorded),
        "episodes": len(entries),
        "multi_turn_episodes": sum(e["turns"] >= 2 for e in entries),
        "tool_calls": sum(e["tool_calls"] or 0 for e in entries),
        "diverged": sum(e["status"] == "diverged" for e in entries),
        "divergences": sum(len(e.get("divergences", [])) for e in entries),
        "not_rerun": sum(e["status"] == "not rerun" for e in entries),
    }
    return {
        "recording": rec.label,
        "server_id": rec.server_id,
        "summary": summary,
        "episodes": entries,
    }


def run(
    path: str,
    *,
    config: str | None = None,
    model: str | None = None,
    overrides: list[str] | None = None,
    as_json: bool = False,
    concurrency: int = 8,
    shared_limits: bool = False,
    out: TextIO | None = None,
    verify: bool = True,
) -> int:
    """Rerun every recording ``path`` names; exit status 0 when nothing diverged and all reran."""
    import json

    import anyio

    out = out or cast(TextIO, sys.stdout)  # typeshed: stdout may be None (pythonw)
    reports = []
    for rec in locate.find(path, verify=verify):
        cfg = locate.load_run_config(rec, config=config, model=model, overrides=overrides or [])
        reports.append(
            anyio.run(
                functools.partial(
                    rerun_recording,
                    rec,
                    cfg,
                    concurrency=concurrency,
                    shared_limits=shared_limits,
                )
            )
        )
    keys = (
        "batches",
        "trajectories",
        "episodes",
        "multi_turn_episodes",
        "tool_calls",
        "diverged",
        "divergences",
        "not_rerun",
    )
    total = {k: sum(r["summary"][k] for r in reports) for k in keys}
    if as_json:
        json.dump({"summary": total, "recordings": reports}, out, indent=1, default=str)
        out.write("\n")
    else:
        for r in reports:
            out.write(render_text(r))
    return 0 if not total["diverged"] and not total["not_rerun"] else 1
