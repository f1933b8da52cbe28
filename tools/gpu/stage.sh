#!/usr/bin/env bash
# Stage everything the project needs on an air-gapped GPU machine (Python 3.12, torch 2.11.0+cu130 and
# the packages of .library/device/KINDS.md preinstalled) as wheels in pieces of <= 44 MiB.
# Usage: tools/gpu/stage.sh [--force] [DEST]      (default DEST=.gpu; run where pip has network)
#   FETCH_VLLM_WHEELS=SCRIPT  the script that writes the vLLM set (called as SCRIPT DEST); needed
#   unless DEST already holds one. Default: ../shared/gpu/fetch-vllm-wheels.sh next to the clone.
#
# Design: two independent tar streams, each split into 44 MiB pieces (a piece + the repo, ~12 MB and
# growing, fits one 64 MiB transfer; the shared fetch script's 58 MiB pieces no longer do):
#  1. DEST/partNN.d/partNN: official vLLM 0.24.0 and its deps, made by the shared fetch script
#     (FETCH_VLLM_WHEELS, default ../shared/gpu/fetch-vllm-wheels.sh). Skipped when DEST/vllm-set.txt
#     (piece names + sizes + wheel list) says the pieces there are a vLLM 0.24.0 set, unless --force.
#  2. DEST/xpartNN.d/xpartNN: what ELSE the project imports (pyproject core deps + `learner` + `dev`
#     extras, plain ray instead of ray[default], no ruff) plus verl (--no-deps, as bin/setup does),
#     resolved for CPython 3.12 manylinux x86_64 with pip --dry-run --report against stand-in wheels
#     for torch/torchvision/torchaudio, with vLLM 0.24.0 and the vLLM set's exact versions (constraints),
#     minus the image's packages (tools/gpu/check_wheels.py IMAGE) and the vLLM set, plus what verl's
#     own trainer needs at run time (check_wheels.VERL_TRAINER: bench/vs_verl.py runs it). The fetch script
#     only deletes DEST/part*.d, this script only DEST/xpart*.d.
# At the end both streams are unpacked from their pieces and tools/gpu/check_wheels.py checks that
# every staged wheel's requirements are met by the image or the staged wheels (exit 1 if not).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
force=0 dest=.gpu
for a in "$@"; do case $a in --force) force=1 ;; -h|--help) sed -n 2,6p "$0"; exit 0 ;; *) dest=$a ;; esac; done
vllm_version=0.24.0
fetch=${FETCH_VLLM_WHEELS:-$root/../shared/gpu/fetch-vllm-wheels.sh}
verl_spec=$(grep -o 'verl==[0-9][0-9.]*' "$root/bin/setup" | head -1 || true)
# verl's V1 trainer (bench/vs_verl.py --verl sync) imports TransferQueue; pure Python, staged --no-deps
# as verl is: what it imports at run time (ray, tensordict, pyzmq, msgspec, omegaconf) is staged anyway
tq_spec=transferqueue==0.1.11
piece_mib=44
piece_max=$((piece_mib * 1024 * 1024))
t0=$SECONDS
mkdir -p "$dest"; dest=$(cd "$dest" && pwd); stamp=$dest/vllm-set.txt
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# pip's file:// index mirrors on this machine print one warning per missing project: keep the rest.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

stamp_ok() {  # every piece recorded in the stamp is there with its size, and no other
  [[ -f $stamp && $(head -1 "$stamp") == "vllm==$vllm_version" ]] || return 1
  local n=0 kind name size
  while read -r kind name size; do
    [[ $kind == piece ]] || continue
    [[ -f $dest/$name.d/$name && $(stat -c %s "$dest/$name.d/$name") == "$size" ]] || return 1
    n=$((n + 1))
  done < "$stamp"
  [[ $n -gt 0 && $n -eq $(find "$dest" -maxdepth 1 -name 'part*.d' | wc -l) ]]
}
write_stamp() {  # record the pieces, after checking that their stream holds vllm-$vllm_version
  { echo "vllm==$vllm_version"
    for p in "$dest"/part*.d/part*; do echo "piece $(basename "$p") $(stat -c %s "$p")"; done
    cat "$dest"/part*.d/part* | tar tf - | sed -n 's|^\(\./\)\{0,1\}\([^/]*\.whl\)$|wheel \2|p'
  } > "$stamp.tmp"
  grep -q "^wheel vllm-$vllm_version-" "$stamp.tmp" && mv "$stamp.tmp" "$stamp"
}

