"""The rollout server: admits prompt groups, runs them on the engine, ships them, applies weights.

Design: one task group owns everything (shipper + protocol client, stats logger, the connection's
event loop, admission loop, one task per running group, one per validation request), so any
failure or a signal cancels all of it and the ``finally`` blocks close the connection (BYE) and
shut the engine down. ``RolloutServer`` builds the parts, runs the groups and hands each event of
the connection to the part it is about (``_events``), one at a time. The connection itself is
the ``shipper``'s (``rollout_service.connecting.build_shipper`` assembles it from the config):

- ``book`` (``rollout_service.granting.GrantBook``, sans-IO): the rollout half of admission,
  the only place where policy lives: whether the next group may start (room, weights lag, a
  waiting drain, the learner's grants of protocol 1.3) and on which grant.
- ``weights`` (``rollout_service.weights_applier.WeightApplier``): loads each version the learner
  sends into the running engine (``on_weight_update``: keep, abort or drain) and answers
  WEIGHTS_APPLIED; ``weight_assembler`` checks what the learner announces before anything is
  received.
- ``validation`` (``rollout_service.validation.ValidationRunner``): each VALIDATE_REQUEST becomes a
  task of the group (``_validate``) that waits until the engine runs the requested policy version
  (or newer), runs the shard of ``data.val_files`` beside training admission under its own limit
  and answers with metrics only, never shipping an episode.

A change that may let a group start or a request go on (a group finished, grants, an announce, a
load) pokes ``_changed``, which admission and validation wait on. Groups finish out of order; each
is shipped whole, or dropped whole when its token age is past ``max_staleness``, and its prompt is
committed to the data cursor only when the learner acknowledges the batch holding it, so a restart
redoes in-flight prompts and never skips one.

Timeline: the server appends ``RUN_DIR/timeline/rollout-<server id>.jsonl`` (``common.timeline``;
RUN_DIR is ``trainer.run_dir``, shared with the learner, not the server's own subdirectory):
its generation counters (requests and episodes in flight, grants held, tokens sampled, weight
version) every ``SAMPLE_INTERVAL_S`` from a task of the serving group, and a span per weight load.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

import rollout_service.rewards as rewards_pkg
import rollout_service.tools as tools_pkg
from common.logging import get_logger
from common.ratelimit import GlobalRateLimiter, set_shared
from common.run_events import Kind, emit
from common.rundir import resolve_run_dir
from common.timeline import Role, TimelineWriter, sample_every, timeline_path
from protocol.events import (
    Connected,
    GroupsAdmitted,
    PeerClosed,
    PeerTimedOut,
    ValidationRequested,
    WeightsAnnounced,
    WeightsFailed,
    WeightsReceived,
)
from protocol.messages import ADMISSION_CAPABILITY, ValidateRequest
from protocol.staleness import group_too_old
from rollout_service.agents import load_builtin_agents
from rollout_service.agents.base import AGENTS, AgentDeps, AgentLimits, deps_for, source_deps_key
from rollout_service.agents.parsers import PARSERS
from rollout_service.agents.rendering import ChatRenderer
from rollout_service.connecting import build_shipper
from rollout_service.data import PromptSource
from rollout_service.engine.base import (
    DetachedEngine,
    Engine,
    EngineOutputError,
    SamplingSettings,
)
from rollout_service.errors import StartupError
from rollout_service.granting import GrantBook
from rollout_service.groups import RewardChoice, run_group
from rollout_service.metrics import CountingEngine, RolloutStats, run_stats_logger
from rollout_service.prompt_memory import PromptMemory
from rollout_service.rewards.base import REWARDS
from rollout_service.shipping import ShippingError
from rollout_service.tools.factory import build_tools, close_tools
from rollout_service.tools.limited import rate_limited
from rollout_service.validation import ValidationRunner
from rollout_service.weights_applier import WeightApplier

if TYPE_CHECKING:
    from common.config import Config


def agent_limits(config: Config) -> AgentLimits:
    rollout, mt, server = (
        config.actor_rollout_ref.rollout,
        config.actor_rollout_ref.rollout.multi_turn,
        config.rollout_server,
    )
    return AgentLimits(
        response_length=rollout.response_budget,
        max_model_len=rollout.max_model_len or rollout.prompt_budget + rollout.response_budget,
        max_tokens_per_turn=mt.max_tokens_per_turn,
        max_assistant_turns=mt.max_assistant_turns,
        max_user_turns=mt.max_user_turns,
        max_parallel_calls=mt.max_parallel_calls,
        max_tool_response_length=mt.max_tool_response_length,
        tool_response_truncate_side=mt.tool_response_truncate_side,
        max_consecutive_tool_errors=mt.max_consecutive_tool_errors,
        tool_timeout_s=server.tool_timeout_s,
    )


def sampling_settings(config: Config) -> SamplingSettings:
    r = config.actor_rollout_ref.rollout
    return SamplingSettings(
        max_tokens=r.response_budget,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        seed=None,
    )


@dataclass(frozen=True)
class AgentSetup:
    tools: list[str]  # tool names the agent offers
    options: Any = None  # its config section
    needs: tuple[str, ...] = ()  # tools it cannot run without, whatever a source names


# agent type -> what it needs from the config; agents not listed use multi_turn.tools.
AGENT_SETUPS: dict[str, Callable[[Any], AgentSetup]] = {
    "single_turn": lambda c: AgentSetup([]),
    "statelm": lambda c: AgentSetup(list(c.agents.statelm.tools), c.agents.statelm),
    "code": lambda c: AgentSetup(["python"], c.agents.code, needs=("python",)),
}


def agent_setup(config: Config, agent_type: str) -> AgentSetup:
    make = AGENT_SETUPS.get(agent_type)
    return (
        make(config)
        if make
        else AgentSetup(list(config.actor_rollout_ref.rollout.multi_turn.tools))
    )


def source_tools(config: Config) -> dict[tuple[str, str], list[str]]:
    """(agent type, source) -> the tools that ``data.datasets[].tools`` gives the source's agent."""
    data = config.data
    return {
        (d.agent_type or data.agent_type, d.name): list(d.tools)
        for d in data.datasets
        if d.tools is not None
    }


