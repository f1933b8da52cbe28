"""verl's token logprobs without flash-attn, in one vectorised call, as verl computes them with it.

Design: verl 0.9.1 takes each token's logprob through flash-attn's Triton cross-entropy when the
flash-attn package is installed, and otherwise through ``logprobs_from_logits_v2``, which loops in
Python over the rows of the logits to save memory. Under padding removal the logits are
``[tokens, vocab]``, so a row is one token: a micro-batch of 16k tokens costs 16k logsumexp calls
in the forward and as many in the backward. The GPU machines have no flash-attn, so without this
module verl's update and reference forward pay that loop, and the comparison would measure it.
`install` points verl at our learner's own logprobs (`learner.algorithms.losses.
logprobs_from_logits`: the float32 logsumexp over the vocabulary in one call, as flash-attn's kernel
also reduces in float32) in ``verl.utils.torch_functional`` and in every loaded module that bound
the name at import (the FSDP engine does); a module imported later takes the new name from
``torch_functional``. The price is what flash-attn's kernel saves: a float32 copy of the
micro-batch's logits, 9.7 GB for 16k tokens of a 152k vocabulary, which the token cap keeps in
bounds. verl's workers install it through ``bench.verl_plugins.workers``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from learner.algorithms.losses import logprobs_from_logits as _ours

NAME = "logprobs_from_logits"


def vectorised_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
) -> torch.Tensor:
    """verl's ``logprobs_from_logits`` signature; ``inplace_backward`` is flash-attn's memory
    option, which a float32 log-softmax has no use for."""
    del inplace_backward
    return _ours(logits, labels)


def install() -> list[str]:
    """Replace verl's function wherever it is bound; the names of the modules patched (none when
    it is already replaced everywhere)."""
    import verl.utils.torch_functional as verl_f

    original = getattr(verl_f, "_verl_" + NAME, verl_f.logprobs_from_logits)
    setattr(verl_f, "_verl_" + NAME, original)  # kept, so that a second install finds it
    patched = []
    for name, module in list(sys.modules.items()):
        # only verl's modules: reading an attribute of some others (transformers' lazy ones)
        # imports things
        bound: Any = getattr(module, NAME, None) if name.startswith("verl") else None
        if bound is original:
            setattr(module, NAME, vectorised_logprobs)
            patched.append(name)
    return sorted(patched)
