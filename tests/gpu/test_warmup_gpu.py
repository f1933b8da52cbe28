"""The warm-up on CUDA repeats for a seed: two warm-ups of the tiny model, each in a process of its
own (cuBLAS's workspace setting must precede its first handle), give the same weights byte for
byte, with every backward on deterministic kernels (``deterministic_backward`` is ``strict``), and
each one's first step repeats bit for bit (``repeat_check``). Before the strict backward, warm-ups
of one seed stopped anywhere from 510 to 720 steps on H200s: attention's backward keeps its atomics
in warn-only mode (tools/deterministic.py). With it, this test still failed on an H200 while SDPA
could choose cuDNN attention in the forward, whose backward torch runs non-deterministically; the
warm-up now switches it off. Seconds on an H200. Skipped without a GPU (tests/conftest.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.make_tiny_data import make_tiny_data
from tools.make_tiny_model import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.nightly]

REPO = Path(__file__).resolve().parents[2]


def _warmup(model: Path, data: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tools.warmup", "--model", str(model), "--data", str(data)]
    cmd += ["--out", str(out), "--steps", "40", "--target", "0", "--seed", "3", "--device", "cuda"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_warm_ups_of_one_seed_give_the_same_weights(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    data = make_tiny_data(tmp_path / "data", train=64, val=8) / "train.jsonl"
    a = _warmup(model, data, tmp_path / "a")
    b = _warmup(model, data, tmp_path / "b")
    assert a["deterministic_backward"] == "strict", a["deterministic_backward"]
    for x in (a, b):
        assert x["repeat_check"]["default"]["n"] == 0, x["repeat_check"]
    digests = [
        hashlib.sha256((tmp_path / x / "model.safetensors").read_bytes()).hexdigest() for x in "ab"
    ]
    # on a mismatch, say where it comes from: each warm-up's check of its first step (the loss and
    # every gradient twice from the same weights, default attention kernels and math attention)
    why = {k: (x["first_loss"], x["repeat_check"]) for k, x in zip("ab", (a, b), strict=True)}
    assert a["final_loss"] == b["final_loss"] and digests[0] == digests[1], why
    assert a["weights_sha256"] == digests[0]  # the digest a run's JSON carries names this model
