# syntax=docker/dockerfile:1.7
# embedding-operator: the kopf operator that reconciles EmbeddingService resources.
#
# Build from the repository root (the build context must contain pyproject.toml):
#   docker build -f images/operator.Dockerfile -t ghcr.io/embedding-operator/embedding-operator:0.1.0 .
#
# Only the `operator` extra is installed: no torch, no model code, a small image.

FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/operator \
      --shell /usr/sbin/nologin operator
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server/ server/
COPY operator/ operator/
RUN pip install ".[operator]" && rm -rf /src
WORKDIR /home/operator
USER 1000:1000
# kopf's liveness endpoint (`--liveness=http://0.0.0.0:8080/healthz`, set by the Helm chart).
EXPOSE 8080
ENTRYPOINT ["embedding-operator"]
CMD ["run"]
