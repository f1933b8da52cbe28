"""The GPU configs' vLLM mode on the agent's mixed prefill-decode batches, on CUDA, checked for
valid output: ``bench/multiturn.py`` (the 0.5B shape, 128 episodes of up to 31 turns, so most
engine steps mix new turns' prefills with other episodes' decodes) under the ``cudagraph_mode`` of
each GPU config. The bench checks every sampled token's logprob, through ``VllmEngine`` and bare
``AsyncLLM``, and reports a mode whose output is corrupt as failed. ``cudagraph_mode: FULL`` was:
an end-to-end run under it had every batch refused (docs/performance.md), while the engine's own
GPU test, on a few requests at a time, passed under it. About 2 minutes on an H200.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config

pytestmark = [pytest.mark.gpu, pytest.mark.nightly]

REPO = Path(__file__).resolve().parents[2]
GPU_CONFIGS = ("longtail_e2e.yaml", "gpu_e2e.yaml")


def cudagraph_mode(config: str) -> str:
    cfg = load_config(REPO / "configs" / config, [], check_paths=False)
    compilation = cfg.actor_rollout_ref.rollout.compilation_config or {}
    # bench/multiturn.py's modes run without torch.compile, as these configs do
    assert compilation.get("mode") == 0, f"{config}: {compilation}"
    return str(compilation["cudagraph_mode"])


def test_the_gpu_configs_engine_mode_gives_valid_logprobs_on_mixed_batches() -> None:
    modes = sorted({cudagraph_mode(c) for c in GPU_CONFIGS})
    proc = subprocess.run(
        [sys.executable, "bench/multiturn.py", "--modes", ",".join(modes), "--rounds", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in out["modes"]:
        assert "error" not in mode, f"{mode['mode']}: {mode['error']}\n{proc.stderr[-3000:]}"
        for side in ("ours", "bare"):
            assert all(r["mean_logprob"] < 0 for r in mode[side]), mode
    assert proc.returncode == 0, proc.stderr[-3000:]
