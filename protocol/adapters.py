"""Adapter-only weight updates (LoRA): how their tensors are named, and the checks a receiver makes.

Design: a weight update is either the whole model (the checkpoint's tensor names) or a LoRA
adapter over the model the receiver already runs, named as peft's ``save_pretrained`` writes one:
``base_model.model.<module>.lora_A.weight`` (rank x in) and ``...lora_B.weight`` (out x rank) for a
linear ``<module>`` whose checkpoint weight is ``<module>.weight`` (out x in). The names alone tell
the two apart: no checkpoint names a tensor so, and the rest of the protocol (announce, chunks,
file hand-over, relays) carries either unchanged. Each adapter version is whole, never a delta of
the previous one, so a server that joins late needs only the newest.

`adapter_problems` checks an announced adapter against the receiver's model before anything is
allocated, as ``protocol.weights.ModelManifest.problems`` does for full weights: every module exists
in the model and is a matrix, A and B come in pairs of one rank no larger than the receiver serves,
shapes match the module, dtypes are floating. Only a receiver that serves adapters
(``max_rank`` > 0) takes one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.messages import TensorSpec

PEFT_PREFIX = "base_model.model."
"""What peft's ``save_pretrained`` puts before a module's name."""
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
"""peft's file names in an adapter directory: ``PeftModel.from_pretrained`` and vLLM read these."""
_LEAVES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


def adapter_parts(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` for a tensor name of a saved adapter; None for any other name."""
    if not name.startswith(PEFT_PREFIX):
        return None
    for leaf, which in _LEAVES.items():
        if name.endswith(leaf):
            module = name[len(PEFT_PREFIX) : -len(leaf)]
            return (module, which) if module else None
    return None


def adapter_name(module: str, which: str) -> str:
    """The saved adapter's name of ``module``'s matrix ``which`` ("A" or "B")."""
    return f"{PEFT_PREFIX}{module}.lora_{which}.weight"


def is_adapter_update(names: Sequence[str]) -> bool:
    """Whether an update's tensors are an adapter (any adapter-named tensor makes it one, so that a
    mix is checked, and refused, as an adapter)."""
    return any(adapter_parts(n) is not None for n in names)


def adapter_rank(shapes: Mapping[str, Sequence[int]]) -> int:
    """The rank of an adapter given as name -> shape (the rows of its A matrices; 0 if none)."""
    return max(
        (s[0] for n, s in shapes.items() if (p := adapter_parts(n)) and p[1] == "A" and s),
        default=0,
    )


def adapter_problems(
    specs: Sequence[TensorSpec],
    base: Mapping[str, tuple[str, tuple[int, ...]]],
    *,
    max_rank: int,
    floating: frozenset[str],
    what: str,
) -> list[tuple[str, str]]:
    """(field, what is wrong) for an announced adapter over the model whose tensors are ``base``
    (name -> (dtype, shape)); empty when the receiver can serve it. ``what`` names the model."""
    if max_rank <= 0:
        return [
            (
                "tensors",
                f"an adapter-only (LoRA) update, but this server does not serve adapters for "
                f"{what}: start it with actor_rollout_ref.model.lora_rank > 0 (and lora.merge "
                "false), or have the learner send merged weights (lora.merge true)",
            )
        ]
    out: list[tuple[str, str]] = []
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for i, s in enumerate(specs):
        parts = adapter_parts(s.name)
        field = f"tensors[{i}]"
        if parts is None:
            out.append((f"{field}.name", f"{s.name[:200]} is not a LoRA adapter tensor"))
            continue
        module, which = parts
        if which in pairs.get(module, {}):
            out.append((f"{field}.name", f"{s.name[:200]} is announced twice"))
            continue
        target = base.get(f"{module}.weight")
        if target is None or len(target[1]) != 2:
            out.append((f"{field}.name", f"{module[:200]} is not a linear layer of {what}"))
            continue
        if s.dtype not in floating:
            out.append((f"{field}.dtype", f"{s.name[:200]}: dtype {s.dtype} is not floating"))
        pairs.setdefault(module, {})[which] = tuple(s.shape)
    for module, got in pairs.items():
        out.extend(_pair_problems(module, got, base[f"{module}.weight"][1], max_rank))
    if not pairs and not out:
        out.append(("tensors", "an adapter update with no tensors"))
    return out


def _pair_problems(
    module: str, got: Mapping[str, tuple[int, ...]], weight: tuple[int, ...], max_rank: int
) -> list[tuple[str, str]]:
    if set(got) != {"A", "B"}:
        missing = "B" if "A" in got else "A"
        return [("tensors", f"{module[:200]}: lora_{missing} is missing")]
    a, b = got["A"], got["B"]
    out_features, in_features = weight
    rank = a[0] if len(a) == 2 else -1
    if len(a) != 2 or len(b) != 2 or a[1] != in_features or b != (out_features, rank):
        return [
            (
                "tensors",
                f"{module[:200]}: lora_A {list(a)} and lora_B {list(b)} do not fit its weight "
                f"{list(weight)} (A is rank x {in_features}, B {out_features} x rank)",
            )
        ]
    if not 0 < rank <= max_rank:
        return [("tensors", f"{module[:200]}: rank {rank}, this server serves up to {max_rank}")]
    return []
