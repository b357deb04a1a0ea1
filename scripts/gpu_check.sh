#!/usr/bin/env bash
# Every GPU check in one command, in a few minutes on an H100/H200: what to run first on a GPU machine.
#   bash scripts/gpu_check.sh [OUT_DIR]        (default: $OUT, else gpu_check_out/)
# 1. the GPU tests (pytest -m gpu: graphs == eager bit for bit, fp32 CUDA == CPU == transformers, the
#    EAGLE reference fixture on CUDA, bf16 plain == transformers bf16, batched == alone, no host sync;
#    the services on CUDA where .whl/ brings their packages: bash scripts/gpu_wheels.sh);
# 2. the model-free benchmark (aerie bench --shape) on the Llama-3.1-8B shape, and SmolLM2-135M's, each
#    also measuring the paged attention kernel (AERIE_ATTENTION=paged) next to the default backend.
# 3. with GPU_PIPELINE=SHAPE (e.g. llama-3.1-8b): plain and EAGLE decoding through `aerie up` (separate
#    processes, gRPC, Redis) against the in-process engine on a random checkpoint of that shape
#    (aerie bench --shape SHAPE --pipeline; needs .whl/ as the services' tests do).
# Everything lands in OUT_DIR: pytest.txt, bench-*.json/.txt, pipeline-*.json/.txt, env.txt. GPU_BENCH_ARGS adds
# bench flags (e.g. --no-legacy); GPU_TEST_FILTER (a pytest -k expression) picks tests, GPU_TESTS=0 skips them;
# GPU_TEST_TIMEOUT / GPU_BENCH_TIMEOUT / GPU_BENCH_TOKENS / GPU_CHECK_SHAPES (empty: no benchmark) /
# GPU_PIPELINE_TIMEOUT tune it; GPU_PIPELINES picks the pipelines (aerie bench --pipelines, e.g. colocated,colocated-host),
# GPU_PIPELINE_ARGS adds flags (e.g. --interleave: those pipelines up at once, their requests in turn); GPU_PROFILE=1
# samples every service with py-spy meanwhile (--profile OUT_DIR/profile; its wheel is in .whl/). Uses the python that has torch
# with CUDA ($PYTHON, default python3), from the repository root, without installing aerie.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_check_out}}
PY=${PYTHON:-python3}
SHAPES=${GPU_CHECK_SHAPES-llama-3.1-8b smollm2-135m}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the services' wheels (scripts/gpu_wheels.sh; carried as .whl/): installed privately, ahead of the
# machine's own packages, so the services' GPU tests run (without them they skip, saying why)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aerie-site .whl/*.whl \
    && export PYTHONPATH=/tmp/aerie-site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/aerie-site/bin:$PATH  # (bin: py-spy)
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'transformers', transformers.__version__)"
  git rev-parse HEAD 2>/dev/null; } | tee "$OUT_DIR/env.txt"
# time limits fit a 15-minute device lease with its start: tests 4 min, the first shape 4.5, the others 2
# (GPU_PIPELINE adds up to 5: with it, trim the rest, e.g. GPU_TESTS=0 GPU_CHECK_SHAPES=);
# the benchmark writes its JSON after each group of measurements, so a shape cut short keeps what it measured
tests_rc=0
if [ "${GPU_TESTS:-1}" != 0 ]; then
  timeout "${GPU_TEST_TIMEOUT:-240}" "$PY" -m pytest -v -m gpu tests/gpu -p no:cacheprovider -o addopts="" -rs \
    ${GPU_TEST_FILTER:+-k "$GPU_TEST_FILTER"} 2>&1 \
    | tee "$OUT_DIR/pytest.txt"
  tests_rc=${PIPESTATUS[0]}
fi
bench_rc=0
limit=${GPU_BENCH_TIMEOUT:-270}
for shape in $SHAPES; do
  timeout "$limit" "$PY" -m aerie_cli bench --shape "$shape" --device cuda \
    --max-new-tokens "${GPU_BENCH_TOKENS:-64}" ${GPU_BENCH_ARGS:-} --json-out "$OUT_DIR/bench-$shape.json" 2>&1 \
    | tee "$OUT_DIR/bench-$shape.txt"
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || bench_rc=$rc
  limit=${GPU_BENCH_TIMEOUT:-120}
done
if [ -n "${GPU_PIPELINE:-}" ]; then
  timeout "${GPU_PIPELINE_TIMEOUT:-360}" "$PY" -m aerie_cli bench --shape "$GPU_PIPELINE" --device cuda --pipeline \
    --max-new-tokens "${GPU_BENCH_TOKENS:-64}" --repeats 3 ${GPU_PIPELINES:+--pipelines "$GPU_PIPELINES"} ${GPU_PIPELINE_ARGS:-} \
    ${GPU_PROFILE:+--profile "$OUT_DIR/profile"} \
    --json-out "$OUT_DIR/pipeline-$GPU_PIPELINE.json" 2>&1 \
    | tee "$OUT_DIR/pipeline-$GPU_PIPELINE.txt"
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || bench_rc=$rc
fi
echo "gpu_check: tests exit $tests_rc, bench exit $bench_rc (results in $OUT_DIR)"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
