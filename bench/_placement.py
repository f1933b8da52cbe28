"""Where a bench's training job runs: the learner's GPUs and each rollout server's, from one string
(``--placement``), and the bin/train overrides that put the processes there.

Syntax: entries separated by ``;``, each ``learner=GPUS`` (exactly one) or
``rollout=GPUS[@FRACTION]`` (one per rollout server, rs0 first), GPUS a comma-separated list of
CUDA ordinals as nvidia-smi numbers them:
- ``learner=0;rollout=0``: one GPU shared by the learner and a rollout server (``--gpus 1``);
- ``learner=0;rollout=1``: the learner on GPU 0, a rollout server on GPU 1 (``--gpus 2``);
- ``learner=0,1;rollout=2;rollout=3``: a learner of 2 FSDP ranks (NCCL) on GPUs 0-1, a rollout
  server on each of GPUs 2 and 3;
- ``learner=0;rollout=0;rollout=1``: as ``--gpus 2``, plus a second rollout server on the
  learner's GPU that generates while the learner waits.
A rollout server holds tensor_model_parallel_size GPUs (the length of its list, the same for every
server). FRACTION is vLLM's gpu_memory_utilization for that server. By default a server gets
SHARED_FRACTION of a GPU the learner trains on (the learner keeps the rest) and OWN_FRACTION of a
GPU it does not, divided among the servers on that GPU. "Colocated" means some rollout server
shares a GPU with the learner, "split" that none does.

Mapping, on a GPU: ``launch.learner_gpus`` and ``trainer.n_gpus_per_node`` (one FSDP rank per
learner GPU), ``launch.rollout_servers``, ``launch.rollout_gpus`` (each server's
CUDA_VISIBLE_DEVICES), ``launch.rollout_gpu_memory_utilization`` (each server's share) and
``actor_rollout_ref.rollout.tensor_model_parallel_size``. On the CPU only the counts apply, so the
same string rehearses the shape: as many learner ranks (gloo) and rollout servers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

SHARED_FRACTION = 0.35
"""vLLM's share of a GPU the learner trains on (the one-GPU configs' value: the learner fits)."""
OWN_FRACTION = 0.8
"""vLLM's share of a GPU without the learner (what --gpus 2 always gave the rollout server)."""
LEARNER_MIN_SHARE = 0.3
"""Of a GPU the learner trains on, what the rollout servers there must leave it at least."""
SHORTHANDS = {1: "learner=0;rollout=0", 2: "learner=0;rollout=1"}
"""--gpus N."""


class PlacementError(ValueError):
    """A placement that cannot be parsed or run; the message names the entry or GPU at fault."""


@dataclass(frozen=True)
class Server:
    """One rollout server: its GPUs and, when given, its share of their memory."""

    gpus: tuple[int, ...]
    fraction: float | None = None


@dataclass(frozen=True)
class Placement:
    learner: tuple[int, ...]
    servers: tuple[Server, ...]

    @property
    def spec(self) -> str:
        """The placement written back in the syntax, as the JSON and the labels name it."""

        def gpus(g: Sequence[int]) -> str:
            return ",".join(map(str, g))

        servers = [
            f"rollout={gpus(s.gpus)}" + (f"@{s.fraction:g}" if s.fraction is not None else "")
            for s in self.servers
        ]
        return ";".join([f"learner={gpus(self.learner)}", *servers])

    @property
    def slug(self) -> str:
        """The spec in a file name: ``learner=0,1;rollout=2@0.5`` -> ``l0-1_r2at0.5``."""
        out = self.spec.replace("learner=", "l").replace("rollout=", "r")
        return out.replace(";", "_").replace(",", "-").replace("@", "at")

    @property
    def gpus(self) -> list[int]:
        """Every GPU it uses."""
        return sorted({*self.learner, *(g for s in self.servers for g in s.gpus)})

    @property
    def colocated(self) -> bool:
        return any(set(s.gpus) & set(self.learner) for s in self.servers)

    def fractions(self) -> list[float]:
        """Each server's vLLM share: its own, else the default rule on its most crowded GPU."""
        out = []
        for s in self.servers:
            if s.fraction is not None:
                out.append(s.fraction)
                continue
            shares = []
            for g in s.gpus:
                base = SHARED_FRACTION if g in self.learner else OWN_FRACTION
                shares.append(base / sum(g in t.gpus for t in self.servers))
            out.append(round(min(shares), 4))
        return out

    def describe(self) -> str:
        """In words, for tables and plot titles."""

        def on(gpus: Sequence[int]) -> str:
            return f"GPU{'s' if len(gpus) > 1 else ''} {','.join(map(str, gpus))}"

        ranks = len(self.learner)
        where = ", ".join(
            f"rs{i} on {on(s.gpus)} (vLLM {f:g})"
            for i, (s, f) in enumerate(zip(self.servers, self.fractions(), strict=True))
        )
        return (
            f"learner on {on(self.learner)} ({ranks} rank{'s' if ranks > 1 else ''}); "
            f"rollout {where}; " + ("colocated" if self.colocated else "split")
        )

    def overrides(self, device: str) -> list[str]:
        """The bin/train overrides that realise it on ``device`` (cuda: the GPUs and memory
        shares; cpu: the counts only)."""
        counts = [
            f"trainer.n_gpus_per_node={len(self.learner)}",
            f"launch.rollout_servers={len(self.servers)}",
        ]
        if device != "cuda":
            return counts
        return [
            *counts,
            f"launch.learner_gpus={json.dumps(list(self.learner), separators=(',', ':'))}",
            f"launch.rollout_gpus={json.dumps([list(s.gpus) for s in self.servers], separators=(',', ':'))}",
            f"launch.rollout_gpu_memory_utilization={json.dumps(self.fractions(), separators=(',', ':'))}",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={len(self.servers[0].gpus)}",
        ]

    def as_json(self) -> dict[str, object]:
        return {
            "spec": self.spec,
            "learner_gpus": list(self.learner),
            "learner_ranks": len(self.learner),
            "rollout_gpus": [list(s.gpus) for s in self.servers],
            "rollout_servers": len(self.servers),
            "gpu_memory_utilization": self.fractions(),
            "colocated": self.colocated,
            "gpus": self.gpus,
            "description": self.describe(),
        }


