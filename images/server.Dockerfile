# syntax=docker/dockerfile:1.7
# embedding-server: the continuous-batching embedding server on a CUDA runtime.
#
# Build from the repository root (the build context must contain pyproject.toml):
#   docker build -f images/server.Dockerfile -t ghcr.io/embedding-operator/embedding-server:0.1.0 .
#   # with flash-attn varlen kernels (compiled in the devel stage; slow, needs lots of RAM):
#   docker build -f images/server.Dockerfile --build-arg FLASH_ATTN=1 \
#     -t ghcr.io/embedding-operator/embedding-server:0.1.0-flash .
#
# Two stages so that nvcc and the compilers needed to build flash-attn never reach the
# runtime image: the builder fills a virtualenv at /opt/venv, the runtime stage copies it onto
# the slimmer CUDA runtime image of the same Ubuntu release (same /usr/bin/python3.12).

ARG CUDA_VERSION=12.6.3
ARG UBUNTU_VERSION=24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS builder
# The PyTorch wheel index matching the CUDA major.minor above (cu126 for 12.6).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
# 1 compiles flash-attn (the `gpu` extra); 0 keeps torch SDPA attention.
ARG FLASH_ATTN=0
ARG MAX_JOBS=4
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CUDA index, so the `server` extra below finds it already satisfied.
RUN pip install --upgrade pip wheel setuptools \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.4"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server/ server/
COPY operator/ operator/
RUN pip install ".[server]"
RUN if [ "${FLASH_ATTN}" = "1" ]; then \
      pip install packaging ninja && MAX_JOBS="${MAX_JOBS}" pip install --no-build-isolation ".[gpu]"; \
    fi

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# Ubuntu 24.04 images ship a user `ubuntu` with uid 1000; replace it with ours.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && useradd --uid 1000 --user-group --create-home --home-dir /home/embedding \
      --shell /usr/sbin/nologin embedding \
 && mkdir -p /models && chown 1000:1000 /models
COPY --from=builder /opt/venv /opt/venv
# HF_HOME points the Hugging Face cache at /models: mount a PersistentVolume there to keep
# downloaded weights across restarts. The packaged all-MiniLM-L6-v2 needs no download.
ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/models \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/embedding
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["embedding-server"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
