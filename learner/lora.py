"""LoRA adapters on the actor (``actor_rollout_ref.model.lora_rank`` > 0): added, merged, saved.

Design: peft injects its LoRA layers into the Hugging Face model in place (`add_adapters`, through
``inject_adapter_in_model``), not behind a ``PeftModel`` wrapper, so the model keeps its class and
its module tree: `learner.model.PolicyHead` and the FSDP2 wrapping (`learner.model.shard`) see the
same decoder layers, and only a targeted linear's parameters are renamed
(``q_proj.weight`` -> ``q_proj.base_layer.weight`` beside ``q_proj.lora_A.default.weight`` and
``q_proj.lora_B.default.weight``). Every other parameter is frozen, so the optimizer holds the
adapters alone (`trainable`). FSDP2 shards a unit's frozen and trainable parameters side by side:
each parameter is its own DTensor, and only those with a gradient are reduce-scattered.

What leaves the learner is named as its readers expect, made from a gathered state dict by pure
functions, never by merging into the training weights (peft's ``merge_adapter`` on sharded DTensors
would have to be undone exactly before the next step):

- `merged`: the full model with ``W + scaling * B @ A`` folded in (float32), under the checkpoint's
  own names; what the Hugging Face export holds, and what rollout servers reload with
  ``actor_rollout_ref.model.lora.merge`` true;
- `adapter_state` / `gather_adapter`: the adapter alone, named as peft's ``save_pretrained`` writes
  it (``base_model.model.<module>.lora_A.weight``, `protocol.adapters`), gathered without the base
  weights: what an adapter-only weight update ships, and what `save_adapter` writes beside the
  export.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from learner.full_tensors import full_tensors
from learner.worker_settings import LoraSettings
from protocol.adapters import ADAPTER_CONFIG, ADAPTER_FILE, PEFT_PREFIX

ADAPTER = "default"
"""peft's name of the one adapter (it appears in parameter names, not in saved files)."""
_BASE = ".base_layer."


def lora_config(s: LoraSettings) -> LoraConfig:
    """peft's config for ``s``, as verl 0.9.1 builds it (``bias="none"``, peft's other defaults:
    no dropout, B initialised to zero so the first policy is the base model)."""
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=s.rank,
        lora_alpha=s.alpha,
        target_modules=_pattern(s.target_modules),
        exclude_modules=_pattern(s.exclude_modules),
        bias="none",
    )


def _pattern(value: str | tuple[str, ...] | None) -> str | list[str] | None:
    return list(value) if isinstance(value, tuple) else value


def add_adapters(lm: torch.nn.Module, s: LoraSettings) -> None:
    """Adapters into ``lm`` in place, before it is sharded; every base parameter frozen."""
    # peft raises naming the patterns when target_modules matches no module of the model.
    inject_adapter_in_model(lora_config(s), lm, adapter_name=ADAPTER)
    for name, p in lm.named_parameters():
        p.requires_grad_(is_adapter(name))


def load_adapter(lm: torch.nn.Module, s: LoraSettings) -> None:
    """The adapters of ``lm`` (just added, not sharded) set from ``s.adapter_path``, a peft adapter
    directory. ValueError naming the file and what does not match: its rank or alpha against
    ``s``, a tensor the model has no adapter for, one it lacks, or a shape."""
    folder = Path(s.adapter_path or "")
    config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    for key, want in (("r", s.rank), ("lora_alpha", s.alpha)):
        if config.get(key) != want:
            raise ValueError(
                f"{folder / ADAPTER_CONFIG}: {key} is {config.get(key)!r}, the run's is {want} "
                "(actor_rollout_ref.model.lora_rank / lora_alpha)"
            )
    params = {peft_name(n): p for n, p in lm.named_parameters() if is_adapter(n)}
    path = folder / ADAPTER_FILE
    tensors = load_file(str(path))
    if unknown := sorted(set(tensors) - set(params)):
        raise ValueError(f"{path}: no adapter of the model is named {unknown[:3]}")
    if missing := sorted(set(params) - set(tensors)):
        raise ValueError(f"{path}: lacks {len(missing)} adapter tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(
                    f"{path}: {name} has shape {list(tensors[name].shape)}, the model's {list(p.shape)}"
                )
            p.copy_(tensors[name].to(p.dtype))


