# embedding-operator: the kopf operator that reconciles EmbeddingService resources.
#
# The build context is a directory that e2e/harness/images/ assembles (nothing here reaches PyPI):
#   requirements.lock  images/operator.lock, the pinned dependencies
#   wheels/            exactly the wheels that lock names (`pip download` on the host)
#   dist/              the embedding-operator wheel (`pip wheel --no-deps .` on the host)
# `python -m e2e.harness.images build` runs this; by hand:
#   docker build -f images/operator.Dockerfile -t ghcr.io/embedding-operator/embedding-operator:0.1.0 CONTEXT
#
# Only the `operator` extra is installed: no torch, no model code, a small image. Wheels are
# bind-mounted into the RUN steps (BuildKit, DOCKER_BUILDKIT=1), never copied into a layer.
# No `# syntax=` line: that would pull a frontend image from a registry.

# debian:bookworm-slim from a registry, or the local debootstrap import e2e/harness/images/ passes.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# The account is `embedding` (uid 1000) as in the server image: Debian has a group `operator`.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && python3 -m venv /opt/venv \
 && useradd --uid 1000 --user-group --create-home --home-dir /home/embedding \
      --shell /usr/sbin/nologin embedding
ENV PATH=/opt/venv/bin:$PATH
# The dependencies first, keyed on the lock: a code change rebuilds only the layer below.
RUN --mount=type=bind,source=requirements.lock,target=/ctx/requirements.lock \
    --mount=type=bind,source=wheels,target=/ctx/wheels \
    pip install --no-index --find-links /ctx/wheels -r /ctx/requirements.lock
RUN --mount=type=bind,source=requirements.lock,target=/ctx/requirements.lock \
    --mount=type=bind,source=wheels,target=/ctx/wheels \
    --mount=type=bind,source=dist,target=/ctx/dist \
    pip install --no-index --find-links /ctx/wheels --find-links /ctx/dist \
      -c /ctx/requirements.lock "embedding-operator[operator]"
ENV PYTHONUNBUFFERED=1
WORKDIR /home/embedding
USER 1000:1000
# kopf's liveness endpoint (`--liveness=http://0.0.0.0:8080/healthz`, set by the Helm chart).
EXPOSE 8080
ENTRYPOINT ["embedding-operator"]
CMD ["run"]
