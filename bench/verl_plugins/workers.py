"""What verl's workers load (``actor_rollout_ref.model.external_lib``): the two things verl takes
from flash-attn, which the GPU machines lack, substituted as a verl user with flash-attn would run.

Importing it registers the packed attention (`varlen_attention`) with transformers and points
verl's token logprobs at one vectorised call (`logprobs`), then prints one ``MARK`` line: Ray
forwards workers' output to the driver's log, where bench/vs_verl.py counts the lines, so a run
whose workers never loaded the plugins says so in its JSON. bench/verl_side.py names it.
"""

from __future__ import annotations

import os
import sys

from bench.verl_plugins import logprobs, varlen_attention

MARK = "verl_plugins.workers loaded:"
ATTENTION = varlen_attention.NAME
PATCHED = logprobs.install()
print(
    f"{MARK} pid {os.getpid()} attention {ATTENTION}, logprobs in {','.join(PATCHED) or '-'}",
    file=sys.stderr,
    flush=True,
)
