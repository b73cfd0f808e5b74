"""The operational endpoints: ``/health``, ``/ready``, ``/load``, ``/info``, ``/golden``,
``/metrics``.

``/health`` is liveness: 200 for as long as the process can answer at all, so a slow model
load never gets the pod killed. ``/ready`` is readiness: 503 until the model is loaded and
warmed up, and 503 again from the moment a drain starts, so traffic moves elsewhere while
in-flight work finishes. ``/load`` is what a gateway polls every few tens of milliseconds to
pick the least-loaded pod: four numbers read from the scheduler, no Prometheus rendering.
``/metrics`` follows readiness: the autoscaling gauges are there only
while ``/ready`` would answer 200. ``/golden`` serves the probe set's vectors as this server
embeds them and their check against ``--golden-vectors`` (``api/golden.py``); while they
differ, ``/ready`` answers 503 ``vectors_changed``.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from embedding_server.api.errors import error_response
from embedding_server.api.lifecycle import lifecycle_of
from embedding_server.api.responses import json_response
from embedding_server.fingerprint import ExpectedFingerprint
from embedding_server.request.golden import PROBE_SET
from embedding_server.request.scheduler import EngineLoad

router = APIRouter()


@router.get("/health", tags=["Operations"], summary="Liveness: 200 while the process runs")
async def health() -> Response:
    return json_response({"status": "ok"})


@router.get(
    "/ready",
    tags=["Operations"],
    summary="Readiness: 200 once the model is warmed up, 503 while loading or draining",
)
async def ready(request: Request) -> Response:
    lifecycle = lifecycle_of(request)
    if lifecycle.is_ready():
        return json_response({"status": "ready"})
    if lifecycle.draining:
        message = "The server is shutting down."
    elif (
        lifecycle.golden is not None
        and lifecycle.golden.changed
        and lifecycle.engine is not None
        and lifecycle.refusal is None
    ):
        # The fingerprints and the cosines are no secret (GET /golden serves them too).
        message = lifecycle.golden.check.message(lifecycle.engine.info().fingerprint)
        return error_response(503, message, code="vectors_changed")
    elif lifecycle.refusal is not None and lifecycle.engine is not None:
        # The fingerprints are no secret (every answer carries one); what differs is logged.
        info = lifecycle.engine.info()
        expected = lifecycle.settings.expect_fingerprint or ""
        message = (
            f"The model's embedding fingerprint is {info.fingerprint}, not the one "
            f"--expect-fingerprint gives ({ExpectedFingerprint.parse(expected).fingerprint}): "
            "it is not served. The server log says which inputs differ."
        )
        return error_response(503, message, code="fingerprint_mismatch")
    elif lifecycle.failure is not None:
        # Fixed text: /ready is open without the API key, and a failure's details belong in
        # the log, which only the operator reads.
        message = "The model could not be loaded; the server log says why."
    else:
        message = "The model is still loading."
    return error_response(503, message, code="not_ready")


@router.get(
    "/load",
    tags=["Operations"],
    summary="The work ahead of a new request: queued and running tokens, backlog seconds",
)
async def load(request: Request) -> Response:
    # Open without the API key, as /ready: the numbers say how busy the pod is, nothing of
    # what it serves. 200 when ready, 503 (with the same body) when not, so a gateway reads
    # both the pod's readiness and its backlog from one poll.
    lifecycle = lifecycle_of(request)
    ready = lifecycle.is_ready()
    engine = lifecycle.engine
    current = engine.load() if engine is not None and engine.ready else EngineLoad()
    content = {
        "ready": ready,
        "queued_tokens": current.queued_tokens,
        "running_tokens": current.running_tokens,
        "backlog_seconds": round(current.backlog_seconds, 6),
    }
    response = json_response(content)
    if not ready:
        response.status_code = 503
    return response


@router.get("/info", tags=["Operations"], summary="The resolved model configuration")
async def info(request: Request) -> Response:
    lifecycle = lifecycle_of(request)
    settings = lifecycle.settings
    content: dict[str, object] = {
        "served_model_name": lifecycle.served_model_name,
        "version": request.app.version,
        "ready": lifecycle.is_ready(),
        "max_request_bytes": settings.max_request_bytes,
        "max_inputs_per_request": settings.max_inputs_per_request,
        "max_response_bytes": settings.max_response_bytes,
        "auto_truncate": settings.auto_truncate,
    }
    if lifecycle.engine is not None:
        content.update(lifecycle.engine.info().to_dict())
    if lifecycle.golden is not None:
        content["golden"] = {"probe_set": PROBE_SET, **lifecycle.golden.check.to_dict()}
    return json_response(content)


@router.get(
    "/golden",
    tags=["Operations"],
    summary="The probe set's vectors as served, and their check against --golden-vectors",
)
async def golden(request: Request) -> Response:
    # Open without the API key, as /ready: fixed texts' vectors and the fingerprint (which
    # every answer carries), what an operator records from the first ready pod.
    lifecycle = lifecycle_of(request)
    engine, vectors = lifecycle.engine, lifecycle.golden
    if engine is None or vectors is None or not vectors.prepared:
        message = (
            "The model could not be loaded; the server log says why."
            if lifecycle.failure is not None
            else "The golden vectors are not embedded yet: the model is still loading."
        )
        return error_response(503, message, code="not_ready")
    answer = await asyncio.to_thread(vectors.answer, engine.info(), lifecycle.served_model_name)
    return json_response(answer)


@router.get("/metrics", tags=["Operations"], summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    # Not ready, the server leaves out the gauges autoscalers read (metrics.py says why).
    lifecycle = lifecycle_of(request)
    ready = lifecycle.is_ready()
    golden = lifecycle.golden
    changed = golden is not None and golden.changed
    loading = not ready and not lifecycle.draining and lifecycle.failure is None and not changed
    body = lifecycle.metrics.render(
        ready=ready,
        loading=loading,
        golden_min_cosine=golden.min_cosine_metric() if golden is not None else None,
    )
    return Response(body, media_type=CONTENT_TYPE_LATEST)
