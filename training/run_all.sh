#!/usr/bin/env bash
# Train the demo pair end to end: tokenizer -> target -> rollouts -> DFlash drafter -> acceptance eval -> assets.
#
#   bash training/run_all.sh [RUN_DIR] [STAGES]
#
# RUN_DIR (default runs/demo, git-ignored) gets target/, drafter/, rollouts.npy and the metrics JSON files.
# STAGES is a comma list (default: all but probe and ngram_eval, in this order):
#   tokenizer   byte-level BPE on the target-train stdlib files         -> RUN/target/tokenizer*.json
#   target      the tiny qwen3_moe target                               -> RUN/target/, metrics_target.json
#   ngram_eval  n-gram tau only (needs no drafter)                      -> RUN/metrics_ngram.json
#   probe       60 drafter steps + a small eval: checks the GPU path     -> RUN/probe/
#   rollouts    target greedy rollouts of drafter-only prompts          -> RUN/rollouts.npy
#   drafter     the DFlash drafter                                      -> RUN/drafter/, metrics_drafter.json
#   eval        tau of dflash / ngram / hybrid at blocks 4, 8, 16       -> RUN/metrics_eval.json
#   summary     one JSON of everything                                  -> RUN/metrics.json
#   assets      copy the pair into pdflash/assets/demo/{target,drafter}
# Extra arguments per stage: TOKENIZER_ARGS, TARGET_ARGS, ROLLOUT_ARGS, DRAFTER_ARGS, EVAL_ARGS (environment).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/demo}
STAGES=${2:-tokenizer,target,rollouts,drafter,eval,summary,assets}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
has() { [[ ",$STAGES," == *",$1,"* ]]; }
stage() { echo; echo "===== $1 ($(date +%H:%M:%S))"; }
mkdir -p "$RUN"

if has tokenizer; then stage tokenizer; $PY -m training.tokenizer --out "$RUN/target" ${TOKENIZER_ARGS:-}; fi
if has target; then stage target; $PY -m training.train_target --dir "$RUN/target" ${TARGET_ARGS:-}; fi
if has ngram_eval; then
  stage ngram_eval
  $PY -m training.eval_acceptance --target "$RUN/target" --out "$RUN/metrics_ngram.json" ${EVAL_ARGS:-}
fi
if has probe; then
  stage probe
  $PY -m training.train_dflash --target "$RUN/target" --out "$RUN/probe" --steps 60 --log-every 20 ${DRAFTER_ARGS:-}
  $PY -m training.eval_acceptance --target "$RUN/target" --drafter "$RUN/probe" --prompts 8 --blocks 16 \
    --out "$RUN/probe/metrics_eval.json" ${EVAL_ARGS:-}
fi
if has rollouts; then stage rollouts; $PY -m training.rollouts --target "$RUN/target" --out "$RUN/rollouts.npy" ${ROLLOUT_ARGS:-}; fi
if has drafter; then
  stage drafter
  $PY -m training.train_dflash --target "$RUN/target" --rollouts "$RUN/rollouts.npy" --out "$RUN/drafter" ${DRAFTER_ARGS:-}
fi
if has eval; then
  stage eval
  $PY -m training.eval_acceptance --target "$RUN/target" --drafter "$RUN/drafter" --out "$RUN/metrics_eval.json" ${EVAL_ARGS:-}
fi
if has summary; then stage summary; $PY -m training.summarize "$RUN"; fi
if has assets; then
  stage assets
  A=pdflash/assets/demo
  mkdir -p "$A/target" "$A/drafter"
  for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json; do
    cp "$RUN/target/$f" "$A/target/$f"
  done
  for f in config.json model.safetensors; do cp "$RUN/drafter/$f" "$A/drafter/$f"; done
  du -ch "$A"/target/* "$A"/drafter/* | tail -1
fi
echo "done: $STAGES"
