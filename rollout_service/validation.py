"""Validation runs on a rollout server: this server's shard of ``data.val_files``, metrics only.

Design: the learner asks (VALIDATE_REQUEST); ``ValidationRunner.run`` plays every row of the shard
(global row index ``i % shard_count == shard_index``, plain file order, no shuffle) through the
training path, ``run_group`` with the row's agent, tools and reward, but with the sampling of
``actor_rollout_ref.rollout.val_kwargs`` (greedy unless ``do_sample``) and ``val_kwargs.n``
episodes per row, then reduces the episodes to per-data-source metrics
(``protocol.validation.summarize``) for VALIDATE_RESULT; ``answer`` first waits until the
engine runs the requested policy version (or newer), all of it within the request's timeout.
Nothing of an episode leaves the server
but those numbers: validation groups never reach the shipper, so they are never trained on and use
no credits, and their ids (``val-{request}-{row}``) are local and cannot collide with training
groups (``e{epoch}-...``).

Concurrency: validation groups have their own limit, ``rollout_server.max_concurrent_episodes``
episodes at once, next to the training episodes rather than counted with them, so a validation run
neither waits for training admission nor blocks it (the engine's scheduler shares the batch). The
learner pauses training while it validates, so in practice training episodes drain meanwhile.

Validation data problems never stop the server: a missing or broken file (or an unknown agent
type) is logged at start and every request is then answered ``ok: false`` naming it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from protocol.messages import ValidateRequest, ValidateResult
from protocol.validation import EpisodeOutcome, summarize
from rollout_service.agents.base import AgentDeps, deps_for
from rollout_service.data import DataError, Source, _load_sources, layout_options
from rollout_service.engine.base import SamplingSettings
from rollout_service.groups import RewardChoice, run_group

if TYPE_CHECKING:
    from common.config import Config


@dataclass(frozen=True)
class ValRow:
    index: int  # global index of the row in the concatenated validation files
    row: dict[str, Any]
    data_source: str
    agent_type: str


def load_val_rows(data: Any, *, shard_index: int, shard_count: int) -> list[ValRow]:
    """This shard's validation rows in file order; data source and agent are chosen as for training
    rows (the row's own, else the file's stem / ``data.agent_type``). Raises ``DataError``."""
    if not data.val_files:
        return []
    rows, _ = _load_sources(
        [Source(tuple(data.val_files))],
        data.agent_type,
        max_row_bytes=data.max_row_bytes,
        options=layout_options(data),
    )
    return [
        ValRow(i, r.row, r.data_source, r.agent_type)
        for i, r in enumerate(rows)
        if i % shard_count == shard_index
    ]


def val_sampling(config: Config) -> SamplingSettings:
    """``val_kwargs`` as engine settings: greedy (temperature 0, no top-p/top-k) unless do_sample."""
    r = config.actor_rollout_ref.rollout
    v = r.val_kwargs
    if not v.do_sample:
        return SamplingSettings(
            max_tokens=r.response_budget, temperature=0.0, top_p=1.0, top_k=-1, seed=None
        )
    return SamplingSettings(
        max_tokens=r.response_budget,
        temperature=v.temperature,
        top_p=v.top_p,
        top_k=v.top_k,
        seed=None,
    )


def outcomes(result: Any) -> list[EpisodeOutcome]:
    """One outcome per episode of a ``GroupResult``: its reward and extras are those of its final
    trajectory (the one that is not a snapshot), which every agent gives the episode's reward."""
    final: dict[str, Any] = {}
    for t in result.trajectories:
        if not t.is_snapshot:
            final[t.trajectory_id] = t
    out = []
    for ep in result.episodes:
        t = final.get(ep.episode_id) or next(
            (t for tid, t in final.items() if tid.startswith(ep.episode_id + "-")), None
        )
        reward = float(t.reward) if t is not None else 0.0
        out.append(
            EpisodeOutcome(
                data_source=ep.data_source,
                reward=reward if math.isfinite(reward) else 0.0,
                response_length=len(t.response_ids) if t is not None else len(ep.response_ids),
                turns=ep.turns,
                termination=ep.termination or "aborted",
                extras=dict(t.reward_extras) if t is not None else {},
            )
        )
    return out


