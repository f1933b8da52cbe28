"""What a worker writes and reads: sharded training checkpoints, full weights, Hugging Face export.

Design: training state is saved with torch.distributed.checkpoint (DCP), each rank writing its own
shards in parallel, so saving never gathers a full copy and a checkpoint can be loaded by a
different number of ranks. Per-rank extras (scheduler and RNG states) are small files read back with
``weights_only=True``. Full weights for rollout servers and for export are gathered to rank 0 with
the original checkpoint's tensor names and dtypes (tied weights the checkpoint does not hold are
left out), which is what vLLM's reload and transformers expect; an actor with LoRA adapters is
gathered with them merged in (`policy_state_dict`), and its export also holds the adapter alone.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from common.safetensors_buffers import load_dir
from learner.worker_api import WeightArray
from learner.worker_settings import LoraSettings

TORCH_TO_WIRE = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
}
WIRE_TO_TORCH = {v: k for k, v in TORCH_TO_WIRE.items()}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")
ADAPTER_DIR = "lora_adapter"
"""Where an export with LoRA holds the adapter alone (peft's format), beside the merged model."""


def _full_state_dict(
    module: torch.nn.Module, *, cpu_offload: bool = True
) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return tensors_only(
        get_model_state_dict(
            module, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
        )
    )


def policy_state_dict(
    lm: torch.nn.Module, rank: int, *, cpu_offload: bool = True
) -> dict[str, torch.Tensor] | None:
    """Collective: on rank 0 the policy's full weights under the checkpoint's names (the CPU copy
    with ``cpu_offload``, else where the shards lie), None on the others. LoRA adapters, if any,
    are merged into their base weights (`learner.lora.merged`): readers of full weights never see
    one."""
    # lazy: learner.lora imports peft (and with it transformers)
    from learner import lora

    sd = _full_state_dict(lm, cpu_offload=cpu_offload)
    return lora.merged(sd, lora.scalings(lm)) if rank == 0 else None


def tensors_only(sd: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """A model's state dict as what it holds: tensors (DCP's types also cover optimizer states)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"state dict entry {k} is a {type(v).__name__}, not a tensor")
        out[k] = v
    return out


def select(
    sd: Mapping[str, torch.Tensor], names: Sequence[str], dtypes: Mapping[str, str] | None
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every name in ``names``, cast to ``dtypes[name]`` when given (where the
    tensor lies: a cast on the GPU happens there)."""
    missing = [n for n in names if n not in sd]
    if missing:
        raise KeyError(f"the model has no tensors named {missing[:5]} (has e.g. {sorted(sd)[:5]})")
    out = []
    for n in names:
        t = sd[n].detach()
        out.append((n, t.to(WIRE_TO_TORCH[dtypes[n]]) if dtypes and n in dtypes else t))
    return out


def full_weights(
    lm: torch.nn.Module, names: Sequence[str], rank: int, dtypes: Mapping[str, str] | None = None
) -> list[WeightArray] | None:
    """Collective. On rank 0: (name, wire dtype, shape, raw array) for every name in ``names``, cast
    to ``dtypes[name]`` when given (bf16 travels as its raw 16-bit pattern)."""
    sd = policy_state_dict(lm, rank)
    if sd is None:
        return None
    return [weight_array(n, t) for n, t in select(sd, names, dtypes)]


def weight_array(name: str, t: torch.Tensor) -> WeightArray:
    """A CPU tensor as (name, wire dtype, shape, raw array): bf16 travels as its raw 16-bit pattern."""
    raw = t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.contiguous()
    return WeightArray(name, TORCH_TO_WIRE[t.dtype], tuple(t.shape), raw.numpy())


def save(
    directory: Path,
    models: Mapping[str, torch.nn.Module],
    optims: Mapping[str, torch.optim.Optimizer],
    scheds: Mapping[str, torch.optim.lr_scheduler.LRScheduler],
    rank: int,
) -> None:
    """Collective: DCP shards of every trainable model and its optimizer, plus this rank's extras."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    state = {}
    for role, opt in optims.items():
        msd, osd = get_state_dict(models[role], opt)
        state[f"{role}.model"], state[f"{role}.optim"] = msd, osd
    directory.mkdir(parents=True, exist_ok=True)
    dcp_save(state, checkpoint_id=str(directory / "dcp"))
    extras = {"sched": {r: s.state_dict() for r, s in scheds.items()}, "rng": torch.get_rng_state()}
    torch.save(extras, directory / f"extras-rank{rank}.pt")


def load(
    directory: Path,
    models: Mapping[str, torch.nn.Module],
    optims: Mapping[str, torch.optim.Optimizer],
    scheds: Mapping[str, torch.optim.lr_scheduler.LRScheduler],
    rank: int,
) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    state = {}
    for role, opt in optims.items():
        msd, osd = get_state_dict(models[role], opt)
        state[f"{role}.model"], state[f"{role}.optim"] = msd, osd
    dcp_load(state, checkpoint_id=str(directory / "dcp"))
    for role, opt in optims.items():
        set_state_dict(
            models[role],
            opt,
            model_state_dict=state[f"{role}.model"],
            optim_state_dict=state[f"{role}.optim"],
        )
    extras_file = directory / f"extras-rank{rank}.pt"
    # resumed on more ranks than saved: rank 0's schedule is everyone's
    if not extras_file.exists():
        extras_file = directory / "extras-rank0.pt"
    extras = torch.load(extras_file, weights_only=True)
    for role, sd in extras["sched"].items():
        if role in scheds:
            scheds[role].load_state_dict(sd)
    torch.set_rng_state(extras["rng"])


def export_hf(
    lm: torch.nn.Module,
    directory: Path,
    source_dir: Path,
    rank: int,
    lora_settings: LoraSettings | None = None,
) -> None:
    """Collective: a Hugging Face model directory (safetensors, config, tokenizer) on rank 0,
    loadable by transformers and vLLM as is. With LoRA the model's weights are the merged ones and
    the adapter alone is written beside them, in peft's format, into ``ADAPTER_DIR``."""
    from transformers import PreTrainedModel

    # lazy: learner.lora imports peft (and with it transformers)
    from learner import lora

    assert isinstance(lm, PreTrainedModel)  # FSDP2 subclasses the model's own class in place
    gathered = _full_state_dict(lm)
    if rank != 0:
        return
    sd = lora.merged(gathered, lora.scalings(lm))
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in source_dir.iterdir():  # config, tokenizer, chat template, generation config
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, tmp / f.name)
    source_dtype = getattr(lm.config, "dtype", None) or torch.float32
    if isinstance(source_dtype, str):
        source_dtype = getattr(torch, source_dtype)
    # Gathering unties tied weights (lm_head = embeddings): keep exactly the source checkpoint's names.

    names = {t.name for t in load_dir(source_dir)}
    sd = {
        k: v.to(source_dtype) if v.is_floating_point() else v for k, v in sd.items() if k in names
    }
    lm.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
    if lora_settings is not None:
        adapter = lora.adapter_state(gathered)
        lora.save_adapter(tmp / ADAPTER_DIR, adapter, lora_settings, str(source_dir))
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
