#!/usr/bin/env bash
# DEMO_AGENT=mixed bin/demo: one tiny model, three sources, two agents, tools on a tool server, on CPU.
#  1. makes the tiny model and the data if missing (tools/demos/mixed_data.py, generated here):
#     arithmetic questions (tool agent, calculator), search questions on a small corpus (tool
#     agent, BM25 search, finish with the name) and computations (code agent, python sandbox);
#  2. warm-up (bin/warmup --agent mixed, seeded): each row's episode by its agent, with the real
#     tools (half of them skip the tool and answer wrong): the tool agent's rows, the code rows,
#     then the whole mix, so the warmed model uses its tools on about half of the prompts and is
#     right in some of those; last, a few steps on guesses alone (as bin/demo's calculator
#     warm-up ends), so that it starts RL mostly guessing: the choice RL then learns. The tools,
#     limits and tags are configs/demo_mixed.yaml's (WARMUP_CONFIG);
#  3. bin/train --config configs/demo_mixed.yaml: a tool server (python and search), a learner
#     and 2 rollout servers; every batch of 20 prompts holds 8 arithmetic, 6 search and 6 code
#     tasks, at the servers and in the learner's steps (batch/groups/<source>), each source with
#     its reward (reward/mean/<source>); everything in $DEMO_DIR/demo-mixed.
#   DEMO_STEPS=N     training steps (default: the config's, 16)
#   DEMO_DIR=DIR     where models, data and the run go (default runs)
#   DEMO_AGENT=mixed bin/demo key=value ...   more overrides, passed to bin/train
#   DEMO_AGENT=mixed bin/demo --help          this text and bin/train's options; touches nothing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
# --help only prints; nothing below (which makes models and deletes the last run) runs for it
source tools/demos/prelude.sh
demo_prelude "$0" "DEMO_AGENT=mixed bin/demo" "$@"
py=.venv/bin/python
config=configs/demo_mixed.yaml
dir="${DEMO_DIR:-runs}"
data="$dir/demo-mixed-data"
model="$dir/tiny-mixed-model"
[[ -f "$dir/tiny-model/model.safetensors" ]] || $py bin/make-tiny-model --out "$dir/tiny-model"
[[ -f "$data/warmup.jsonl" ]] || $py -m tools.demos.mixed_data --out "$data"
paths=(data.datasets.0.path="$data/arithmetic/train.jsonl" data.datasets.1.path="$data/qa/train.jsonl"
       data.datasets.2.path="$data/code/train.jsonl" data.val_files="$data/val.jsonl"
       tools.search.corpus="$data/qa/corpus.jsonl")
if [[ ! -f "$model/model.safetensors" ]]; then
  echo "== warm-up (bin/warmup --agent mixed, seeded): tool-agent episodes, code episodes, the mix (half of each wrong answers), then guesses" >&2
  # the run's tools, limits and tags come from its config, with this data's corpus; two threads:
  # nothing else runs yet (the code warm-up, idle 2-core machine: 1.3x faster than one thread)
  warmup=(env OMP_NUM_THREADS=2 WARMUP_CONFIG="$config"
          WARMUP_OVERRIDES="tools.search.corpus=$data/qa/corpus.jsonl" $py bin/warmup --agent mixed)
  # each agent's rows apart first, then the whole mix, since training on one agent's rows alone
  # makes the model write that agent's format for every prompt (the code rows erase the tool
  # agent's episodes). The step caps are what fits bin/demo's 10 minutes on 2 cores (tools 450
  # steps: 145 s; code stops at its target, ~600 steps: 75 s; mix 400: 110 s; guesses 20: 15 s);
  # the probes (a whole tool episode right) stay low: 0.05 / 0.17 / 0.05. The mix: every
  # row but the probe's once or twice (608 of 640: 224 rows seen 14 times each were learnt by
  # heart, each with its own choice, and new prompts got the guess), batches by prompt length
  # (both answers to a prompt in one batch) and a falling learning rate, so that the warmed model
  # picks the tool on about half of new prompts of every source (tools/warmup.py, --bucket)
  "${warmup[@]}" --model "$dir/tiny-model" --data "$data/warmup-tools.jsonl" \
    --out "$dir/tiny-mixed-warm-tools" --guess-fraction 0.5 --target 0.15 --steps 450 --probe-every 50 --max-seconds 900 > /dev/null
  "${warmup[@]}" --model "$dir/tiny-mixed-warm-tools" --data "$data/warmup-code.jsonl" \
    --out "$dir/tiny-mixed-warm-code" --guess-fraction 0.5 --target 0.15 --steps 1000 --max-seconds 900 > /dev/null
  "${warmup[@]}" --model "$dir/tiny-mixed-warm-code" --data "$data/warmup.jsonl" --bucket prompt \
    --examples 608 --lr-decay --out "$dir/tiny-mixed-warm-mix" --guess-fraction 0.5 --target 0.15 \
    --steps 400 --probe-every 50 --max-seconds 720 > /dev/null
  # guesses only, 20 small steps: the tool is picked on fewer new prompts while a tool episode
  # stays as often right, so RL has a choice to learn that the reward shows
  "${warmup[@]}" --model "$dir/tiny-mixed-warm-mix" --data "$data/warmup.jsonl" --out "$model" \
    --guess-fraction 1.0 --steps 20 --lr 1e-4 --drill-weight 0 --target 0 > /dev/null
fi
args=(actor_rollout_ref.model.path="$model" "${paths[@]}" trainer.run_dir="$dir/demo-mixed")
[[ -z "${DEMO_STEPS:-}" ]] || args+=(trainer.total_training_steps="$DEMO_STEPS")
rm -rf "$dir/demo-mixed"
# bin/train stops every process it started on success, failure and Ctrl-C (exit 0 / 1 / 130).
exec $py bin/train --config "$config" "${args[@]}" "$@"
