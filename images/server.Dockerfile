# embedding-server: the continuous-batching embedding server, CPU or CUDA, on Debian bookworm.
#
# The build context is a directory that e2e/harness/images/ assembles (nothing here reaches PyPI):
#   requirements.lock      images/server.lock, the pinned dependencies (PyPI's torch included)
#   requirements.cpu.lock  or images/server.cpu.lock, with TORCH_SOURCE=cpu (see below)
#   wheels/                exactly the wheels that lock names (`pip download` on the host)
#   dist/                  the embedding-operator wheel (`pip wheel --no-deps .` on the host)
# `python -m e2e.harness.images build` runs the CPU build the tests use; by hand:
#   docker build -f images/server.Dockerfile -t ghcr.io/embedding-operator/embedding-server:0.1.0 CONTEXT
#   # CUDA, with flash-attn varlen kernels compiled in a builder stage (slow, needs lots of RAM):
#   docker build -f images/server.Dockerfile --build-arg VARIANT=cuda \
#     -t ghcr.io/embedding-operator/embedding-server:0.1.0-cuda CONTEXT
#   # CPU only, torch from PyTorch's CPU wheel index (`build --torch-source cpu` stages it):
#   docker build -f images/server.Dockerfile --build-arg TORCH_SOURCE=cpu \
#     -t ghcr.io/embedding-operator/embedding-server:0.1.0-cpu CONTEXT
#
# PyPI's torch wheel carries its own CUDA runtime (the nvidia-* wheels in the lock), so the
# CPU image runs on GPUs too: only the driver comes from the node. VARIANT=cuda adds the `gpu`
# extra (flash-attn), built by nvcc in a stage whose toolchain never reaches the runtime image.
# TORCH_SOURCE=cpu installs the torch of https://download.pytorch.org/whl/cpu instead, which
# has no CUDA at all: the image is about 4.8 GB smaller and runs on CPUs only.
# That path is unbuilt and untested: the CPU index was unreachable where it was written, so no
# images/server.cpu.lock is committed and no CPU image has been built (docs/helm.md).
#
# GPU generations: the cpu variant serves any GPU torch's wheel supports (Turing sm75 and up
# with torch 2.15's CUDA 13 build), attention through torch's varlen kernel on Ampere and
# newer and padded SDPA before that. The cuda variant adds flash-attn for the archs in
# FLASH_ATTN_CUDA_ARCHS (default Ampere sm80, Hopper sm90, Blackwell sm100/sm120); older GPUs
# run it too, without flash-attn (the server says so at start).
# Wheels are bind-mounted into the RUN steps (BuildKit, DOCKER_BUILDKIT=1), never copied into
# a layer. No `# syntax=` line: that would pull a frontend image from a registry.

# debian:bookworm-slim from a registry, or the local debootstrap import e2e/harness/images/ passes.
ARG BASE_IMAGE=debian:bookworm-slim
# cpu or cuda.
ARG VARIANT=cpu
# Where torch comes from, and so which lock the image installs: pypi (PyPI's wheel, with its
# CUDA runtime; requirements.lock) or cpu (PyTorch's CPU wheel index; requirements.cpu.lock).
# The context holds the lock and wheels of the source it was staged for.
ARG TORCH_SOURCE=pypi

# The lock of each torch source, as /requirements.lock of a stage the RUN steps mount. Only
# the stage TORCH_SOURCE names is built, so the context needs only its lock.
FROM scratch AS lock-pypi
COPY requirements.lock /requirements.lock

FROM scratch AS lock-cpu
COPY requirements.cpu.lock /requirements.lock

FROM lock-${TORCH_SOURCE} AS lock

FROM ${BASE_IMAGE} AS python
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# bookworm's python3 is 3.11, the CPython the host-downloaded cp311 wheels are built for.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# The extra wheels of each variant, in /wheels. CPU: none.
FROM python AS extras-cpu
RUN mkdir -p /wheels

# CUDA: flash-attn (the `gpu` extra) compiled against the locked torch with NVIDIA's nvcc for
# Debian 12. CUDA_VERSION must be the CUDA release the locked torch was built with
# (torch.version.cuda); this stage alone reaches the network (NVIDIA's apt repository, PyPI for
# the flash-attn sources), so it is never built on machines without them.
FROM python AS extras-cuda
ARG TORCH_SOURCE
# flash-attn is compiled against the CUDA build of torch: the CPU one has no CUDA to build on.
RUN if [ "${TORCH_SOURCE}" != pypi ]; then \
      echo "VARIANT=cuda needs TORCH_SOURCE=pypi (got ${TORCH_SOURCE})" >&2; exit 1; \
    fi
