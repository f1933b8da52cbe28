"""bench/e2e.py's configurations: each ``max_staleness`` value, crossed with the variants.

A variant is a name and bin/train overrides, e.g.
``--variant 'early:actor_rollout_ref.actor.first_mini_batch_in_waits=true'``; the base
configuration (no name, no overrides) always runs. A run's configuration is its label:
``sync`` / ``async-sK`` for the base, with ``+NAME`` for a variant (``async-s2+early``), so the
summary's per-configuration figures and its ratios against ``sync`` (the base sync run, never a
variant's) need nothing else. A run's key is (repeat, max_staleness, variant name): what --resume
matches and what stays pending.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


@dataclass(frozen=True)
class Variant:
    name: str = ""  # "": the base configuration
    overrides: tuple[str, ...] = field(default_factory=tuple)


BASE = Variant()


def parse_variant(text: str) -> Variant:
    """``NAME:KEY=VALUE [KEY=VALUE ...]`` (overrides separated by spaces); ValueError naming what
    is wrong."""
    name, sep, rest = text.partition(":")
    if not sep or not NAME.fullmatch(name):
        raise ValueError(
            f"{text!r}: a variant is NAME:KEY=VALUE [KEY=VALUE ...], NAME of lower-case letters, "
            "digits, - and _ (at most 32)"
        )
    overrides = tuple(rest.split())
    bad = [o for o in overrides if "=" not in o]
    if not overrides or bad:
        raise ValueError(f"{text!r}: overrides must be key=value (got {bad or rest!r})")
    return Variant(name, overrides)


def variants(texts: list[str]) -> list[Variant]:
    """The base configuration, then each ``--variant`` in order; ValueError on a bad or repeated
    name."""
    out = [BASE, *(parse_variant(t) for t in texts)]
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must differ (got {names[1:]})")
    return out


def label(staleness: int, variant: Variant = BASE) -> str:
    base = "sync" if staleness == 0 else f"async-s{staleness}"
    return f"{base}+{variant.name}" if variant.name else base


def schedule(
    staleness: list[int], repeats: int, configs: list[Variant]
) -> list[tuple[int, int, Variant]]:
    """(repeat, max_staleness, variant) in run order: every configuration once, then again
    (interleaved, so that a drift of the machine hits every configuration alike)."""
    return [(r, s, v) for r in range(1, repeats + 1) for s in staleness for v in configs]


def run_key(run: dict[str, Any]) -> tuple[int, int, str]:
    """A run record's (repeat, max_staleness, variant name); records from before variants are the
    base's."""
    return int(run.get("repeat", 1)), int(run["max_staleness"]), str(run.get("variant", ""))


def is_base_sync(run: dict[str, Any]) -> bool:
    return run["max_staleness"] == 0 and not run.get("variant")
