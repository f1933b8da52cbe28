"""Packed (padding-free) micro-batches give the padded numbers, and token-capped micro-batches
respect their cap and hold every sample exactly once.

The model tests run the tiny Qwen2 unsharded in this process (the heads and the loss are the ones
the FSDP workers run; tests/learner/test_fsdp_workers.py covers the sharded path)."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from learner.samples import (
    Batching,
    Sample,
    count_tokens,
    micro_batches,
    split_for_ranks,
    split_forward,
)

CPU = torch.device("cpu")


def mixed_samples(n: int, seed: int = 0, vocab: int = 500) -> list[Sample]:
    """Short and long sequences together, as agentic batches are (lengths 3 .. ~120)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(2, 12))
        r = int(rng.integers(1, 6)) if i % 3 else int(rng.integers(40, 110))
        ids = rng.integers(0, vocab, p + r).astype(np.int64)
        mask = (rng.random(r) > 0.2).astype(np.float32)
        s = Sample(ids, p, mask)
        s.old_logprobs = (-rng.random(r) * 3).astype(np.float32) * mask
        s.advantages = rng.normal(size=r).astype(np.float32) * mask
        s.rollout_logprobs = (-rng.random(r) * 3).astype(np.float32) * mask
        out.append(s)
    return out


@pytest.fixture(scope="module")
def policy(tiny_model: Path) -> Any:
    from learner.model import PolicyHead, load_causal_lm

    torch.manual_seed(0)
    lm = load_causal_lm(str(tiny_model), trust_remote_code=False, gradient_checkpointing=False)
    return PolicyHead(lm, temperature=0.7).train()


def training_pass(policy: Any, samples: list[Sample], b: Any) -> tuple[Any, ...]:
    """(logprobs, entropy, loss, metrics, gradients) of the actor's loss on micro-batch ``b``."""
    from learner.model import policy_outputs
    from learner.samples import MiniBatchPlan
    from learner.update import actor_micro_loss
    from learner.worker_settings import WorkerSettings

    plan = MiniBatchPlan(
        [samples], count_tokens(samples), len(samples), max(s.response_len for s in samples)
    )
    s = WorkerSettings(model_path="", entropy_coeff=0.01)
    policy.zero_grad(set_to_none=True)
    loss, metrics = actor_micro_loss(policy, b, plan, s, world=1)
    loss.backward()
    with torch.no_grad():
        logp, ent = policy_outputs(policy, b, with_entropy=True)
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return logp, ent, float(loss.detach()), metrics, grads


def assert_same_pass(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    (lp1, e1, l1, m1, g1), (lp0, e0, l0, m0, g0) = got, want
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e1, e0, atol=1e-5, rtol=1e-5)
    assert l1 == pytest.approx(l0, abs=1e-6)
    assert m1.keys() == m0.keys()
    for k in m0:
        assert m1[k] == pytest.approx(m0[k], abs=1e-5, rel=1e-5), k
    assert g1.keys() == g0.keys() and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=1e-4, msg=n)


def test_packed_and_padded_give_the_same_logprobs_loss_and_gradient(policy: Any) -> None:
    from learner.model import collate

    samples = mixed_samples(7)
    got = {}
    for packed in (False, True):
        b = collate(samples, CPU, packed=packed)
        assert b.packed == packed
        if packed:  # one row, no padding anywhere
            assert b.input_ids.shape == (1, sum(len(x.input_ids) for x in samples))
        got[packed] = training_pass(policy, samples, b)
    assert_same_pass(got[True], got[False])
    valid = collate(samples, CPU).response_valid
    assert not got[False][0][~valid].any(), "nothing past a response"