def _gpu_list(entry: str, text: str) -> tuple[int, ...]:
    try:
        gpus = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise PlacementError(
            f"{entry!r}: GPUs are comma-separated CUDA ordinals (got {text!r})"
        ) from None
    if any(g < 0 for g in gpus):
        raise PlacementError(f"{entry!r}: a GPU ordinal is >= 0")
    if len(set(gpus)) != len(gpus):
        raise PlacementError(f"{entry!r}: names a GPU twice")
    return gpus


def _server(entry: str, value: str) -> Server:
    gpus, at, share = value.partition("@")
    if not at:
        return Server(_gpu_list(entry, gpus))
    try:
        fraction = float(share)
    except ValueError:
        raise PlacementError(f"{entry!r}: @FRACTION is a number (got {share!r})") from None
    if not 0 < fraction < 1:
        raise PlacementError(f"{entry!r}: @FRACTION is a share of the GPU, in (0, 1)")
    return Server(_gpu_list(entry, gpus), fraction)


def parse(text: str) -> Placement:
    """A placement from its syntax (see the module's docstring); PlacementError names the fault."""
    learner: tuple[int, ...] | None = None
    servers: list[Server] = []
    for raw in text.split(";"):
        entry = raw.strip()
        role, eq, value = (x.strip() for x in entry.partition("="))
        if not eq or role not in ("learner", "rollout") or not value:
            raise PlacementError(
                f"{entry!r}: each entry is learner=GPUS or rollout=GPUS[@FRACTION], entries "
                "separated by ';' (e.g. 'learner=0,1;rollout=2;rollout=3')"
            )
        if role == "rollout":
            servers.append(_server(entry, value))
        elif learner is not None:
            raise PlacementError(f"{entry!r}: one learner entry only (its ranks are its GPUs)")
        else:
            learner = _gpu_list(entry, value)
    if learner is None:
        raise PlacementError(f"{text!r}: no learner=GPUS entry")
    if not servers:
        raise PlacementError(f"{text!r}: no rollout=GPUS entry (one per rollout server)")
    placement = Placement(learner, tuple(servers))
    check(placement)
    return placement


def check(p: Placement) -> None:
    """What a placement must hold whatever the machine: servers of one tensor-parallel size, and
    per GPU, vLLM's shares within it (leaving the learner LEARNER_MIN_SHARE of its GPUs)."""
    sizes = {len(s.gpus) for s in p.servers}
    if len(sizes) > 1:
        raise PlacementError(
            f"{p.spec!r}: every rollout server holds as many GPUs (its tensor parallelism; got "
            f"{sorted(sizes)})"
        )
    fractions = p.fractions()
    for gpu in p.gpus:
        on = [
            (i, f)
            for i, (s, f) in enumerate(zip(p.servers, fractions, strict=True))
            if gpu in s.gpus
        ]
        limit = 1 - LEARNER_MIN_SHARE if gpu in p.learner else 1.0
        if sum(f for _, f in on) > limit + 1e-9:
            asked = " + ".join(f"rs{i} {f:g}" for i, f in on)
            whose = f" and leave the learner {LEARNER_MIN_SHARE:g}" if gpu in p.learner else ""
            raise PlacementError(
                f"{p.spec!r}: GPU {gpu}: the rollout servers ask vLLM for {asked}; together they "
                f"may ask at most {limit:g}{whose}"
            )


def check_gpus(p: Placement, available: int) -> None:
    """Every GPU it names exists on a machine of ``available`` GPUs."""
    missing = [g for g in p.gpus if g >= available]
    if missing:
        have = f"GPUs 0-{available - 1}" if available > 1 else ("GPU 0" if available else "no GPU")
        raise PlacementError(
            f"{p.spec!r} names GPU {', '.join(map(str, missing))}: this machine has {have}"
        )


def conflicts(p: Placement, overrides: Sequence[str], device: str) -> list[str]:
    """The overrides that set a key the placement decides on ``device``: they would contradict it
    (on a GPU vLLM's share too, which the placement gives per server)."""
    keys = {o.split("=", 1)[0] for o in p.overrides(device)}
    if device == "cuda":
        keys.add("actor_rollout_ref.rollout.gpu_memory_utilization")
    return [o for o in overrides if o.split("=", 1)[0].strip() in keys]
