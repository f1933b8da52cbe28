#!/usr/bin/env bash
# DEMO_AGENT=code bin/demo: the tiny model learns to compute with the code agent's sandbox, on CPU.
#  1. makes the tiny model and the computation tasks if missing ("What is 614 % 37?": a tiny
#     model cannot compute it, the sandbox can; tools/demos/code_data.py), generated here;
#  2. warm-up (bin/warmup --agent code, seeded): episodes that write print(EXPR) between <code>
#     and </code>, read the sandbox's output and copy it between <answer> and </answer> (half of
#     them answer a wrong number without code), until a held-out episode is written exactly with
#     chance 0.15; then 5 steps on wrong answers only, so the warmed model runs code less often
#     (a held-out episode written exactly: 0.10) and is right in few: the choice RL then learns. The
#     tags are configs/demo_code.yaml's (agents.code), read by the warm-up through WARMUP_CONFIG;
#  3. bin/train --config configs/demo_code.yaml: a learner and 2 rollout servers running the code
#     agent with the math reward, everything in $DEMO_DIR/demo-code (metrics.jsonl,
#     training_curves.png, recordings).
#   DEMO_STEPS=N     training steps (default: the config's, 30)
#   DEMO_DIR=DIR     where models, data and the run go (default runs)
#   DEMO_AGENT=code bin/demo key=value ...   more overrides, passed to bin/train
#   DEMO_AGENT=code bin/demo --help          this text and bin/train's options; touches nothing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
# --help only prints; nothing below (which makes models and deletes the last run) runs for it
source tools/demos/prelude.sh
demo_prelude "$0" "DEMO_AGENT=code bin/demo" "$@"
py=.venv/bin/python
config=configs/demo_code.yaml
dir="${DEMO_DIR:-runs}"
data="$dir/demo-code-data"
model="$dir/tiny-code-model"
[[ -f "$dir/tiny-model/model.safetensors" ]] || $py bin/make-tiny-model --out "$dir/tiny-model"
[[ -f "$data/train.jsonl" ]] || $py -m tools.demos.code_data --out "$data"
if [[ ! -f "$model/model.safetensors" ]]; then
  echo "== warm-up (bin/warmup --agent code, seeded): code episodes and wrong answers, then wrong answers" >&2
  # two threads: nothing else runs yet (200 steps on an idle 2-core machine: 41 s on one thread,
  # 31 s on two, the same losses and probe)
  warmup=(env OMP_NUM_THREADS=2 WARMUP_CONFIG="$config" $py bin/warmup --agent code --tools python)
  "${warmup[@]}" --model "$dir/tiny-model" --data "$data/train.jsonl" \
    --out "$dir/tiny-code-warm" --guess-fraction 0.5 --target 0.15 --steps 1500 --max-seconds 900 > /dev/null
  "${warmup[@]}" --model "$dir/tiny-code-warm" --data "$data/train.jsonl" \
    --out "$model" --guess-fraction 1.0 --steps 5 --lr 1e-4 --drill-weight 0 --target 0 > /dev/null
fi
args=(actor_rollout_ref.model.path="$model" data.train_files="$data/train.jsonl"
      data.val_files="$data/val.jsonl" trainer.run_dir="$dir/demo-code")
[[ -z "${DEMO_STEPS:-}" ]] || args+=(trainer.total_training_steps="$DEMO_STEPS")
rm -rf "$dir/demo-code"
# bin/train stops every process it started on success, failure and Ctrl-C (exit 0 / 1 / 130).
exec $py bin/train --config "$config" "${args[@]}" "$@"
