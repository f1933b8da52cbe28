#!/usr/bin/env python3
"""Check that a set of staged wheels is closed under its runtime requirements on the GPU machine.

Design: reads every wheel's METADATA (Requires-Dist) straight from the zip, keeps the requirements
whose environment marker holds on Linux / CPython 3.12 / x86_64 with no extra selected, and reports
every requirement whose NAME is provided neither by the GPU image (IMAGE below, copied from
../shared/gpu/fetch-vllm-wheels.sh; it matches .library/device/KINDS.md), nor by the staged wheels,
nor by torch/torchvision/torchaudio/triton; HEAVY ones, left out on purpose, are listed apart. Version specifiers are checked against staged wheels
only (the image's versions are mostly unknown here). Wheels installed with --no-deps on purpose
(NO_DEPS) are listed apart. Also the single source of the IMAGE and HEAVY lists for tools/gpu/stage.sh.

Usage: python3 tools/gpu/check_wheels.py DIR_WITH_WHEELS [...]   (exit 1 when something is missing)
"""

from __future__ import annotations

import re
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.requirements import Requirement

IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp""".split()
# Heavy optional kernels / tools that the fetch script leaves out of the vLLM set (nothing here imports them).
HEAVY = """flashinfer-cubin nvidia-cuda-cccl nvidia-cuda-crt nvidia-cuda-nvcc nvidia-cuda-tileiras nvidia-nvvm
nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-cu13 cuda-tile tilelang quack-kernels
humming-kernels tokenspeed-mla tokenspeed-triton z3-solver sentry-sdk fastapi-cloud-cli""".split()
# Carried by the image itself (stand-ins during resolution), never staged.
TORCH = ["torch", "torchvision", "torchaudio", "triton"]
# verl's own trainer (verl.trainer.main_ppo, run by bench/vs_verl.py) imports these beyond verl's core
# (the image has peft and accelerate). datasets 5.2 wants pyarrow>=24 and fsspec<=2026.9.0, newer or
# older than what the image may hold: FORCE_STAGED are staged even though the image has them, and the
# staged copy wins (SITE comes before the image's site-packages on PYTHONPATH).
VERL_TRAINER = ["datasets==5.2.0", "torchdata==0.11.0", "pyarrow>=24", "fsspec<=2026.9.0"]
FORCE_STAGED = ["pyarrow", "fsspec"]
# Installed with --no-deps on purpose: verl 0.9.1 pins transformers<5.11 (its runtime needs are the
# project's `learner` extra); its other requirements are listed, not counted as missing.
NO_DEPS = ["verl", "transferqueue"]  # transferqueue: verl V1's, pure Python
# Versions seen on the image (KINDS.md 'pip list' row): requirements on them are checked as notes.
IMAGE_VERSIONS = {
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.2",
    "transformers": "5.17.0",
}
ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
    "extra": "",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.lower())


def wheel_meta(path: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = HeaderParser().parsestr(z.read(meta).decode("utf-8", "replace"))
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def main(dirs: list[str]) -> int:
    wheels = sorted(p for d in dirs for p in Path(d).rglob("*.whl"))
    staged = {}
    reqs = []
    for w in wheels:
        name, version, requires = wheel_meta(w)
        staged[norm(name)] = version
        reqs += [(norm(name), r) for r in requires]
    provided = {norm(n) for n in IMAGE + TORCH}
    HEAVY_N = {norm(n) for n in HEAVY}
    missing, bad_version, no_deps, image_notes, heavy = {}, [], {}, [], {}
    for owner, text in reqs:
        r = Requirement(text)
        if r.marker is not None and not r.marker.evaluate(ENV):
            continue
        n = norm(r.name)
        if owner in NO_DEPS:
            if n not in staged and n not in provided:
                no_deps.setdefault(n, []).append(owner)
            continue
        if (
            n in IMAGE_VERSIONS
            and r.specifier
            and not r.specifier.contains(IMAGE_VERSIONS[n], prereleases=True)
        ):
            image_notes.append(f"{owner} wants {text}; the image has {n} {IMAGE_VERSIONS[n]}")
        if n in HEAVY_N and n not in staged:
            heavy.setdefault(n, []).append(owner)
        elif n in staged:
            if r.specifier and not r.specifier.contains(staged[n], prereleases=True):
                bad_version.append(f"{owner} needs {text}; staged {n} {staged[n]}")
        elif n not in provided:
            missing.setdefault(n, []).append(f"{owner} ({text})")
    dup = sorted(set(staged) & provided)
    print(f"check_wheels: {len(wheels)} wheels, {len(reqs)} requirements read")
    for n in dup:
        print(
            f"  note: {n} {staged[n]} is staged although the image has it (the staged one wins on PYTHONPATH)"
        )
    for n, owners in sorted(no_deps.items()):
        print(f"  ignored (installed --no-deps): {n} <- {', '.join(sorted(set(owners)))}")
    for n, owners in sorted(heavy.items()):
        print(
            f"  left out on purpose (heavy optional kernel/tool, imported lazily): {n} <- {', '.join(sorted(set(owners)))}"
        )
    for line in image_notes:
        print(f"  note: {line}")
    for line in bad_version:
        print(f"  VERSION: {line}")
    for n, owners in sorted(missing.items()):
        print(f"  MISSING: {n} <- {'; '.join(owners)}")
    ok = not missing and not bad_version
    print(
        "check_wheels: clean"
        if ok
        else f"check_wheels: {len(missing)} missing, {len(bad_version)} version conflicts"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
