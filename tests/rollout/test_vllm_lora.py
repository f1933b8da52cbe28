"""vLLM loads the learner's LoRA adapter at run time: the directory `learner.lora.save_adapter`
writes (peft's format, as in an export's ``lora_adapter/``) served beside the base model through a
``LoRARequest``, with the logprobs of transformers on the weights the learner publishes merged
(`learner.lora.merged`). The check issue 38 asks for before adapter-only weight updates are built
on it; nightly (one more vLLM engine start) until the rollout server serves adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner import lora
from learner.worker_settings import LoraSettings

pytestmark = pytest.mark.nightly


def test_vllm_serves_the_learners_adapter_as_the_merged_model(
    tiny_model: Path, tmp_path: Path
) -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    s = LoraSettings(rank=8, alpha=16)
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    lora.add_adapters(lm, s)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B != 0, so the adapter changes what the model says
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    sd = lm.state_dict()
    lora.save_adapter(tmp_path / "adapter", lora.adapter_state(sd), s, str(tiny_model))
    merged = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    merged.load_state_dict(lora.merged(sd, lora.scalings(lm)))

    llm = LLM(
        model=str(tiny_model),
        enable_lora=True,
        max_lora_rank=s.rank,
        max_loras=1,
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
        gpu_memory_utilization=0.1,  # on the CPU backend: the share of RAM it reserves
        seed=0,
    )
    prompt = list(range(5, 25))
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    answers = {}
    for key, request in (("base", None), ("lora", LoRARequest("a", 1, str(tmp_path / "adapter")))):
        out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=request)
        o = out[0].outputs[0]
        assert o.logprobs is not None
        answers[key] = (
            list(o.token_ids),
            [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)],
        )
    tokens, logprobs = answers["lora"]
    assert tokens != answers["base"][0], "the adapter changed nothing"
    with torch.no_grad():
        logits = merged(torch.tensor([prompt + tokens])).logits[0].float()
    want = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
        1, torch.tensor(tokens)[:, None]
    )
    torch.testing.assert_close(torch.tensor(logprobs), want[:, 0], rtol=0, atol=1e-4)