def test_packed_micro_batches_under_gradient_checkpointing(tiny_model: Path) -> None:
    """The packing arguments reach the attention through checkpointed layers, and the recompute in
    backward gives the same gradient."""
    from learner.model import PolicyHead, collate, load_causal_lm, policy_outputs

    b = collate(mixed_samples(5, seed=1), CPU, packed=True)
    grads = []
    for checkpointing in (False, True):
        head = PolicyHead(
            load_causal_lm(
                str(tiny_model), trust_remote_code=False, gradient_checkpointing=checkpointing
            )
        ).train()
        logp, _ = policy_outputs(head, b)
        logp.sum().backward()
        grads.append({n: p.grad for n, p in head.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-6, rtol=1e-5, msg=n)


def test_packed_logprobs_match_a_plain_transformers_forward(policy: Any, tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from learner.model import collate, policy_outputs

    samples = mixed_samples(5, seed=4)
    with torch.no_grad():
        logp, _ = policy_outputs(policy, collate(samples, CPU, packed=True))
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    for i, s in enumerate(samples):
        with torch.no_grad():
            logits = lm(torch.from_numpy(s.input_ids)[None]).logits[0] / 0.7
        want = torch.log_softmax(logits[s.prompt_len - 1 : -1], -1).gather(
            1, torch.from_numpy(s.input_ids[s.prompt_len :])[:, None]
        )[:, 0]
        torch.testing.assert_close(logp[i, : s.response_len], want, atol=1e-5, rtol=1e-5)


def test_packed_values_match_padded(tiny_model: Path) -> None:
    from learner.model import ValueHead, collate, load_value_model, value_outputs

    torch.manual_seed(0)
    head = ValueHead(load_value_model(str(tiny_model), trust_remote_code=False)).eval()
    samples = mixed_samples(6, seed=2)
    with torch.no_grad():
        padded = value_outputs(head, collate(samples, CPU))
        packed = value_outputs(head, collate(samples, CPU, packed=True))
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)


def test_a_packed_batch_refuses_a_model_without_the_packed_attention(tiny_model: Path) -> None:
    """Any other attention would let the packed sequences see each other, silently."""
    from transformers import AutoModelForCausalLM

    from learner.model import PolicyHead, collate, policy_outputs

    lm = AutoModelForCausalLM.from_pretrained(
        str(tiny_model), dtype=torch.float32, attn_implementation="sdpa"
    )
    with pytest.raises(ValueError, match="attn_implementation"):
        policy_outputs(PolicyHead(lm), collate(mixed_samples(3), CPU, packed=True))


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize(
    ("n", "ranks", "cap"), [(40, 1, 200), (40, 2, 150), (13, 4, 120), (3, 2, 60)]
)
def test_token_capped_micro_batches(n: int, ranks: int, cap: int, packed: bool) -> None:
    samples = mixed_samples(n, seed=n + ranks)
    batching = Batching(max_tokens=cap, packed=packed)
    plans = split_for_ranks(samples, mini_batches=1, ranks=ranks, batching=batching)
    ids = {id(s): i for i, s in enumerate(samples)}
    seen = []
    counts = {len(p[0].micro_batches) for p in plans}
    assert len(counts) == 1, "every rank runs the same number of micro-batches"
    for rank in plans:
        assert rank[0].packed == packed
        for micro in rank[0].micro_batches:
            lengths = [len(s.input_ids) for s in micro]
            assert len(micro) == 1 or batching.cost(lengths) <= cap, (lengths, cap)
            assert lengths == sorted(lengths)
            seen += [ids[id(s)] for s in micro if id(s) in ids]
            assert all(not s.response_mask.any() for s in micro if id(s) not in ids), (
                "dummies train nothing"
            )
    assert sorted(seen) == list(range(n)), "every sample exactly once"
    assert plans[0][0].num_tokens == count_tokens(samples)
    fwd = split_forward(samples, ranks=ranks, batching=batching)
    assert sorted(i for rank in fwd for m in rank for i in m if i >= 0) == list(range(n))
    for rank in fwd:
        for m in rank:
            real = [len(samples[i].input_ids) for i in m if i >= 0]
            assert len(real) <= 1 or batching.cost(real) <= cap


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_shared_prefix_counts_once_under_the_token_cap(ranks: int) -> None:
    """Every row that collate lays out stays under the cap, every sample runs once, and a
    micro-batch holds the sequences its shared row has room for, not what their full lengths
    would fit."""
    from learner.model import collate

    samples = prefixed_samples(24, prefix=300, seed=5)
    cap = 1200
    share = Batching(max_tokens=cap, packed=True, share_prefix=True)
    plans = split_for_ranks(samples, mini_batches=1, ranks=ranks, batching=share)
    ids = {id(s): i for i, s in enumerate(samples)}
    seen: list[int] = []
    for rank in plans:
        assert rank[0].share_prefix
        for micro in rank[0].micro_batches:
            assert collate(micro, CPU, packed=True, share_prefix=True).input_ids.numel() <= cap
            seen += [ids[id(s)] for s in micro if id(s) in ids]
    assert sorted(seen) == list(range(len(samples)))
    unshared = split_for_ranks(
        samples, mini_batches=1, ranks=ranks, batching=Batching(max_tokens=cap, packed=True)
    )
    assert len(plans[0][0].micro_batches) < len(unshared[0][0].micro_batches)
    fwd = split_forward(samples, ranks=ranks, batching=share)
    assert sorted(i for rank in fwd for m in rank for i in m if i >= 0) == list(range(24))
    for rank in fwd:
        for m in rank:
            real = [samples[i] for i in m if i >= 0]
            assert collate(real, CPU, packed=True, share_prefix=True).input_ids.numel() <= cap


def test_token_cap_balances_micro_batches_and_ranks() -> None:
    lengths = [300, 10, 10, 250, 40, 40, 40, 120, 100, 90, 80, 5, 5, 5, 200, 60]
    bins = micro_batches(lengths, Batching(max_tokens=400, packed=True))
    costs = [sum(lengths[i] for i in b) for b in bins]
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert max(costs) <= 400 and len(bins) == -(-sum(lengths) // 400)  # as few as the cap allows
    assert max(costs) - min(costs) <= max(lengths) // 2, costs
    samples = [Sample(np.zeros(n, np.int64), 1, np.ones(n - 1, np.float32)) for n in lengths]
    plans = split_for_ranks(
        samples, mini_batches=1, ranks=2, batching=Batching(max_tokens=400, packed=True)
    )
    loads = [
        sum(len(s.input_ids) for m in p[0].micro_batches for s in m if s.response_mask.any())
        for p in plans
    ]
    assert abs(loads[0] - loads[1]) <= max(lengths) // 2, loads
    assert sorted(micro_batches([500, 20], Batching(max_tokens=100))) == [[0], [1]], (
        "a long sequence runs alone"
    )


def config(**kw: Any) -> Any:
    """The config fields learner.prepare reads."""
    off = SimpleNamespace(
        old_logprobs="recompute", skip_old_logprob_forward="auto", is_level="token", is_cap=2.0
    )
    off.__dict__.update(kw.pop("off_policy", {}))
    actor = SimpleNamespace(
        off_policy=off,
        ppo_epochs=1,
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=1000,
    )
    actor.__dict__.update(kw.pop("actor", {}))
    return SimpleNamespace(
        actor_rollout_ref=SimpleNamespace(
            actor=actor,
            rollout=SimpleNamespace(n=4),
            model=SimpleNamespace(use_remove_padding=True, share_prefix=True),
        ),
        algorithm=SimpleNamespace(
            use_kl_in_reward=kw.pop("use_kl_in_reward", False),
            rollout_correction=SimpleNamespace(active=kw.pop("rollout_correction", False)),
        ),
        data=SimpleNamespace(train_batch_size=2),
        trainer=SimpleNamespace(critic_warmup=kw.pop("critic_warmup", 0), device="cpu"),
    )


@pytest.mark.parametrize(
    ("kw", "skips"),
    [
        ({}, True),
        ({"off_policy": {"is_level": "sequence", "is_cap": 3.0}}, True),
        ({"actor": {"ppo_epochs": 2}}, False),
        ({"actor": {"ppo_mini_batch_size": 4}}, True),  # two optimizer steps: the first's from it
        ({"use_kl_in_reward": True}, False),  # the reward needs old logprobs before the update
        ({"off_policy": {"skip_old_logprob_forward": "never"}}, False),
        ({"off_policy": {"old_logprobs": "rollout"}}, False),
        ({"critic_warmup": 1}, False),  # no actor update this step
        # verl's rollout correction is of the whole batch (weights, rejection before advantages)
        ({"rollout_correction": True}, False),
    ],
)
def test_the_rule_for_old_logprobs_from_the_update(kw: dict[str, Any], skips: bool) -> None:
    from learner.prepare import batching, old_logprob_parts, old_logprobs_from_update

    got = old_logprobs_from_update(config(**kw), step=0)
    assert (got is not None) == skips
    if got is not None:
        off = config(**kw).actor_rollout_ref.actor.off_policy
        assert (got.is_level, got.is_cap, got.from_own_forward) == (off.is_level, off.is_cap, True)
    # 8 samples: the forward before the update runs the mini-batches after the first only
    mini = config(**kw).actor_rollout_ref.actor.ppo_mini_batch_size
    assert old_logprob_parts(config(**kw), 8) == [
        list(range(i, i + mini)) for i in range(mini, 8, mini)
    ]
    assert batching(config()) == Batching(
        micro_size=2, max_tokens=1000, packed=True, share_prefix=True
    )
    assert batching(config(actor={"use_dynamic_bsz": False}), 3) == Batching(
        micro_size=3, packed=True, share_prefix=True
    )


def test_packing_needs_a_varlen_kernel_on_a_gpu() -> None:
    from learner.prepare import batching

    assert batching(config(), can_pack=False) == Batching(
        micro_size=2, max_tokens=1000, packed=False
    )
    assert batching(config(), can_share=False) == Batching(
        micro_size=2, max_tokens=1000, packed=True
    )


def _loop_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None,
    align: str = "end",
) -> torch.Tensor:
    """A `VarlenKernel` made of one SDPA call per sequence; ``align``: where causality is aligned
    when a sequence has fewer queries than keys ("end", as flash attention; "start", as SDPA's
    is_causal), or "none" (not causal)."""
    rep = q.size(1) // k.size(1)
    out = []
    for (a, b), (c, d) in zip(
        itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=True
    ):
        seen = torch.ones(b - a, d - c, dtype=torch.bool)
        if align != "none":
            seen = seen.tril((d - c) - (b - a) if align == "end" else 0)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1)[None],
                k[c:d].repeat_interleave(rep, 1).transpose(0, 1)[None],
                v[c:d].repeat_interleave(rep, 1).transpose(0, 1)[None],
                attn_mask=seen,
                scale=scale,
            )[0].transpose(0, 1)
        )
    return torch.cat(out)


