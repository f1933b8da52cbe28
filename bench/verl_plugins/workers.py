"""What verl's workers load (``actor_rollout_ref.model.external_lib``): the two things verl takes
from flash-attn, which the GPU machines lack, substituted as a verl user with flash-attn would run.

Importing it registers the packed attention (`varlen_attention`) with transformers and points
verl's token logprobs at one vectorised call (`logprobs`). bench/verl_side.py names it.
"""

from __future__ import annotations

from bench.verl_plugins import logprobs, varlen_attention

ATTENTION = varlen_attention.NAME
PATCHED = logprobs.install()
