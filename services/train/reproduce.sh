#!/bin/bash
# The shipped head (services/heads/smollm2-135m-eagle, EAGLE-3) end to end, resumable at every stage
# (re-run the same command to continue):
#   1. the target's greedy answers to the Spec-Bench dev prompts (EVALUATION ONLY) -> $DEV
#   2. self-distillation data from prompts with no Spec-Bench question            -> $DATA
#   3. head training (TTT, reduced-vocabulary loss, early stopping) in two stages:
#      fresh on the first 61 shards (~425k tokens) -> $OUT-a, then on every shard from it -> $OUT
#   4. per-position agreement on held-out data and the dev answers, and tau with the cost-model
#      budget on the dev prompts                                                   -> $OUT/report.json
# Environment: DEV_PROMPTS DATA DEV OUT TOKENS (answer tokens to generate) DEVICE (datagen: cpu|cuda) KIND
set -euo pipefail
cd "$(dirname "$0")/../.."
DEV_PROMPTS=${DEV_PROMPTS:-../shared/data/spec_bench_dev.jsonl}
DATA=${DATA:-/work/data/head-data}
DEV=${DEV:-/work/data/head-dev-full}
OUT=${OUT:-runs/head-eagle3}
TOKENS=${TOKENS:-1000000}
DEVICE=${DEVICE:-cpu}
KIND=${KIND:-eagle3}
PY=${PY:-.venv/bin/python}
export AERIE_TORCH_THREADS=${AERIE_TORCH_THREADS:-1}
$PY -m services.train.datagen --out "$DEV" --prompts "$DEV_PROMPTS" --device "$DEVICE" \
    --max-tokens 100000000 --batch 16 --max-new-tokens 128 --max-prompt-tokens 1024
$PY -m services.train.datagen --out "$DATA" --max-tokens "$TOKENS" --device "$DEVICE" \
    --batch 48 --max-new-tokens 256 --max-prompt-tokens 640
COMMON=(--data "$DATA" --dev-data "$DEV" --kind "$KIND" --draft-vocab 8192 --batch-size 8 --ttt-steps 3
        --eval-every 100 --patience 4 --heldout-every 10 --heldout-samples 16)
resume() { [ -f "$1/manifest.json" ] && echo --resume || true; }
[ -f "$OUT-a/report.json" ] || $PY -m services.train.pipeline "${COMMON[@]}" --out "$OUT-a" \
    --steps 700 --warmup 30 --lr 1e-3 --max-minutes 55 --max-shards 61 $(resume "$OUT-a")
$PY -m services.train.pipeline "${COMMON[@]}" --out "$OUT" --init "$OUT-a" \
    --steps 1200 --warmup 20 --lr 5e-4 --max-minutes 95 --tau-prompts "$DEV_PROMPTS" $(resume "$OUT")
