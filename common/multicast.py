"""NVLink multicast (NVLS) off in every process of a run: the switches, and how they reach the
processes that do not inherit bin/train's environment.

Why: the multi-GPU machines the project runs on fail collectives with multicast on, and a program
using it can take the host's shared GPUs out of service. bin/train gives the switches to every child
(`launcher.children.child_env`) and what a child starts inherits them, the workers of a Ray cluster
the learner starts itself included (the raylet is the learner's child). Workers of a cluster joined
by address were started from that cluster's environment, so the learner and the Ray placement of
the rollout servers also pass the switches in Ray's ``runtime_env`` (`multicast_env`). stdlib only:
the launcher imports it before anything heavy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""NVLink multicast off for NCCL, torch's symmetric memory and NVSHMEM."""


def multicast_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The switches of `MULTICAST_OFF` with the value `environ` (default: ours) gives each, else
    off: an operator's own setting wins, as in a child's environment."""
    env = os.environ if environ is None else environ
    return {key: env.get(key, off) for key, off in MULTICAST_OFF.items()}
