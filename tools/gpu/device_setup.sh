#!/usr/bin/env bash
# Set up the project on an air-gapped GPU machine from the pieces that tools/gpu/stage.sh made.
# Usage (on the GPU machine, from the repo checkout): tools/gpu/device_setup.sh PARTS_DIR [SITE]
#   PARTS_DIR: a flat folder holding the piece files themselves (part00 ... partNN, xpart00 ... xpartNN)
#   SITE:      where the wheels are installed (default /root/site); then `source SITE/env.sh`.
#
# Design: the two tar streams (part* = vLLM 0.24.0 set, xpart* = the project's other needs) are
# checked for gaps, unpacked and installed with `pip install --no-index --no-deps --target` into a
# fresh SITE (built beside it, then swapped in). SITE/.pieces records the piece names and sizes: when
# they are unchanged, the install is skipped (idempotent; a second run only verifies). SITE/env.sh is
# rewritten on every run: PYTHONPATH (repo root first, because verl ships a top-level `tests`
# package), PATH (SITE/bin: ray, vllm), no usage stats, VLLM_HOST_IP, and NVLink multicast off
# (required on the multi-GPU machines there). The verification imports the project's key modules in
# one python3 process, prints versions and the time, and fails naming what cannot be imported.
set -euo pipefail
parts=${1:?usage: tools/gpu/device_setup.sh PARTS_DIR [SITE]}
site=${2:-/root/site}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
die() { echo "device_setup: $*" >&2; exit 1; }
[[ -d $parts ]] || die "no folder $parts (copy the piece files there: DEST/partNN.d/partNN and DEST/xpartNN.d/xpartNN)"
parts=$(cd "$parts" && pwd); site=$(mkdir -p "$(dirname "$site")" && cd "$(dirname "$site")" && pwd)/$(basename "$site")
t0=$SECONDS
trap 'rm -rf "$site.whl" "$site.new"' EXIT

pieces() {  # STREAM: its pieces in order; dies on none or on a gap
  local s=$1 i=0 n
  n=$(compgen -G "$parts/${s}[0-9][0-9]" | wc -l || true)
  ((n > 0)) || die "no ${s}NN pieces in $parts (stage.sh writes them as DEST/${s}NN.d/${s}NN)"
  while [[ -f $parts/$(printf '%s%02d' "$s" "$i") ]]; do printf '%s\n' "$parts/$(printf '%s%02d' "$s" "$i")"; i=$((i + 1)); done
  ((i == n)) || die "$n ${s}NN pieces in $parts, but $(printf '%s%02d' "$s" "$i") is missing"
}
plist=$(pieces part) && xlist=$(pieces xpart) || exit 1
listing=$(printf '%s\n' "$plist" "$xlist" | xargs -d "\n" stat -L -c '%n %s' | sed 's|.*/||')
if [[ -f $site/.pieces && $(cat "$site/.pieces") == "$listing" ]]; then
  echo "device_setup: $site is up to date with the pieces in $parts (install skipped)"
else
  [[ ! -e $site || -f $site/.pieces || -z $(ls -A "$site") ]] || die "$site exists and was not made by device_setup.sh: pick another SITE"
  rm -rf "$site.whl" "$site.new"; mkdir -p "$site.whl"
  for s in part xpart; do
    if [[ $s == part ]]; then list=$plist; else list=$xlist; fi
    printf '%s\n' "$list" | xargs -d "\n" cat | tar xf - -C "$site.whl" ||
      die "the $s stream does not unpack: is its last piece missing or cut short? (run stage.sh again)"
  done
  echo "device_setup: $(ls "$site.whl"/*.whl | wc -l) wheels unpacked in $((SECONDS - t0)) s; installing into $site"
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --target "$site.new" "$site.whl"/*.whl || die "pip could not install the wheels from $site.whl"
  rm -rf "$site" "$site.whl"; mv "$site.new" "$site"
  echo "$listing" > "$site/.pieces"
  echo "device_setup: installed in $((SECONDS - t0)) s"
fi

cat > "$site/env.sh" <<EOF
# Written by tools/gpu/device_setup.sh: source it in every shell before running the project.
export PYTHONPATH=$root:$site
case ":\$PATH:" in *":$site/bin:"*) ;; *) export PATH=$site/bin:\$PATH ;; esac
export VLLM_HOST_IP=127.0.0.1 RAY_USAGE_STATS_ENABLED=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
# NVLink multicast off (NCCL, PyTorch symmetric memory, NVSHMEM): required on the multi-GPU machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
EOF
# shellcheck source=/dev/null
source "$site/env.sh"
cd "$root"
python3 - "$site" <<'PY' || die "verification failed: the modules above cannot be imported (see $site/env.sh)"
import importlib, importlib.metadata as md, sys, time
t, site = time.time(), sys.argv[1]
mods = {"vllm": "vllm", "ray": "ray", "zmq": "pyzmq", "msgpack": "msgpack", "structlog": "structlog",
        "trio": "trio", "verl.trainer.ppo.core_algos": "verl", "bm25s": "bm25s", "math_verify": "math-verify",
        "tensorboardX": "tensorboardX", "starlette": "starlette", "uvicorn": "uvicorn", "httpx": "httpx",
        "matplotlib": "matplotlib", "torch": "torch", "transformers": "transformers",
        "datasets": "datasets", "torchdata": "torchdata", "verl.trainer.main_ppo": "verl", "peft": "peft",
        "common.cli": None, "learner.trainer": None, "rollout_service.server": None}
failed = []
for mod, dist in mods.items():
    try:
        m = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - report every failure, then fail
        failed.append(f"{mod} ({type(e).__name__}: {e})")
        continue
    where = "repo" if dist is None else "site" if (m.__file__ or "").startswith(site) else "image"
    print(f"  {mod:30s} {md.version(dist) if dist else '':14s} {where}")
print(f"device_setup: imports took {time.time() - t:.1f} s")
if failed:
    print("device_setup: cannot import: " + "; ".join(failed), file=sys.stderr)
    sys.exit(1)
PY
echo "device_setup: ready in $((SECONDS - t0)) s; now: source $site/env.sh"