def test_a_varlen_kernel_is_used_only_when_it_matches_sdpa() -> None:
    """The checks that guard torch's prototype varlen_attn: a kernel that computes per-sequence
    causal attention passes, one that is not causal or that raises is refused with the reason; for
    shared-prefix rows, one whose causality is aligned at the start of fewer queries than keys
    (rather than at their end) is refused too, though it passes the plain check."""
    from learner.varlen import check_varlen_kernel, torch_varlen_kernel

    assert check_varlen_kernel(_loop_kernel, CPU, torch.float32) is None
    assert check_varlen_kernel(_loop_kernel, CPU, torch.float32, prefix=7) is None
    problem = check_varlen_kernel(lambda *a: _loop_kernel(*a, align="none"), CPU, torch.float32)
    assert problem is not None and "output differs" in problem
    start = functools.partial(_loop_kernel, align="start")
    assert check_varlen_kernel(start, CPU, torch.float32) is None
    for prefix in (7, 200):  # the long one: parts longer than a kernel's tile
        assert check_varlen_kernel(_loop_kernel, CPU, torch.float32, prefix=prefix) is None
        problem = check_varlen_kernel(start, CPU, torch.float32, prefix=prefix)
        assert problem is not None and "output differs" in problem
    kernel = torch_varlen_kernel()  # torch 2.13 has one; CUDA only
    if kernel is not None:
        # refused on the CPU, no raise
        assert check_varlen_kernel(kernel, CPU, torch.float32) is not None