def build_agent_deps(
    config: Config, base: AgentDeps, agent_types: set[str], limiter: Any
) -> dict[str, AgentDeps]:
    """Per agent type, its tools (local or remote, rate-limited where a bucket is configured; one
    build, so remote tools share one client) and options; and per source that names its own tools
    (``source_deps_key``), the same agent with those tools. Look a row's up with ``deps_for``."""
    setups = {a: agent_setup(config, a) for a in sorted(agent_types)}
    per_source = {
        source_deps_key(a, src): replace(setups[a], tools=tools)
        for (a, src), tools in source_tools(config).items()
        if a in setups
    }
    setups = {**setups, **per_source}
    names = list(dict.fromkeys(n for s in setups.values() for n in s.tools))
    tools = rate_limited(build_tools(config, names), limiter)
    return {
        a: replace(base, tools={n: tools[n] for n in s.tools}, options=s.options)
        for a, s in setups.items()
    }


def check_names(config: Config, agent_types: set[str]) -> None:
    """Fail at start-up, naming the config key, for any agent or reward name nothing provides
    (unknown tools are reported by the tool factory, which also knows the tool server's)."""
    rewards_pkg.load_builtin_rewards()
    load_builtin_agents()
    problems = [
        f"agent type {a!r} (data rows / data.agent_type / data.datasets[].agent_type): "
        f"known: {', '.join(AGENTS.names())}"
        for a in sorted(agent_types)
        if a not in AGENTS
    ]
    server = config.rollout_server
    for key, name in [
        ("rollout_server.reward_fn", server.reward_fn),
        *(
            (f"rollout_server.reward_by_data_source.{k}", v)
            for k, v in server.reward_by_data_source.items()
        ),
    ]:
        if name not in REWARDS:
            problems.append(
                f"{key}: unknown reward function {name!r}; known: {', '.join(REWARDS.names())}"
            )
    for i, d in enumerate(config.data.datasets):
        if d.tools is None:  # the agent's own list, which holds what it needs
            continue
        agent = d.agent_type or config.data.agent_type
        missing = [n for n in agent_setup(config, agent).needs if n not in d.tools]
        if missing:  # else every episode of the source would fail when its agent is built
            problems.append(
                f"data.datasets.{i}.tools: the {agent} agent cannot run without "
                f"{', '.join(map(repr, missing))} (got {d.tools})"
            )
    # else (tools.remote.url set) the tool factory checks, knowing what the server serves
    if config.tools.remote.url is None:
        registry = tools_pkg.load_builtin_tools()
        keys = {"statelm": "agents.statelm.tools"}
        # tool_agent always: multi_turn.tools are checked in any case
        for agent in sorted({a for a in agent_types if a in AGENTS} | {"tool_agent"}):
            key = keys.get(agent, "actor_rollout_ref.rollout.multi_turn.tools")
            for name in agent_setup(config, agent).tools:
                if name not in registry:
                    problems.append(
                        f"{key}: unknown tool {name!r}; known: {', '.join(registry.names())}"
                    )
        for i, d in enumerate(config.data.datasets):
            for name in d.tools or ():
                if name not in registry:
                    problems.append(
                        f"data.datasets.{i}.tools: unknown tool {name!r}; "
                        f"known: {', '.join(registry.names())}"
                    )
    if problems:
        raise StartupError("; ".join(dict.fromkeys(problems)))