def is_adapter(name: str) -> bool:
    """Whether a parameter of an adapted model belongs to the adapters (peft's own rule, as its
    ``_mark_only_adapters_as_trainable`` and ``get_peft_model_state_dict`` apply it)."""
    return "lora_" in name


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of a plain model, the adapters of an adapted one."""
    return [p for p in model.parameters() if p.requires_grad]


def scalings(lm: torch.nn.Module) -> dict[str, float]:
    """Each adapted module's name -> its adapter's scaling (empty: ``lm`` has no adapters). Read
    from the modules, so a per-module rank or alpha would merge right too."""
    return {
        name: float(m.scaling[ADAPTER])
        for name, m in lm.named_modules()
        if isinstance(m, LoraLayer) and ADAPTER in m.scaling
    }


def merged(sd: Mapping[str, torch.Tensor], scaling: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """The gathered state dict ``sd`` of an adapted model as the plain model's: each adapted
    linear's ``weight`` is ``base + scaling * B @ A`` (computed in float32, kept in the base's
    dtype), its bias keeps its plain name, and the LoRA matrices are gone. ``sd`` is not changed;
    with no adapters it comes back as it is. A LoRA name left over (an adapter kind this does not
    fold, e.g. on an embedding) is an error rather than a tensor the reader would not know."""
    if not scaling:
        return dict(sd)
    a_leaf, b_leaf = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
    folded = {k.removesuffix(a_leaf) for k in sd if k.endswith(a_leaf)}
    matrices = {m + leaf for m in folded for leaf in (a_leaf, b_leaf)}
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        module, base, leaf = key.partition(_BASE)
        if key in matrices:
            continue  # consumed where their base weight is
        if not base or module not in folded:
            out[key] = t
        elif leaf == "weight":
            a, b = sd[module + a_leaf].float(), sd[module + b_leaf].float()
            out[f"{module}.weight"] = (t.float() + scaling[module] * (b @ a)).to(t.dtype)
        else:
            out[f"{module}.{leaf}"] = t  # the bias: adapters leave it alone (bias="none")
    left = [k for k in out if "lora_" in k or _BASE in k]
    if left:
        raise ValueError(f"adapter tensors that merging does not fold: {left[:5]}")
    return out


def peft_name(key: str) -> str:
    """A parameter name of the adapted model -> its name in peft's saved adapter file."""
    return PEFT_PREFIX + key.replace(f".{ADAPTER}", "")  # peft's own rewrite


def adapter_state(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a state dict, under peft's saved names, in name order."""
    return {peft_name(k): sd[k] for k in sorted(sd) if is_adapter(k)}


def gather_adapter(
    lm: torch.nn.Module, rank: int, *, to_cpu: bool = True
) -> dict[str, torch.Tensor] | None:
    """Collective: the full adapter tensors (peft's names, float32) on rank 0, None on the others;
    on the CPU, or left where they were gathered with ``to_cpu`` false (the slot-file writer copies
    them from there). Only the adapters are gathered, all in one collective
    (`learner.full_tensors`), in the same name order on every rank. They are read from the
    parameters themselves: under FSDP2 a parameter keeps its module path as its name, which is its
    state-dict key (adapters are never tied, nor buffers)."""
    params = dict(lm.named_parameters())
    keys = sorted(k for k in params if is_adapter(k))
    whole = full_tensors([params[k].detach() for k in keys])
    if rank != 0:
        return None
    return {peft_name(k): t.cpu() if to_cpu else t for k, t in zip(keys, whole, strict=True)}


def save_adapter(
    directory: Path, tensors: Mapping[str, torch.Tensor], s: LoraSettings, base_model: str
) -> None:
    """``tensors`` (`adapter_state`'s names) as a peft adapter directory: ``PeftModel.from_pretrained``
    and vLLM's LoRA loader read it. The config names the base model it adapts."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / ADAPTER_FILE))
    config = lora_config(s)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(directory))  # adapter_config.json, as peft writes it
