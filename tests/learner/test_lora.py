"""LoRA on the actor (`learner.lora`): the merge and the adapter's names agree with peft's own, and
on 2 FSDP2 ranks over gloo (one chained run) only the adapters train, the base stays as it was,
every full-weights path publishes ``W + scaling * B @ A`` under the checkpoint's names, the loss
falls on a fixed batch, the export loads in transformers (merged) and in peft (the adapter), and a
checkpoint resumes."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.numpy import load_file
from test_fsdp_workers import make_samples, settings
from transformers import AutoModelForCausalLM

from learner import lora
from learner.checkpoint_io import ADAPTER_DIR
from learner.samples import Sample, split_for_ranks
from learner.worker_api import (
    AdapterFileRequest,
    AdapterRequest,
    UpdateRequest,
    WeightsFileRequest,
    WeightsRequest,
)
from learner.worker_settings import LoraSettings
from protocol.adapters import ADAPTER_CONFIG

OWN_RAY_CLUSTER = True  # tests/conftest.py: runs in the serial pass

LORA = LoraSettings(rank=4, alpha=8)


def _adapted(model: Path, s: LoraSettings = LORA) -> torch.nn.Module:
    """The tiny model with adapters whose B is not zero (so merging changes the weights)."""
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    lora.add_adapters(lm, s)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return lm


def test_merge_and_names_match_peft(tiny_model: Path) -> None:
    """`merged` is peft's own merge (``merge_and_unload``) under the plain model's names, only the
    adapters are trainable, and `adapter_state` names tensors as peft's ``save_pretrained`` does."""
    lm = _adapted(tiny_model)
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    assert all(lora.is_adapter(n) == p.requires_grad for n, p in lm.named_parameters())
    assert {n for n, _ in lm.named_parameters() if lora.is_adapter(n)}, "nothing adapted"
    ours = lora.merged(lm.state_dict(), lora.scalings(lm))
    assert set(ours) == set(plain.state_dict())
    assert set(lora.scalings(lm).values()) == {LORA.scaling}

    # peft's reference: the same adapters through a PeftModel, merged by peft
    ref = get_peft_model(plain, lora.lora_config(LORA))
    ref.load_state_dict({lora.PEFT_PREFIX + k: v for k, v in lm.state_dict().items()}, strict=True)
    saved = get_peft_model_state_dict(ref)
    adapter = lora.adapter_state(lm.state_dict())
    assert list(adapter) == sorted(saved)
    for n, t in adapter.items():
        torch.testing.assert_close(t, saved[n], rtol=0, atol=0)
    want = ref.merge_and_unload().state_dict()
    for n, t in ours.items():
        torch.testing.assert_close(t, want[n], rtol=1e-6, atol=1e-6, msg=n)


def test_merge_refuses_an_adapter_kind_it_does_not_fold(tiny_model: Path) -> None:
    """An embedding adapter (``lora_embedding_A``) is not merged: named, rather than leaked."""
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    lora.add_adapters(lm, LoraSettings(rank=2, target_modules=("embed_tokens", "q_proj")))
    with pytest.raises(ValueError, match="lora_embedding"):
        lora.merged(lm.state_dict(), lora.scalings(lm))


# -- on 2 FSDP2 ranks ------------------------------------------------------------------------------


async def _chain(model: Path, tmp: Path) -> dict[str, Any]:
    """One LoRA run on 2 ranks: adapters before and after 4 updates of one fixed batch, the full
    weights by both paths, the export, and a checkpoint loaded back after one more update."""
    from learner.prepare import reduce_worker_metrics
    from learner.workers import WorkerGroup

    names = [n for n in load_file(str(model / "model.safetensors"))]
    samples: list[Sample] = make_samples(8, seed=11)
    out: dict[str, Any] = {"losses": []}

    async def full(group: WorkerGroup) -> dict[str, np.ndarray]:
        return {w.name: w.array for w in await group.full_weights(WeightsRequest(names))}

    async def adapter(group: WorkerGroup) -> dict[str, np.ndarray]:
        return {w.name: w.array for w in await group.adapter_weights(AdapterRequest())}

    group = WorkerGroup(settings(model, lr=1e-2, lora=LORA), 2)
    try:
        out["info"] = (await group.start())[0]
        out["adapter0"], out["full0"] = await adapter(group), await full(group)
        for _ in range(4):
            plans = split_for_ranks(samples, mini_batches=1, ranks=2, micro_size=2)
            res = await group.update([UpdateRequest("actor", p) for p in plans])
            out["losses"].append(reduce_worker_metrics(res, "actor")["actor/pg_loss"])
        out["adapter"], out["full"] = await adapter(group), await full(group)
        dtypes = {n: "bfloat16" for n in names}
        path = tmp / "slot" / "model.safetensors"
        path.parent.mkdir()
        await group.write_weights_file(
            WeightsFileRequest(WeightsRequest(names, dtypes), 0, str(path))
        )
        adapter_slot = tmp / "adapter-slot" / "model.safetensors"
        adapter_slot.parent.mkdir()
        out["adapter_written"] = await group.write_adapter_file(
            AdapterFileRequest("bfloat16", 1, str(adapter_slot))
        )
        out["adapter_bf16"] = {
            w.name: w.array for w in await group.adapter_weights(AdapterRequest("bfloat16"))
        }
        out["bf16"] = {
            w.name: w.array for w in await group.full_weights(WeightsRequest(names, dtypes))
        }
        await group.export_hf(str(tmp / "hf"), str(model))
        # a checkpoint round trip: saved, trained past, loaded back
        await group.save_checkpoint(str(tmp / "ckpt"))
        await group.update([UpdateRequest("actor", p) for p in plans])
        out["moved_on"] = await full(group)
        await group.load_checkpoint(str(tmp / "ckpt"))
        out["resumed"] = await full(group)
    finally:
        group.shutdown()
    return out