# 1. The vLLM piece set.
if [[ $force == 0 ]] && { stamp_ok || { compgen -G "$dest/part*.d" > /dev/null && write_stamp 2> /dev/null; }; }; then
  echo "stage.sh: vLLM $vllm_version pieces already in $dest/part*.d (--force fetches them again)"
else
  if [[ ! -x $fetch ]]; then  # a fresh clone has no ../shared: say what is needed, before any work
    cat >&2 <<MSG
stage.sh: the vLLM $vllm_version wheel set must be fetched, and the script that does it is missing:
  $fetch
Set FETCH_VLLM_WHEELS=/path/to/fetch-vllm-wheels.sh (called as SCRIPT DEST; it writes DEST/partNN.d/partNN,
pieces of <= 58 MiB of a tar of vllm==$vllm_version and its dependency wheels for CPython 3.12
manylinux x86_64), or copy an already staged set (part*.d and vllm-set.txt) into $dest.
MSG
    exit 2
  fi
  rm -f "$stamp"; quiet "$fetch" "$dest"; write_stamp || { echo "stage.sh: $fetch made no vllm $vllm_version set" >&2; exit 1; }
fi
# the fetch script's pieces are larger than a transfer leaves room for beside the repo: cut the
# stream again (the bytes are the same; the stamp records the new pieces)
for p in "$dest"/part*.d/part*; do
  (($(stat -c %s "$p") <= piece_max)) && continue
  cat "$dest"/part*.d/part* > "$work/vllm.tar" && rm -rf "$dest"/part*.d
  split -b ${piece_mib}m -d "$work/vllm.tar" "$work/part" && rm "$work/vllm.tar"
  for q in "$work"/part[0-9]*; do b=$(basename "$q"); mkdir -p "$dest/$b.d"; mv "$q" "$dest/$b.d/"; done
  write_stamp && echo "stage.sh: vLLM stream cut again into ${piece_mib} MiB pieces"; break
done
t1=$SECONDS

