"""How long vLLM's own ``add_lora`` takes on a GPU, apart from the rest of an adapter-only update.

One ``AsyncLLM`` with ``enable_lora`` on the model given; six random rank-16 adapters over every
linear of every layer, each written to /dev/shm in peft's format, registered with ``add_lora`` and
used by one short request; the adapter before the last but one is released as in
``rollout_service/engine/vllm_adapters.py``. Prints, per adapter, the seconds of ``add_lora`` and of
the first request that uses it. The engine is otherwise idle: this is the floor of the vLLM part of
an update, to hold against ``weights/apply_s`` of a loaded run.

Run on the device: ``python3 tools/gpu/lora_add_probe.py MODEL_DIR``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RANK = 16
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model: Path, folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head
    shapes = {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    tensors: dict[str, Any] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, fan_in, dtype=torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, RANK, dtype=torch.bfloat16)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config: dict[str, Any] = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK}
    config |= {"lora_alpha": 2 * RANK, "target_modules": list(MODULES), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))


async def probe(model: Path) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(model),
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=3,
        max_cpu_loras=4,
        gpu_memory_utilization=0.5,
        max_model_len=2048,
    )
    llm = AsyncLLM.from_engine_args(args)
    params = SamplingParams(max_tokens=8)

    async def generate(request_id: str, lora: Any) -> float:
        start = time.perf_counter()
        async for _ in llm.generate("hello", params, request_id=request_id, lora_request=lora):
            pass
        return time.perf_counter() - start

    await generate("warm", None)
    for k in range(6):
        folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
        write_adapter(model, folder)
        lora = LoRARequest(f"v{k}", k + 1, str(folder))
        start = time.perf_counter()
        await llm.add_lora(lora)
        added = time.perf_counter() - start
        first = await generate(f"g{k}", lora)
        if k >= 2:
            await llm.remove_lora(k - 1)
        print(f"adapter {k}: add_lora {added:.3f} s  first generate {first:.3f} s", flush=True)
    print(f"generate base {await generate('base', None):.3f} s")
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(probe(Path(sys.argv[1])))