@pytest.mark.parametrize(
    ("kernel", "prefixed", "shares"),
    [(False, False, True), (True, False, False), (True, True, True)],
)
def test_a_gpu_shares_prefixes_only_where_its_kernel_runs_them(
    monkeypatch: pytest.MonkeyPatch, kernel: bool, prefixed: bool, shares: bool
) -> None:
    """No varlen kernel: shared rows take the per-sequence path, as on the CPU. A kernel that
    failed the prefixed check: nothing is shared (the kernel stays in use for unshared rows)."""
    from learner import varlen

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(varlen, "_varlen_kernel", lambda d: _loop_kernel if kernel else None)
    monkeypatch.setattr(varlen, "_prefix_kernel", lambda d: _loop_kernel if prefixed else None)
    assert varlen.can_share_prefix(gpu) is shares
    assert varlen.can_share_prefix(CPU)


def test_a_shared_prefix_row_through_a_varlen_kernel_is_the_per_sequence_one() -> None:
    """What packed_attention does on CUDA with a shared prefix (each part's keys gathered as
    [prefix | part], one kernel call) gives the per-part SDPA path's output and gradients."""
    from learner.attention import _prefixed_attention
    from learner.varlen import prefix_key_layout, run_prefixed

    bounds = (0, 9, 14, 26, 29)  # a 9-token prefix, then parts of 5, 12 and 3 tokens
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 29, 16, generator=gen).requires_grad_() for h in (4, 2, 2))
    keys = prefix_key_layout(bounds, CPU)
    assert keys.longest == (12, 21) and keys.cu_seqlens.tolist() == [0, 9, 23, 44, 56]
    module = torch.nn.Module()
    module.num_key_value_groups = 2  # what transformers' SDPA path reads to repeat k/v heads
    module.is_causal = True
    want = _prefixed_attention(module, q, k, v, bounds, 0.0, 0.25)  # [1, N, heads, D]
    cu = torch.tensor(bounds, dtype=torch.int32)
    got = run_prefixed(
        _loop_kernel, *(x[0].transpose(0, 1) for x in (q, k, v)), cu, keys, 0.25
    ).unsqueeze(0)
    torch.testing.assert_close(got, want)
    for a, b in zip(
        torch.autograd.grad(got.square().sum(), (q, k, v)),
        torch.autograd.grad(want.square().sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


def prefixed_samples(n: int, prefix: int, seed: int = 0) -> list[Sample]:
    """``mixed_samples`` that all start with the same ``prefix`` tokens (a system prompt and tool
    schemas), then differ (at least one token of each prompt is its own)."""
    head = np.random.default_rng(seed + 100).integers(0, 500, prefix).astype(np.int64)
    out = []
    for s in mixed_samples(n, seed):
        t = Sample(np.concatenate([head, s.input_ids]), prefix + s.prompt_len, s.response_mask)
        t.old_logprobs, t.advantages = s.old_logprobs, s.advantages
        t.rollout_logprobs = s.rollout_logprobs
        out.append(t)
    return out


def test_shared_prefix_stops_before_the_shortest_prompts_last_token() -> None:
    from learner.samples import shared_prefix

    samples = prefixed_samples(4, prefix=20)
    assert shared_prefix(samples) >= 20
    assert shared_prefix(samples[:1]) == 0  # nothing to share
    a, b = (Sample(np.arange(10), p, np.ones(10 - p, np.float32)) for p in (5, 8))
    assert shared_prefix([a, b]) == 4  # token 4 predicts a's first response token


def test_a_shared_prefix_gives_the_unshared_logprobs_loss_and_gradient(policy: Any) -> None:
    """The prefix comes once, each sequence attends to it: the same numbers as padded micro-batches,
    on fewer tokens."""
    from learner.model import collate

    samples = prefixed_samples(6, prefix=40, seed=3)
    shared = collate(samples, CPU, packed=True, share_prefix=True)
    assert shared.prefix >= 40
    total = sum(len(x.input_ids) for x in samples)
    assert shared.input_ids.shape == (1, total - (len(samples) - 1) * shared.prefix)
    padded = training_pass(policy, samples, collate(samples, CPU))
    assert_same_pass(training_pass(policy, samples, shared), padded)


def test_a_group_sharing_its_whole_prompt_shares_all_but_its_last_token(policy: Any) -> None:
    """A GRPO group: the same prompt, different responses. The prompt's last token predicts each
    response's first, so it stays in every sequence's own part."""
    from learner.model import collate

    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 500, 30)
    samples = []
    for r in (5, 9, 3, 12):
        s = Sample(np.concatenate([prompt, rng.integers(0, 500, r)]), 30, np.ones(r, np.float32))
        s.old_logprobs = (-rng.random(r)).astype(np.float32)
        s.advantages = rng.normal(size=r).astype(np.float32)
        samples.append(s)
    shared = collate(samples, CPU, packed=True, share_prefix=True)
    assert shared.prefix == 29
    padded = training_pass(policy, samples, collate(samples, CPU))
    assert_same_pass(training_pass(policy, samples, shared), padded)


def test_shared_prefix_values_match_padded(tiny_model: Path) -> None:
    from learner.model import ValueHead, collate, load_value_model, value_outputs

    torch.manual_seed(0)
    head = ValueHead(load_value_model(str(tiny_model), trust_remote_code=False)).eval()
    samples = prefixed_samples(5, prefix=30, seed=4)
    with torch.no_grad():
        padded = value_outputs(head, collate(samples, CPU))
        shared = value_outputs(head, collate(samples, CPU, packed=True, share_prefix=True))
    torch.testing.assert_close(shared, padded, atol=1e-5, rtol=1e-5)
