#!/bin/bash
# The head pipeline end to end, resumable at every stage (re-run the same command to continue):
#   1. the target's greedy answers to the Spec-Bench dev prompts (EVALUATION ONLY) -> $DEV
#   2. self-distillation data from prompts with no Spec-Bench question            -> $DATA
#   3. EAGLE-2 head training (TTT, reduced-vocabulary loss, early stopping)       -> $OUT
#   4. per-position agreement on held-out data and on the dev answers            -> $OUT/report.json
# Environment: DEV_PROMPTS DATA DEV OUT TOKENS (answer tokens to generate) DEVICE (datagen: cpu|cuda) KIND INIT
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-/work/data/head-data}
DEV=${DEV:-/work/data/head-dev}
OUT=${OUT:-runs/head-eagle}
TOKENS=${TOKENS:-1000000}
DEVICE=${DEVICE:-cpu}
KIND=${KIND:-eagle}
INIT=${INIT-services/heads/smollm2-135m-eagle}
PY=${PY:-.venv/bin/python}
export AERIE_TORCH_THREADS=${AERIE_TORCH_THREADS:-1}
$PY -m services.train.datagen --out "$DEV" --prompts "${DEV_PROMPTS:-../shared/data/spec_bench_dev.jsonl}" --device "$DEVICE" \
    --max-tokens 100000000 --batch 24 --max-new-tokens 128 --max-prompt-tokens 4096
$PY -m services.train.datagen --out "$DATA" --max-tokens "$TOKENS" --device "$DEVICE" \
    --batch 48 --max-new-tokens 256 --max-prompt-tokens 640
RESUME=""; [ -f "$OUT/manifest.json" ] && RESUME="--resume"
$PY -m services.train.pipeline --data "$DATA" --dev-data "$DEV" --out "$OUT" --kind "$KIND" \
    --draft-vocab 8192 ${INIT:+--init "$INIT"} --steps 4000 --eval-every 100 --patience 4 $RESUME
