"""A discrete-event model of N rollout servers and a learner of W GPUs, driven by the project's own
policy code.

The policy objects are the real ones, used unchanged:
- the learner's grants, the EDF take, the feasibility wait and the stale drops come from
  ``learner.admission.Admission`` and ``learner.buffer.GroupBuffer``, fed real ``Trajectory``
  objects with per-token versions. The glue between them repeats the few lines of ``learner.intake``
  and ``learner.granting`` (``admit``, ``_can_take``, ``received``), because those parts are fed by
  the learner link's socket and a journal;
- a server starts a group only when its ``rollout_service.granting.GrantBook`` (``may_admit``)
  says so, on the grant the book picks: each ``SimServer`` holds one, as the real server does;
- a finished group is dropped at the server when ``protocol.staleness.group_too_old`` says so.

Everything else is a cost model:
- an engine decodes its running sequences in lock-step: one step of ``c`` sequences takes
  ``GenCosts.step_s(c)``, and every sequence gains one token per step (processor sharing, kept
  exact with a virtual clock). On a GPU shared with the learner, the engine runs at
  ``shared_gpu_share`` of its speed while the learner computes. It stops while it reloads weights;
- an episode is ``turns`` turns of decoding, split evenly over its model tokens, with a tool call
  (``tool_latency_s``) between turns;
- the learner's prepare, update and publish take the batch's tokens times the learner's per-token
  costs, over ``learner_gpus`` GPUs. With ``early_update`` the first mini-batch's share of the
  update and of the reference forward (2/3 of prepare with two mini-batches: the reference runs
  over every sample, the old-logprob forward over the later half) runs in the wait instead, once
  ``learner.early_update.fixed_first`` (the real rule) says the buffer holds it. A new version reaches a server ``applied_s`` after the gather
  starts, plus the transfer time of the fan-out for servers on other hosts.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bench.clustersim.costs import GenCosts, LearnerCosts, Lengths, WeightCosts
from learner.admission import Admission
from learner.buffer import Group, GroupBuffer, GroupKey
from learner.early_update import first_groups, fixed_first
from protocol.staleness import group_too_old
from protocol.trajectory import Trajectory
from rollout_service.granting import GrantBook


@dataclass(frozen=True)
class Setup:
    servers: int
    learner_gpus: int
    batch_groups: int
    n: int
    max_staleness: int
    steps: int
    max_concurrent_episodes: int
    lengths: Lengths
    gen: GenCosts
    learner: LearnerCosts
    weights: WeightCosts
    shared_gpu: bool = False  # one GPU runs the learner and the (single) engine
    # the last this many servers run on the learner's GPU (beside servers of their own GPUs): at
    # ``gen.shared_gpu_share`` of their speed while the learner computes, full speed while it waits
    on_learner_gpu: int = 0
    learner_scaling: float = 1.0  # tok/s per learner GPU at W GPUs, as a share of one GPU's
    transfer_s: Callable[[int], float] = lambda _i: 0.0  # extra delivery time to server i
    admission: bool = True  # learner.admission (false: servers generate ahead, stale drops)
    # actor.first_mini_batch_in_waits: the first of ``mini_batches`` trained in the wait once
    # `learner.early_update.fixed_first` says the buffer holds it (with its reference forward)
    early_update: bool = False
    mini_batches: int = 2


@dataclass
class Wave:
    """The groups that started on one version ``v`` of the weights: when the first started, when
    the last one finished, and the longest episode among them (tokens the engine decoded). Their
    oldest tokens are of version ``v``, so the step of version ``v + k`` is the last that may train
    them."""

    started: float
    last_in: float = float("nan")
    groups: int = 0
    longest_tokens: int = 0


@dataclass
class StepRecord:
    end: float
    wait_s: float
    learn_s: float
    tokens: int
    staleness: list[int]
    dropped: int


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    def run(self, until: Callable[[], bool]) -> None:
        while self._heap and not until():
            self.now, _, fn = heapq.heappop(self._heap)
            self.events += 1
            fn()


class Engine:
    """One vLLM engine: lock-step decoding of the running sequences (virtual-clock processor
    sharing: every running sequence has decoded ``vclock - start`` tokens)."""

    def __init__(self, clock: Clock, gen: GenCosts) -> None:
        self.clock, self.gen = clock, gen
        self.policy_version = 0
        self.vclock = 0.0
        self._last = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._token = 0
        self.paused = False
        self.share = 1.0
        self.decoding_seq_s = 0.0  # sequences decoding x seconds (not while paused)
        self.paused_s = 0.0

    def _rate(self) -> float:
        """Tokens per second of each running sequence."""
        if self.paused or not self._heap:
            return 0.0
        return self.share / self.gen.step_s(len(self._heap))

    def _advance(self) -> None:
        now = self.clock.now
        dt = now - self._last
        self.vclock += dt * self._rate()
        if self.paused:
            self.paused_s += dt
        else:
            self.decoding_seq_s += dt * len(self._heap)
        self._last = now

    def decode(self, tokens: float, done: Callable[[], None]) -> None:
        self._advance()
        heapq.heappush(self._heap, (self.vclock + tokens, next(self._seq), done))
        self._schedule()

    def set(self, *, paused: bool | None = None, share: float | None = None) -> None:
        self._advance()
        if paused is not None:
            self.paused = paused
        if share is not None:
            self.share = share
        self._schedule()

    def _schedule(self) -> None:
        self._token += 1
        rate = self._rate()
        if rate <= 0:
            return
        token = self._token
        dt = max(0.0, (self._heap[0][0] - self.vclock) / rate)
        self.clock.after(dt, lambda: self._fire(token))

    def _fire(self, token: int) -> None:
        if token != self._token:
            return  # superseded by a later change of the rate
        self._advance()
        finished = []
        while self._heap and self._heap[0][0] <= self.vclock + 1e-9:
            finished.append(heapq.heappop(self._heap)[2])
        self._schedule()
        for fn in finished:
            fn()


@dataclass
class Episode:
    turn_tokens: list[int]
    response_tokens: int
    versions: list[int] = field(default_factory=list)  # engine version at each turn's start


class SimServer:
    """A rollout server, admitting groups through the server's own ``GrantBook``."""

    def __init__(self, sim: Simulation, index: int, engine: Engine) -> None:
        s = sim.setup
        self.sim, self.peer, self.engine = sim, f"server-{index}", engine
        self.index = index
        self.book = GrantBook(
            max_concurrent_episodes=s.max_concurrent_episodes, max_staleness=s.max_staleness
        )
        self.book.session(grants=s.admission)
        self._groups = itertools.count()

    def admit(self) -> None:
        """``RolloutServer._admit``'s loop: start groups while the policy allows."""
        n = self.sim.setup.n
        while self.book.may_admit(n, self.engine.policy_version):
            self.book.start(n, self.engine.policy_version)
            self._start_group()

    def _start_group(self) -> None:
        sim = self.sim
        s = sim.setup
        uid = f"{self.peer}-g{next(self._groups)}"
        sim.waves.setdefault(self.engine.policy_version, Wave(started=sim.clock.now))
        lengths = s.lengths.draw(sim.rng, 1, s.n)[0]
        left = s.n
        episodes: list[Episode] = []

        def finished() -> None:
            nonlocal left
            left -= 1
            if not left:
                self._group_done(uid, episodes)

        for turns, model, resp in lengths:
            t, m = int(turns), int(model)
            per = [m // t + (1 if i < m % t else 0) for i in range(t)]
            ep = Episode(per, int(resp))
            episodes.append(ep)
            self._turn(ep, 0, finished)

    def _turn(self, ep: Episode, i: int, finished: Callable[[], None]) -> None:
        ep.versions.append(self.engine.policy_version)

        def decoded() -> None:
            if i + 1 == len(ep.turn_tokens):
                finished()
            else:
                self.sim.clock.after(
                    self.sim.setup.gen.tool_latency_s, lambda: self._turn(ep, i + 1, finished)
                )

        self.engine.decode(max(1, ep.turn_tokens[i]), decoded)

    def _group_done(self, uid: str, episodes: list[Episode]) -> None:
        s = self.sim.setup
        trajs = [self.sim.trajectory(uid, j, ep, self.peer) for j, ep in enumerate(episodes)]
        self.book.finished(s.n)
        wave = self.sim.waves[min(ep.versions[0] for ep in episodes)]
        wave.last_in = self.sim.clock.now
        wave.groups += 1
        wave.longest_tokens = max(wave.longest_tokens, *(sum(ep.turn_tokens) for ep in episodes))
        if group_too_old(trajs, self.book.newest_version, s.max_staleness):
            self.sim.server_dropped += sum(int(np.count_nonzero(t.response_mask)) for t in trajs)
        else:
            self.sim.learner.received(self.peer, trajs)
        self.admit()

    def announce(self, version: int) -> None:
        self.book.announced(version)
        self.admit()

    def applied(self, version: int) -> None:
        self.engine.policy_version = max(self.engine.policy_version, version)
        self.engine.set(paused=False)
        self.announce(version)


class Learner:
    """The trainer's loop (``learner.trainer.train_step``) around the intake's policy objects."""

    def __init__(self, sim: Simulation) -> None:
        s = sim.setup
        self.sim = sim
        self.buffer = GroupBuffer()
        self.admission = Admission(s.batch_groups, s.max_staleness) if s.admission else None
        self.version = 0
        self.remaining = s.steps * s.batch_groups
        self.waiting_since: float | None = 0.0
        self.steps: list[StepRecord] = []
        self._records = itertools.count()
        self.generated = 0
        self.dropped_tokens = 0
        self._scanned = -1  # the version at which the queue was last scanned for stale groups
        self._computing = 0  # the step's compute and the first mini-batch's in the wait
        # the first mini-batch held in this wait: its group keys, seconds it saves, end time
        self._early: tuple[list[GroupKey], float, float] | None = None

    # -- the intake's glue (learner/intake.py, learner/granting.py) ------------------------------
    def admit(self) -> None:
        if self.admission is None:
            return
        held = len(self.buffer) + self.buffer.in_flight
        for peer, n in self.admission.grants(
            held=held, remaining=self.remaining, min_version=self.version
        ):
            server = self.sim.servers_by_peer[peer]
            taken = server.book.granted(n, self.version)
            assert taken, "the simulated servers all take grants when admission is on"
            self.sim.clock.after(0.0, server.admit)

    def received(self, peer: str, trajs: list[Trajectory]) -> None:
        groups = self.buffer.add(next(self._records), trajs)
        self.generated += sum(g.sampled_tokens for g in groups)
        self._drop_stale(groups)
        if self.admission is not None:
            for g in groups:
                self.admission.received(peer, g.oldest_version)
            self.admit()
        self._try_early()
        self.try_step()

    def _set_computing(self, delta: int) -> None:
        self._computing += delta
        self.sim.learner_computing(self._computing > 0)

    def _try_early(self) -> None:
        """In a wait, hold the first mini-batch once the real rule says the buffer fixes it."""
        s = self.sim.setup
        if not s.early_update or self.waiting_since is None or self._early is not None:
            return
        groups = first_groups(s.batch_groups * s.n, s.n, s.mini_batches)
        oldest = self.admission.oldest_generating() if self.admission is not None else None
        bound = -math.inf if self.admission is None else math.inf if oldest is None else oldest
        head = fixed_first(
            self.buffer.by_deadline(), groups, s.n, self.version, s.max_staleness, bound
        )
        if head is None:
            return
        tokens = sum(len(t.prompt_ids) + len(t.response_ids) for g in head for t in g.trajectories)
        gpus = s.learner_gpus * s.learner_scaling
        ref_share = 1 / (1 + (s.mini_batches - 1) / s.mini_batches)
        lc = s.learner
        seconds = tokens / (lc.update_tokens_per_s * gpus)
        seconds += tokens * lc.prepare_s_per_token * ref_share / gpus
        self._early = ([g.key for g in head], seconds, self.sim.clock.now + seconds)
        self._set_computing(+1)
        self.sim.clock.after(seconds, lambda: self._set_computing(-1))

    def _drop_stale(self, new: list[Group] | None = None) -> None:
        k = self.sim.setup.max_staleness
        if self._scanned == self.version and all(g.staleness(self.version) <= k for g in new or []):
            # The queue was scanned at this version already and nothing new is stale: the scan
            # would drop nothing (it is O(queue), and arrivals are one group each here).
            return
        self._scanned = self.version
        out = self.buffer.drop_stale(self.version, k)
        if out.dropped:
            self.dropped_tokens += sum(g.sampled_tokens for g in out.dropped)
            self.admit()

    def _can_take(self, n_groups: int) -> bool:
        if self.admission is None:
            return True
        k = self.sim.setup.max_staleness
        left = [d for g in self.buffer.by_deadline()[n_groups:] if (d := g.deadline(k)) is not None]
        return self.admission.can_take(left, self.version)

    # -- the step ------------------------------------------------------------------------------
    def try_step(self) -> None:
        s = self.sim.setup
        if self.waiting_since is None or len(self.steps) >= s.steps:
            return
        self._drop_stale()
        if len(self.buffer) < s.batch_groups or not self._can_take(s.batch_groups):
            return
        taken = self.buffer.take(s.batch_groups, self.version, s.max_staleness)
        wait = self.sim.clock.now - self.waiting_since
        self.waiting_since = None
        staleness = [g.staleness(self.version) for g in taken.groups]
        tokens = sum(
            len(t.prompt_ids) + len(t.response_ids) for g in taken.groups for t in g.trajectories
        )
        lc = s.learner
        gpus_tok_s = lc.update_tokens_per_s * s.learner_gpus * s.learner_scaling
        compute = tokens * lc.prepare_s_per_token / (s.learner_gpus * s.learner_scaling)
        compute += tokens / gpus_tok_s
        early, self._early = self._early, None
        if early is not None and [g.key for g in taken.groups[: len(early[0])]] == early[0]:
            # the held mini-batch's work is done, or ends before the rest starts
            compute += max(0.0, early[2] - self.sim.clock.now) - early[1]
        start = self.sim.clock.now
        self._set_computing(+1)

        def updated() -> None:
            self._set_computing(-1)
            self.sim.publish(self.version + 1)
            self.sim.clock.after(lc.publish_s, published)

        def published() -> None:
            self.version += 1
            self.buffer.finish([g.key for g in taken.groups])
            self.remaining = max(0, self.remaining - len(taken.groups))
            now = self.sim.clock.now
            self.steps.append(
                StepRecord(now, wait, now - start, tokens, staleness, len(taken.dropped))
            )
            self.admit()
            self.waiting_since = now
            self._try_early()
            self.try_step()

        self.sim.clock.after(compute, updated)


class Simulation:
    def __init__(self, setup: Setup, seed: int = 0) -> None:
        self.setup = setup
        self.rng = np.random.default_rng(seed)
        self.clock = Clock()
        self.server_dropped = 0
        self.learner = Learner(self)
        self.engines = [Engine(self.clock, setup.gen) for _ in range(setup.servers)]
        self.servers = [SimServer(self, i, e) for i, e in enumerate(self.engines)]
        self.servers_by_peer = {s.peer: s for s in self.servers}
        self._traj_ids = itertools.count()
        self.waves: dict[int, Wave] = {}  # start version -> the groups started on it

    def trajectory(self, uid: str, j: int, ep: Episode, peer: str) -> Trajectory:
        versions = np.repeat(np.asarray(ep.versions, dtype=np.int64), ep.turn_tokens)
        model = len(versions)
        tool = max(0, ep.response_tokens - model)
        # the tool's tokens (mask 0) carry the newest version: only sampled tokens set staleness
        versions = np.concatenate([versions, np.full(tool, ep.versions[-1], dtype=np.int64)])
        mask = np.concatenate([np.ones(model, np.uint8), np.zeros(tool, np.uint8)])
        resp = np.zeros(len(mask), np.int32)
        prompt = np.zeros(int(self.setup.lengths.prompt_tokens), np.int32)
        return Trajectory(
            trajectory_id=f"{uid}-{j}-{next(self._traj_ids)}",
            group_uid=uid,
            prompt_ids=prompt,
            response_ids=resp,
            response_mask=mask,
            rollout_logprobs=np.zeros(len(mask), np.float32),
            versions=versions,
            source_server=peer,
        )

    def learner_computing(self, on: bool) -> None:
        s = self.setup
        shared = self.engines if s.shared_gpu else self.engines[s.servers - s.on_learner_gpu :]
        for e in shared:
            e.set(share=s.gen.shared_gpu_share if on else 1.0)

    def publish(self, version: int) -> None:
        """The gather of ``version`` starts: announced at once, applied ``applied_s`` later (plus
        the fan-out's transfer), the engine paused for the reload before that."""
        w = self.setup.weights
        for s in self.servers:
            s.announce(version)
            done = w.applied_s + self.setup.transfer_s(s.index)
            pause = max(0.0, done - w.apply_s)
            self.clock.after(pause, lambda e=s.engine: e.set(paused=True))
            self.clock.after(done, lambda s=s: s.applied(version))

    def run(self) -> Simulation:
        if self.learner.admission is not None:
            for s in self.servers:
                self.learner.admission.joined(
                    s.peer, slots=max(1, self.setup.max_concurrent_episodes // self.setup.n)
                )
            self.learner.admit()
        for s in self.servers:
            self.clock.after(0.0, s.admit)
        self.clock.run(until=lambda: len(self.learner.steps) >= self.setup.steps)
        return self


@dataclass(frozen=True)
class Summary:
    step_s: float
    wait_s: float
    learn_s: float
    tokens_per_s: float
    staleness_mean: float
    staleness_max: int
    waste_frac: float
    events: int
    steps: int


def summarize(sims: list[Simulation], skip: int = 1) -> Summary:
    """Means over the steps after the first ``skip`` (bench/e2e.py's means skip step 1), pooled
    over the simulations (seeds)."""
    steps, waits, learns, toks, stal = [], [], [], [], []
    gen = wasted = events = 0
    smax = 0
    for sim in sims:
        recs = sim.learner.steps
        for prev, r in itertools.pairwise(recs):
            steps.append(r.end - prev.end)
        for r in recs[skip:]:
            waits.append(r.wait_s)
            learns.append(r.learn_s)
            toks.append(r.tokens)
            stal += r.staleness
            smax = max([smax, *r.staleness])
        gen += sim.learner.generated + sim.server_dropped
        wasted += sim.learner.dropped_tokens + sim.server_dropped
        events += sim.clock.events
    step = float(np.mean(steps)) if steps else float("nan")
    return Summary(
        step_s=step,
        wait_s=float(np.mean(waits)),
        learn_s=float(np.mean(learns)),
        tokens_per_s=float(np.mean(toks)) / step if steps else float("nan"),
        staleness_mean=float(np.mean(stal)) if stal else 0.0,
        staleness_max=smax,
        waste_frac=wasted / gen if gen else 0.0,
        events=events,
        steps=len(steps),
    )


def simulate(setup: Setup, seeds: int = 8) -> Summary:
    return summarize([Simulation(setup, seed).run() for seed in range(seeds)])