class ValidationRunner:
    """Runs validation requests on one server. ``problem``, when set, is why this server cannot
    validate: every request is then answered ok=false with it."""

    def __init__(
        self, config: Config, rows: list[ValRow], *, server_id: str, problem: str = ""
    ) -> None:
        server = config.rollout_server
        self.rows, self.server_id, self.problem = rows, server_id, problem
        self.n = config.actor_rollout_ref.rollout.val_kwargs.n
        self.sampling = val_sampling(config)
        self.shard_index, self.shard_count = server.shard_index, server.shard_count
        # Prompts played at once: what the episode limit holds, at most data.val_batch_size.
        at_once = max(1, server.max_concurrent_episodes // self.n)
        if config.data.val_batch_size is not None:
            at_once = min(at_once, config.data.val_batch_size)
        self._limit = anyio.CapacityLimiter(at_once)

    @classmethod
    def from_config(cls, config: Config, *, server_id: str) -> ValidationRunner:
        """Never raises for validation data problems: they become ``problem``."""
        server = config.rollout_server
        try:
            rows = load_val_rows(
                config.data, shard_index=server.shard_index, shard_count=server.shard_count
            )
        except DataError as e:
            return cls(config, [], server_id=server_id, problem=f"data.val_files unusable: {e}")
        return cls(config, rows, server_id=server_id)

    @property
    def agent_types(self) -> set[str]:
        """Agent types the validation rows need (none when validation cannot run)."""
        return set() if self.problem else {r.agent_type for r in self.rows}

    def check_agents(self, known: Callable[[str], bool]) -> None:
        """Turn validation rows whose agent type nothing provides into a ``problem``."""
        unknown = sorted(a for a in self.agent_types if not known(a))
        if unknown and not self.problem:
            self.problem = f"data.val_files: unknown agent type(s) {', '.join(unknown)}"

    async def answer(
        self,
        req: ValidateRequest,
        engine_version: Callable[[], int],
        changed: Callable[[], Awaitable[None]],
        *,
        deps: Mapping[str, AgentDeps],
        rewards: RewardChoice,
    ) -> ValidateResult:
        """The result of ``req``: once the engine runs ``req.policy_version`` or newer (weights still
        on their way are waited for: ``changed()`` returns when ``engine_version()`` may have moved),
        ``run`` on the version it runs then. With ``req.timeout_s`` set, give up after that long (the
        learner stops waiting then) and answer ok=false."""
        result: ValidateResult | None = None
        with anyio.move_on_after(req.timeout_s if req.timeout_s > 0 else math.inf):
            while engine_version() < req.policy_version:
                await changed()
            result = await self.run(req.request_id, engine_version(), deps=deps, rewards=rewards)
        if result is None:
            version = engine_version()
            result = ValidateResult(
                req.request_id,
                version,
                ok=False,
                error=f"not done within the request's timeout of {req.timeout_s:g} s (weights version {version}, "
                f"{req.policy_version} requested)",
                shard_index=self.shard_index,
                shard_count=self.shard_count,
                prompts=len(self.rows),
                duration_s=req.timeout_s,
            )
        return result

    async def serve(
        self,
        req: ValidateRequest,
        engine_version: Callable[[], int],
        changed: Callable[[], Awaitable[None]],
        *,
        deps: Mapping[str, AgentDeps],
        rewards: RewardChoice,
        reply: Callable[[ValidateResult], bool],
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        """``answer`` one request and ``reply`` with the result (False: the session that asked has
        ended), logging the request and its outcome."""
        log.info(
            "validation requested",
            request=req.request_id,
            policy_version=req.policy_version,
            engine_version=engine_version(),
            prompts=len(self.rows),
            episodes_per_prompt=self.n,
        )
        result = await self.answer(req, engine_version, changed, deps=deps, rewards=rewards)
        sent = reply(result)
        reward = sum(s.reward_sum for s in result.sources) / max(result.count, 1)
        log.info(
            "validation served" if result.ok else "validation failed",
            request=req.request_id,
            policy_version=result.policy_version,
            episodes=result.count,
            reward_mean=round(reward, 4),
            seconds=round(result.duration_s, 2),
            error=result.error or None,
            sent=sent or "no: the session that asked has ended",
        )

    async def run(
        self,
        request_id: str,
        policy_version: int,
        *,
        deps: Mapping[str, AgentDeps],
        rewards: RewardChoice,
    ) -> ValidateResult:
        """Run the shard (every row ``n`` times) with the server's agents (``deps``, whose sampling is
        replaced by the validation sampling) and rewards, and summarise it. ``policy_version``: the
        engine's version at the start. Exceptions other than cancellation become an ok=false result."""
        t0 = time.monotonic()
        result = partial(
            ValidateResult,
            request_id=request_id,
            policy_version=policy_version,
            shard_index=self.shard_index,
            shard_count=self.shard_count,
            prompts=len(self.rows),
        )
        if self.problem:
            return result(ok=False, error=self.problem[:1000])
        episodes: list[EpisodeOutcome] = []
        v = self.sampling
        val_deps = {
            a: replace(
                d,
                sampling=replace(
                    d.sampling, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k, seed=v.seed
                ),
            )
            for a, d in deps.items()  # per agent, and per source with its own tools
        }

        async def one(r: ValRow) -> None:
            async with self._limit:
                result = await run_group(
                    group_uid=f"val-{request_id}-{r.index}",
                    row=r.row,
                    n=self.n,
                    agent_type=r.agent_type,
                    data_source=r.data_source,
                    deps=deps_for(val_deps, r.agent_type, r.data_source),
                    rewards=rewards,
                    server_id=self.server_id,
                )
            episodes.extend(outcomes(result))

        try:
            async with anyio.create_task_group() as tg:
                for r in self.rows:
                    tg.start_soon(one, r)
        except (
            Exception
        ) as e:  # an agent or engine failure: reported to the learner, not fatal here
            while isinstance(e, BaseExceptionGroup):
                e = e.exceptions[0]
            error = f"{type(e).__name__}: {e}"
            return result(ok=False, error=error[:1000], duration_s=time.monotonic() - t0)
        return result(sources=summarize(episodes), duration_s=time.monotonic() - t0)