@pytest.mark.e2e
def test_lora_trains_adapters_only_and_publishes_merged_weights(
    tiny_model: Path, ray_cluster: Any, tmp_path: Path
) -> None:
    out = anyio.run(lambda: _chain(tiny_model, tmp_path))
    base = load_file(str(tiny_model / "model.safetensors"))
    info = out["info"]
    assert 0 < info.trainable_params < info.params / 10, info

    # B starts at zero: the first policy is the base model, bit for bit
    assert all(not a.any() for n, a in out["adapter0"].items() if n.endswith("lora_B.weight"))
    for n, a in out["full0"].items():
        np.testing.assert_array_equal(a, base[n], err_msg=n)

    # the loss falls on the fixed batch; the adapters moved
    losses = out["losses"]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < losses[0] - 0.01, losses
    adapter = out["adapter"]
    assert set(adapter) == set(out["adapter0"]) and all(
        n.startswith(lora.PEFT_PREFIX) and ".default." not in n for n in adapter
    )
    assert any(a.any() for n, a in adapter.items() if n.endswith("lora_B.weight"))

    # published = W + scaling * B @ A for adapted linears, the base bit for bit elsewhere
    full = out["full"]
    assert set(full) == set(base)
    adapted = 0
    for n, w in full.items():
        module = n.removesuffix(".weight")
        a_name = f"{lora.PEFT_PREFIX}{module}.lora_A.weight"
        if a_name not in adapter:
            np.testing.assert_array_equal(w, base[n], err_msg=n)
            continue
        adapted += 1
        b = adapter[f"{lora.PEFT_PREFIX}{module}.lora_B.weight"]
        want = base[n] + LORA.scaling * (b @ adapter[a_name])
        np.testing.assert_allclose(w, want, rtol=0, atol=1e-6, err_msg=n)
        assert not np.array_equal(w, base[n]), n
    assert adapted == 7 * 2  # q k v o gate up down, in each of the 2 layers

    # the slot file holds the bytes the chunked path sends
    from common.safetensors_buffers import load_file as load_raw

    written = {t.name: bytes(t.data) for t in load_raw(tmp_path / "slot" / "model.safetensors")}
    assert written == {n: a.tobytes() for n, a in out["bf16"].items()}
    # and rank 0's adapter file (adapter-only updates) the adapter's, as Ray brings it back
    written = {
        t.name: bytes(t.data) for t in load_raw(tmp_path / "adapter-slot" / "model.safetensors")
    }
    assert written == {n: a.tobytes() for n, a in out["adapter_bf16"].items()}
    assert out["adapter_written"].bytes == sum(len(b) for b in written.values())

    # the export: merged weights in transformers, the adapter alone in peft
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    sd = exported.state_dict()
    for n, w in full.items():
        np.testing.assert_array_equal(sd[n].numpy(), w, err_msg=n)
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    peft_lm = PeftModel.from_pretrained(plain, str(tmp_path / "hf" / ADAPTER_DIR))
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(peft_lm(ids).logits, exported(ids).logits, rtol=1e-5, atol=1e-5)
    assert isinstance(peft_lm.peft_config["default"], LoraConfig)
    assert (tmp_path / "hf" / ADAPTER_DIR / ADAPTER_CONFIG).is_file()

    # the trained base, as the checkpoint holds it, is the model's bit for bit
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "ckpt" / "dcp", tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["actor.model"]
    bases = {k: v for k, v in saved.items() if ".base_layer." in k}
    assert sum(k.endswith(".base_layer.weight") for k in bases) == adapted
    for k, v in bases.items():
        plain = k.removeprefix("lm.").replace(".base_layer.", ".")
        np.testing.assert_array_equal(v.numpy(), base[plain], err_msg=k)

    # the checkpoint brings back the policy it saved, past a later update
    assert any(not np.array_equal(out["moved_on"][n], w) for n, w in full.items())
    for n, w in full.items():
        np.testing.assert_array_equal(out["resumed"][n], w, err_msg=n)
