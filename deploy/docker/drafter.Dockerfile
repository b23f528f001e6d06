# syntax=docker/dockerfile:1
# splitspec drafter image: the drafter SDK and its built-in n-gram and suffix drafters
# (numpy for the suffix drafter's long lists). No torch. Build context is the repository root:
#   docker build -f deploy/docker/drafter.Dockerfile -t ghcr.io/splitspec/drafter:0.1.0 .
# Your own drafter: FROM this image, COPY your module, and run
#   splitspec-drafter my_module:MyDrafter --host [::] --port 50052
ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# The versions the test suite last passed with (.ci/constraints.txt): a rebuild installs the same.
COPY pyproject.toml README.md .ci/constraints.txt ./
COPY drafter_sdk/ drafter_sdk/
RUN pip install -c constraints.txt ".[suffix]" && pip check

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="splitspec-drafter" \
      org.opencontainers.image.description="splitspec remote drafter (gRPC DrafterService), n-gram and suffix built in" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 splitspec \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin splitspec
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
USER 10001:10001
WORKDIR /tmp
# 50052: gRPC (DrafterService, grpc.health.v1, reflection); 9090: Prometheus /metrics
EXPOSE 50052 9090
ENTRYPOINT ["splitspec-drafter"]
CMD ["ngram", "--host", "[::]", "--port", "50052", "--metrics-port", "9090"]
