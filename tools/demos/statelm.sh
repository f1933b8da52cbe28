#!/usr/bin/env bash
# DEMO_AGENT=statelm bin/demo: the tiny model learns StateLM's context management on CPU.
#  1. makes the tiny model and the long-document tasks if missing (tools/demos/statelm_data.py:
#     a 2-chunk document, the secret code (a letter) at the end of chunk 0, the question at the end
#     of chunk 1; the per-segment response budget holds one chunk and its note, not both chunks);
#  2. warm-up (bin/warmup --agent statelm, seeded): episodes played by the real StateLM agent that
#     read chunk 0, note the code, delete the chunk (a new segment), read chunk 1, read the note
#     back and finish with it; in half of them the note holds a wrong code, so the warmed model
#     copies the fact into its note only some of the time: the choice RL learns from the reward;
#  3. bin/train --config configs/demo_statelm.yaml: a learner and 2 rollout servers; every
#     deletion closes a snapshot trajectory, trained in the episode's GRPO group with its reward
#     (the note was written in that snapshot, so that is where the reward teaches it).
#     Everything lands in $DEMO_DIR/demo-statelm (metrics.jsonl, training_curves.png, ...).
#   DEMO_STEPS=N     training steps (default: the config's)
#   DEMO_DIR=DIR     where models, data and the run go (default runs)
#   bin/demo key=value ...   more overrides, passed to bin/train
#   --help           this text and bin/train's options; touches nothing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
# --help only prints; nothing below (which makes models and deletes the last run) runs for it
source tools/demos/prelude.sh
demo_prelude "$0" "DEMO_AGENT=statelm bin/demo" "$@"
py=.venv/bin/python
dir="${DEMO_DIR:-runs}"
tools=readChunk,note,readNote,deleteContext,finish  # configs/demo_statelm.yaml agents.statelm.tools
[[ -f "$dir/tiny-model/model.safetensors" ]] || $py bin/make-tiny-model --out "$dir/tiny-model"
[[ -f "$dir/tiny-statelm-data/train.jsonl" ]] || $py -m tools.demos.statelm_data --out "$dir/tiny-statelm-data" > /dev/null
if [[ ! -f "$dir/tiny-statelm-model/model.safetensors" ]]; then
  echo "== warm-up (bin/warmup --agent statelm, seeded): episodes that note the code, and as many that note a wrong one" >&2
  # Two threads: nothing else runs yet, and its episodes are long enough to split (30 steps on an
  # idle 2-core machine: 1.67 s a step on one thread, 1.10 s on two). A probe of 32 long episodes
  # costs ~3 steps' time: every 25 steps, not 10.
  OMP_NUM_THREADS=2 $py bin/warmup --agent statelm --tools "$tools" --model "$dir/tiny-model" \
    --data "$dir/tiny-statelm-data/train.jsonl" --out "$dir/tiny-statelm-model" \
    --guess-fraction 0.5 --target 0.5 --probe-every 25 --max-seconds 900 > /dev/null
fi
args=(actor_rollout_ref.model.path="$dir/tiny-statelm-model"
      data.train_files="$dir/tiny-statelm-data/train.jsonl"
      data.val_files="$dir/tiny-statelm-data/val.jsonl" trainer.run_dir="$dir/demo-statelm")
[[ -z "${DEMO_STEPS:-}" ]] || args+=(trainer.total_training_steps="$DEMO_STEPS")
rm -rf "$dir/demo-statelm"
# bin/train stops every process it started on success, failure and Ctrl-C (exit 0 / 1 / 130).
exec $py bin/train --config configs/demo_statelm.yaml "${args[@]}" "$@"