def _first_leaf(
    group: BaseExceptionGroup, kind: type[BaseException] | tuple[type[BaseException], ...]
) -> BaseException | None:
    sub = group.subgroup(lambda e: isinstance(e, kind))
    while isinstance(sub, BaseExceptionGroup):
        sub = sub.exceptions[0]
    return sub


def shard_state_dir(config: Config, run_dir: Path) -> tuple[Path, Any]:
    """Where a shard's data cursor and spool live, and the lock held on it (release when done).

    Keyed by shard, not by server id (which defaults to host-pid): a restarted server of the same
    shard finds the prompts and batches its predecessor left. Two live servers on one shard would
    both ship the same prompts, so the second is refused.
    """
    from filelock import FileLock, Timeout

    server = config.rollout_server
    root = resolve_run_dir(config) if run_dir.is_relative_to(resolve_run_dir(config)) else run_dir
    path = root / "rollout-state" / f"shard-{server.shard_index}-of-{server.shard_count}"
    path.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path / "lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise StartupError(
            f"shard {server.shard_index} of {server.shard_count} is in use by "
            f"another rollout server ({path / 'lock'}); give this one another "
            "rollout_server.shard_index"
        ) from None
    return path, lock


class RolloutServer:
    def __init__(self, config: Config, run_dir: Path, *, engine: Engine | None = None) -> None:
        """Everything but the engine is checked and built here, so a bad name or data file fails
        before the (slow) engine starts; ``attach_engine`` completes the server."""
        from transformers import AutoTokenizer

        self.config, self.run_dir = config, run_dir
        self.engine: Engine = engine if engine is not None else DetachedEngine()
        server = config.rollout_server
        self.server_id = server.resolved_server_id()
        self.log = get_logger("rollout_service.server", server_id=self.server_id)
        self.state_dir, self._state_lock = shard_state_dir(config, run_dir)
        self.source = PromptSource.from_config(
            config.data,
            shard_index=server.shard_index,
            shard_count=server.shard_count,
            state_dir=self.state_dir,
        )
        check_names(config, {r.agent_type for r in self.source.rows})
        memory = server.prompt_memory
        self.memory = PromptMemory(
            memory.last_k, memory.skip_epochs, config.algorithm.filter_groups.metric
        )
        self.validation = ValidationRunner.from_config(config, server_id=self.server_id)
        # a bad validation set never stops training
        self.validation.check_agents(lambda a: a in AGENTS)
        if self.validation.problem:
            self.log.warning(
                "validation unavailable: requests will be answered with this error",
                reason=self.validation.problem,
            )
        self.stats = RolloutStats(server_id=self.server_id)
        self.timeline = TimelineWriter.off()  # opened by run()
        self.renderer = ChatRenderer(
            AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
        )
        mt = config.actor_rollout_ref.rollout.multi_turn
        self.limiter = GlobalRateLimiter.from_config(
            config.tools.rate_limits, resolve_run_dir(config)
        )
        set_shared(self.limiter)  # reward functions that call external APIs take tokens from it
        base = AgentDeps(
            engine=CountingEngine(self.engine, self.stats),
            renderer=self.renderer,
            sampling=sampling_settings(config),
            limits=agent_limits(config),
            parser=PARSERS.get(mt.format)(),
        )
        try:
            self.deps = build_agent_deps(
                config,
                base,
                {r.agent_type for r in self.source.rows} | self.validation.agent_types,
                self.limiter,
            )
        except ValueError as e:
            self._state_lock.release()
            raise StartupError(str(e)) from None
        self.rewards = RewardChoice(server.reward_fn, dict(server.reward_by_data_source))
        self.book = GrantBook(
            max_concurrent_episodes=server.max_concurrent_episodes,
            max_staleness=config.actor_rollout_ref.rollout.max_staleness,
            on_held=self._grants_held,
        )
        self._changed = anyio.Event()  # replaced by the next on every _poke
        self._tasks: Any = None  # the serving task group (validation requests run in it)

    @property
    def newest_version(self) -> int:
        """The newest policy version the learner announced (``GrantBook.newest_version``)."""
        return self.book.newest_version

    def attach_engine(self, engine: Engine) -> None:
        self.engine = engine
        counted = CountingEngine(engine, self.stats)  # the agents' requests, for the timeline
        for deps in self.deps.values():
            deps.engine = counted

    async def run(self, *, max_groups: int | None = None) -> None:
        """Serve until cancelled (signal) or, with ``max_groups``, until that many groups shipped.
        Raises ShippingError when the learner refuses this server for good, EngineOutputError when
        the engine's output is corrupt."""
        server = self.config.rollout_server
        self.shipper = build_shipper(
            self.config,
            server_id=self.server_id,
            engine=self.engine,
            state_dir=self.state_dir,
            stats=self.stats,
            log=self.log,
            on_recovered_acked=self.source.commit_groups,
        )
        if server.metrics_port is not None:
            port = self.stats.start_metrics_server(server.metrics_port, server.metrics_host)
            self.log.info("metrics endpoint", url=f"http://{server.metrics_host}:{port}/metrics")
        self.timeline = TimelineWriter(  # in the run's shared directory, beside the learner's
            timeline_path(resolve_run_dir(self.config), Role.ROLLOUT, self.server_id),
            role=Role.ROLLOUT,
            name=self.server_id,
        )
        self.weights = WeightApplier(
            self.engine,
            self.shipper.client,
            self.book,
            on_weight_update=self.config.actor_rollout_ref.rollout.on_weight_update,
            stats=self.stats,
            timeline=self.timeline,
            log=self.log,
            wake=self._poke,
            changed=self._wait_changed,
        )
        try:
            await self._serve(max_groups)
        except BaseExceptionGroup as group:
            # Refused for good, or a corrupt engine: one clear error, not a task tree.
            fatal = _first_leaf(group, (ShippingError, EngineOutputError))
            if fatal is None:
                raise
            raise fatal from None
        finally:
            self.stats.stop_metrics_server()
            self.timeline.close()
            self._state_lock.release()
            set_shared(None)
            with anyio.CancelScope(shield=True):
                await close_tools({n: t for d in self.deps.values() for n, t in d.tools.items()})

    async def _serve(self, max_groups: int | None) -> None:
        server = self.config.rollout_server
        async with anyio.create_task_group() as tg:
            self._tasks = tg  # validation requests run as tasks of this group
            tg.start_soon(self._signals, tg.cancel_scope)
            await tg.start(self.shipper.run)
            self.source.hold_groups(self.shipper.recovered_group_uids)  # resent, not rerun
            tg.start_soon(run_stats_logger, self.stats, server.stats_interval_s, self.log)
            tg.start_soon(sample_every, self.timeline, self.stats.timeline_counters)
            tg.start_soon(self._events)
            await self._admit(tg, max_groups)
            await self.shipper.flush()
            await self.shipper.drain()
            await self.shipper.close("done")
            tg.cancel_scope.cancel()

    async def _signals(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                self.log.warning("stopping on signal", signal=signal.Signals(signum).name)
                with anyio.CancelScope(shield=True):
                    await self.shipper.close("rollout server stopping")
                scope.cancel()
                return

    # -- admission ---------------------------------------------------------------------------------
    def _poke(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_changed(self) -> None:
        await self._changed.wait()

    def _grants_held(self, held: int) -> None:
        self.stats.gauges.granted_groups = held

    async def _admit(self, tg: Any, max_groups: int | None) -> None:
        n, book = self.config.actor_rollout_ref.rollout.n, self.book
        done = anyio.Event()
        started = finished = 0

        async def group(item: Any, grant: int | None, session: int) -> None:
            nonlocal finished
            try:
                await self._run_group(item, grant, session)
            finally:
                book.finished(n)
                finished += 1
                if max_groups is not None and finished >= max_groups:
                    done.set()
                self._poke()

        for item in self.source:
            if max_groups is not None and started >= max_groups:
                break
            while not book.may_admit(n, self.engine.policy_version):
                await self._changed.wait()
            # Asked once the group could start, so that the groups finished meanwhile count.
            if self.memory.skips(item.index, item.epoch):
                # Uniform its last times (rollout_service.prompt_memory): done, without a grant.
                self.source.commit(item)
                self.stats.counters.prompts_skipped = self.memory.skipped
                # A whole epoch may be skipped in a row: let the other tasks run meanwhile.
                await anyio.lowlevel.checkpoint()
                continue
            grant = book.start(n, self.engine.policy_version)
            started += 1
            tg.start_soon(group, item, grant, book.sessions)
        if max_groups is not None and started:
            await done.wait()

    async def _run_group(self, item: Any, grant: int | None, session: int) -> None:
        rollout = self.config.actor_rollout_ref.rollout
        for _ in range(rollout.n):
            self.stats.episode_started()
        try:
            result = await run_group(
                group_uid=item.group_uid,
                row=item.row,
                n=rollout.n,
                agent_type=item.agent_type,
                data_source=item.data_source,
                deps=deps_for(self.deps, item.agent_type, item.data_source),
                rewards=self.rewards,
                server_id=self.server_id,
                remax=self.config.algorithm.adv_estimator == "remax",
            )
        except BaseException:
            for _ in range(rollout.n):
                self.stats.episode_abandoned()
            raise
        for ep in result.episodes:
            self.stats.episode_finished(
                generated_tokens=int(sum(ep.mask)),
                turns=ep.turns,
                tool_calls=ep.tool_calls,
                tool_errors=ep.tool_errors,
                actions=ep.action_counts(),
                data_source=ep.data_source,
            )
        if self.memory.record(item.index, item.epoch, result.trajectories):
            self.log.debug("prompt skipped from now on", index=item.index, epoch=item.epoch)
        if group_too_old(result.trajectories, self.newest_version, rollout.max_staleness):
            self.stats.staleness_dropped(
                len(result.trajectories),
                sum(int(np.count_nonzero(t.response_mask)) for t in result.trajectories),
            )
            # The learner counts it as waste (HEARTBEAT dropped_tokens).
            self.shipper.client.conn.dropped_tokens = self.stats.counters.dropped_tokens
            self.log.info(
                "group dropped: too stale", group=item.group_uid, newest_version=self.newest_version
            )
            self.source.commit(item)  # dropped on purpose: not to be redone
            return
        await self.shipper.ship_group(
            result.trajectories,
            on_acked=lambda: self.source.commit(item),
            on_refused=lambda: self._refused(item.group_uid, grant, session),
        )
        if self.book.groups <= 1:  # the last one running: nothing else will fill its batch soon
            await self.shipper.flush()

    def _refused(self, group_uid: str, grant: int | None, session: int) -> None:
        """The learner refused the batch holding this group (the shipper logged why and kept it
        under spool/rejected). Its prompt stays done: rerunning it would likely meet the same. But
        the learner still counts its grant as generating, and would wait for it forever: the grant
        goes to the next prompt instead."""
        if grant is not None and self.book.refused(grant, session):
            self.log.warning(
                "a refused group's grant goes to another prompt", group=group_uid, min_version=grant
            )
            self._poke()

    # -- the connection's events ---------------------------------------------------------------------
    async def _events(self) -> None:
        """Each event of the connection to the part it is about, one at a time: a weight load (a
        drain's wait included) holds back the events after it."""
        async for ev in self.shipper.events:
            if isinstance(ev, Connected):
                emit(Kind.CONNECTED, self.server_id)  # for bin/train (common/run_events.py)
                # A learner that grants groups says so; grants of an earlier session are void.
                self.book.session(grants=ADMISSION_CAPABILITY in ev.welcome.capabilities)
                self.weights.announce(ev.welcome.policy_version)
                self._poke()
            elif isinstance(ev, GroupsAdmitted):
                if self.book.granted(ev.groups, ev.min_version):
                    self._poke()
            elif isinstance(ev, PeerClosed | PeerTimedOut):
                emit(Kind.DISCONNECTED, self.server_id)
                # Said, because what follows is quiet: unacked batches wait for the next session,
                # and admission stops once they fill the window.
                if isinstance(ev, PeerTimedOut):
                    self.log.warning(
                        "learner silent past the WELCOME's heartbeat timeout: reconnecting"
                    )
                else:
                    self.log.info("learner said BYE: reconnecting", reason=ev.reason)
                self.book.session_ended()
            elif isinstance(ev, WeightsAnnounced):
                self.weights.announce(ev.version)
            elif isinstance(ev, WeightsReceived):
                await self.weights.apply(ev.weights)
            elif isinstance(ev, WeightsFailed):
                self.weights.transfer_failed(ev)
            elif isinstance(ev, ValidationRequested):
                self._tasks.start_soon(self._validate, ev.request)

    # -- validation --------------------------------------------------------------------------------
    async def _validate(self, req: ValidateRequest) -> None:
        """Answer one validation request with its metrics (``ValidationRunner.serve``: on the
        requested version or newer, within the request's timeout)."""
        await self.validation.serve(
            req,
            lambda: self.engine.policy_version,
            self._wait_changed,  # poked when weights are applied
            deps=self.deps,
            rewards=self.rewards,
            reply=self.shipper.client.validation_result,
            log=self.log,
        )
