# The e2e tier's client pods: the server image (Python, httpx, numpy) plus the official
# `openai` package, so tests call Services from inside the cluster as applications do.
# Built by e2e/harness/images/ from a context holding requirements.lock (images/e2e-client.lock)
# and its wheels; pushed only where an existing cluster runs the e2e tier (e2e/README.md).

ARG SERVER_IMAGE=ghcr.io/embedding-operator/embedding-server:0.1.0
FROM ${SERVER_IMAGE}
USER 0:0
RUN --mount=type=bind,source=requirements.lock,target=/ctx/requirements.lock \
    --mount=type=bind,source=wheels,target=/ctx/wheels \
    pip install --no-index --find-links /ctx/wheels -r /ctx/requirements.lock
USER 1000:1000
ENTRYPOINT []
CMD ["python"]