ARG CUDA_VERSION=13-2
ARG FLASH_ATTN_VERSION=2.8.3
# The compute capabilities compiled in (flash-attn 2 needs sm80+); fewer archs build faster.
ARG FLASH_ATTN_CUDA_ARCHS="80;90;100;120"
ARG MAX_JOBS=4
ADD https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb /tmp/cuda-keyring.deb
RUN dpkg -i /tmp/cuda-keyring.deb && rm /tmp/cuda-keyring.deb \
 && apt-get update \
 && apt-get install -y --no-install-recommends \
      cuda-minimal-build-${CUDA_VERSION} cuda-libraries-dev-${CUDA_VERSION} \
      python3-dev g++ git \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
# FLASH_ATTENTION_FORCE_BUILD: compile against the locked torch, never fetch a prebuilt wheel
# made for another torch.
ENV CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH \
    FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS} \
    FLASH_ATTENTION_FORCE_BUILD=TRUE
RUN --mount=type=bind,from=lock,source=/requirements.lock,target=/ctx/requirements.lock \
    --mount=type=bind,source=wheels,target=/ctx/wheels \
    pip install --no-index --find-links /ctx/wheels -r /ctx/requirements.lock \
 && pip install packaging ninja psutil wheel -c /ctx/requirements.lock \
 && mkdir -p /wheels \
 && MAX_JOBS="${MAX_JOBS}" pip wheel --no-build-isolation --no-deps -w /wheels \
      "flash-attn==${FLASH_ATTN_VERSION}" \
 && pip download --no-deps -d /wheels einops

FROM extras-${VARIANT} AS extras

FROM python AS runtime
ARG VARIANT=cpu
ARG TORCH_SOURCE
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/embedding \
      --shell /usr/sbin/nologin embedding \
 && mkdir -p /models && chown 1000:1000 /models
# The dependencies first, keyed on the lock: a code change rebuilds only the layers below.
# torch's pin becomes a pip constraint for good (PIP_CONSTRAINT): no later step, here or in an
# image built FROM this one, can swap the torch that flash-attn was compiled against.
# With TORCH_SOURCE=cpu, a lock that let any CUDA package in fails the build here.
RUN --mount=type=bind,from=lock,source=/requirements.lock,target=/ctx/requirements.lock \
    --mount=type=bind,source=wheels,target=/ctx/wheels \
    pip install --no-index --find-links /ctx/wheels -r /ctx/requirements.lock \
 && grep -E '^torch==' /ctx/requirements.lock > /etc/pip-constraints.txt \
 && if [ "${TORCH_SOURCE}" = cpu ]; then \
      python -c "import importlib.metadata as m, torch; cuda = sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].lower().startswith(('nvidia', 'triton', 'cuda'))); assert torch.version.cuda is None and not cuda, (torch.version.cuda, cuda)"; \
    fi
ENV PIP_CONSTRAINT=/etc/pip-constraints.txt
# Then the package with the `server` extra (plus `gpu` for cuda); the lock as constraints and
# --no-index make sure nothing replaces the torch installed above.
RUN --mount=type=bind,from=lock,source=/requirements.lock,target=/ctx/requirements.lock \
    --mount=type=bind,source=wheels,target=/ctx/wheels \
    --mount=type=bind,source=dist,target=/ctx/dist \
    --mount=type=bind,from=extras,source=/wheels,target=/ctx/extras \
    extra=server; if [ "${VARIANT}" = cuda ]; then extra=server,gpu; fi \
 && pip install --no-index --find-links /ctx/wheels --find-links /ctx/dist \
      --find-links /ctx/extras -c /ctx/requirements.lock "embedding-operator[${extra}]" \
 && if [ "${VARIANT}" = cuda ]; then \
      python -c "import flash_attn, flash_attn_2_cuda; print('flash-attn', flash_attn.__version__)"; \
    fi
# HF_HOME points the Hugging Face cache at /models: mount a PersistentVolume there to keep
# downloaded weights across restarts. The packaged all-MiniLM-L6-v2 needs no download.
# expandable_segments: batches of varying shape reuse memory instead of fragmenting it.
ENV HF_HOME=/models \
    PYTHONUNBUFFERED=1 \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
WORKDIR /home/embedding
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["embedding-server"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