# 2. The project's other runtime and test dependencies.
plat=(--python-version 3.12 --implementation cp --only-binary=:all: --platform any)
for t in manylinux1_x86_64 manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do plat+=(--platform "$t"); done
mkdir -p "$work/stubs" "$work/built" "$work/xwhl"
for spec in torch:2.11.0 torchaudio:2.11.0 torchvision:0.26.0; do   # stand-ins: the image has these
  n=${spec%%:*} v=${spec##*:} d=$work/stub-$n
  mkdir -p "$d/$n" "$d/$n-$v.dist-info"; : > "$d/$n/__init__.py"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$n" "$v" > "$d/$n-$v.dist-info/METADATA"
  printf 'Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n' > "$d/$n-$v.dist-info/WHEEL"
  printf '%s\n' "$n/__init__.py,," "$n-$v.dist-info/METADATA,," "$n-$v.dist-info/WHEEL,," "$n-$v.dist-info/RECORD,," > "$d/$n-$v.dist-info/RECORD"
  (cd "$d" && python3 -m zipfile -c "$work/stubs/$n-$v-py3-none-any.whl" "$n" "$n-$v.dist-info")
done
# antlr4 runtime: omegaconf/hydra-core want ==4.9.*, latex2sympy2_extended (math-verify) >=4.9.3,<=4.13.2,
# so 4.9.3; PyPI has only its sdist (pure Python): build the wheel here.
quiet python3 -m pip wheel --quiet --no-deps -w "$work/built" antlr4-python3-runtime==4.9.3
python3 - "$root" "$stamp" "$work" "$vllm_version" <<'PY'
import sys, tomllib
from pathlib import Path
root, stamp, work, vllm = sys.argv[1:]
sys.path.insert(0, f"{root}/tools/gpu")
from check_wheels import VERL_TRAINER
proj = tomllib.loads(Path(root, "pyproject.toml").read_text())["project"]
reqs = proj["dependencies"] + proj["optional-dependencies"]["learner"] + proj["optional-dependencies"]["dev"]
reqs = [r.replace("ray[default]", "ray") for r in reqs if not r.startswith(("ruff", "basedpyright"))]  # no dashboard; linters
reqs += VERL_TRAINER  # verl's own trainer (bench/vs_verl.py) imports these beyond what verl's core needs
reqs += [f"vllm=={vllm}"] + [f"{w.name.split('-')[0]} @ {w.as_uri()}" for w in sorted(Path(work).glob("*/*.whl"))]
Path(work, "reqs.txt").write_text("\n".join(reqs) + "\n")
pins = ["{}=={}".format(*line.split()[1].split("-")[:2]) for line in open(stamp) if line.startswith("wheel ")]
Path(work, "constraints.txt").write_text("\n".join(pins) + "\n")
PY
quiet python3 -m pip install --dry-run --ignore-installed --quiet --report "$work/report.json" "${plat[@]}" \
  --target "$work/t" -c "$work/constraints.txt" -r "$work/reqs.txt"
python3 - "$root" "$stamp" "$work" > "$work/specs.txt" <<'PY'
import json, sys
root, stamp, work = sys.argv[1:]
sys.path.insert(0, f"{root}/tools/gpu")
from check_wheels import FORCE_STAGED, HEAVY, IMAGE, TORCH, norm
skip = {norm(n) for n in IMAGE + HEAVY + TORCH} - {norm(n) for n in FORCE_STAGED}
skip |= {norm(line.split()[1].split("-")[0]) for line in open(stamp) if line.startswith("wheel ")}
for item in json.load(open(f"{work}/report.json"))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if norm(name) not in skip and not item["download_info"]["url"].startswith(f"file://{work}/"):  # stand-ins, antlr
        print(f"{name}=={version}")
PY
quiet python3 -m pip download --quiet --no-deps "${plat[@]}" -d "$work/xwhl" $(cat "$work/specs.txt") ${verl_spec:-verl==0.9.1} $tq_spec
cp "$work/built"/*.whl "$work/xwhl/"
rm -rf "$dest"/xpart*.d
tar cf - -C "$work/xwhl" . | split -b ${piece_mib}m -d - "$work/xpart"
for p in "$work"/xpart*; do b=$(basename "$p"); mkdir -p "$dest/$b.d"; mv "$p" "$dest/$b.d/"; done
t2=$SECONDS

# 3. Summary, piece sizes, and the closure check over both streams unpacked from their pieces.
for s in part xpart; do
  mkdir -p "$work/check/$s"; cat "$dest"/$s*.d/$s* | tar xf - -C "$work/check/$s"
  n=$(find "$work/check/$s" -name '*.whl' | wc -l)
  mb=$(du -cb "$dest"/$s*.d/$s* | tail -1 | awk '{printf "%.0f", $1 / 1e6}')
  echo "stage.sh: $s stream: $n wheels in $(compgen -G "$dest/$s*.d" | wc -l) pieces ($dest/${s}NN.d/${s}NN), $mb MB"
  for p in "$dest"/$s*.d/$s*; do
    (($(stat -c %s "$p") <= piece_max)) || { echo "stage.sh: $p is over $piece_mib MiB" >&2; exit 1; }
  done
done
echo "stage.sh: extras: $(tr '\n' ' ' < "$work/specs.txt")${verl_spec:-verl==0.9.1} $tq_spec (--no-deps) antlr4-python3-runtime==4.9.3 (built)"
echo "stage.sh: vLLM set $((t1 - t0)) s, extras $((t2 - t1)) s, total $((SECONDS - t0)) s"
python3 "$root/tools/gpu/check_wheels.py" "$work/check/part" "$work/check/xpart"
