"""The vLLM-style extras (``/pooling``, ``/score``, ``/tokenize``, ``/detokenize``) and the
operational endpoints (``/health``, ``/ready``, ``/info``, ``/metrics``).

``/health`` is liveness: 200 for as long as the process can answer at all, so a slow model
load never gets the pod killed. ``/ready`` is readiness: 503 until the model is loaded and
warmed up, and 503 again from the moment a drain starts, so traffic moves elsewhere while
in-flight work finishes.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from embedding_server.api.common import (
    BINARY_RESPONSES,
    as_input_list,
    binary_response,
    cancel_on_disconnect,
    check_input_count,
    engine_for,
    json_response,
    new_id,
    timing_headers,
)
from embedding_server.api.encoding import (
    FloatMatrix,
    as_float32,
    base64_array,
    binary_payload,
    l2_normalize,
)
from embedding_server.api.errors import error_response
from embedding_server.api.lifecycle import lifecycle_of
from embedding_server.api.protocol import (
    DetokenizeRequest,
    PoolingRequest,
    ScoreRequest,
    TokenizeRequest,
)
from embedding_server.tokenization import Truncation

router = APIRouter()


@router.post(
    "/pooling",
    tags=["vLLM"],
    summary="Per-token (or pooled) hidden states",
    responses=BINARY_RESPONSES,
)
async def pooling(body: PoolingRequest, request: Request) -> Response:
    engine, lifecycle = engine_for(request, body.model)
    inputs = as_input_list(body.input)
    check_input_count(lifecycle, len(inputs), "input")
    truncation = Truncation.from_openai(body.truncate_prompt_tokens, body.truncation_side)
    # One output per input: a pooled matrix's rows (task embed) or per-token matrices.
    outputs: FloatMatrix | list[FloatMatrix]
    if body.task == "embed":
        pooled = await cancel_on_disconnect(
            request,
            engine.aembed(
                inputs,
                normalize=body.normalize,
                truncate=truncation,
                add_special_tokens=body.add_special_tokens,
            ),
        )
        outputs = as_float32(pooled.embeddings)
        tokens, timings = pooled.prompt_tokens, pooled.timings
    else:
        per_token = await cancel_on_disconnect(
            request,
            engine.aembed_tokens(
                inputs, truncate=truncation, add_special_tokens=body.add_special_tokens
            ),
        )
        outputs = [
            l2_normalize(as_float32(m)) if body.normalize else as_float32(m)
            for m in per_token.embeddings
        ]
        tokens, timings = per_token.prompt_tokens, per_token.timings
    headers = timing_headers(timings, tokens)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    response_id = f"pool-{new_id()}"
    if body.encoding_format in ("bytes", "bytes_only"):
        return binary_response(
            binary_payload(outputs, body.embed_dtype, body.endianness),
            headers,
            with_metadata=body.encoding_format == "bytes",
            response_id=response_id,
            model=lifecycle.served_model_name,
            usage=usage,
        )
    data: list[dict[str, object]] = []
    for i, output in enumerate(outputs):
        payload_json: object = output
        if body.encoding_format == "base64":
            payload_json = base64_array(output, body.embed_dtype, body.endianness)
        data.append({"index": i, "object": "pooling", "data": payload_json})
    content = {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": lifecycle.served_model_name,
        "data": data,
        "usage": usage,
    }
    return json_response(content, headers)


@router.post("/score", tags=["vLLM"], summary="Cosine similarity of text pairs")
async def score(body: ScoreRequest, request: Request) -> Response:
    engine, lifecycle = engine_for(request, body.model)
    count_1 = 1 if isinstance(body.text_1, str) else len(body.text_1)
    count_2 = 1 if isinstance(body.text_2, str) else len(body.text_2)
    check_input_count(lifecycle, count_1, "text_1")
    check_input_count(lifecycle, count_2, "text_2")
    truncation = Truncation.from_openai(body.truncate_prompt_tokens, body.truncation_side)
    result = await cancel_on_disconnect(
        request, engine.ascore(body.text_1, body.text_2, truncate=truncation)
    )
    content = {
        "id": f"score-{new_id()}",
        "object": "list",
        "created": int(time.time()),
        "model": lifecycle.served_model_name,
        "data": [
            {"index": i, "object": "score", "score": float(s)} for i, s in enumerate(result.scores)
        ],
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }
    return json_response(content, timing_headers(result.timings, result.prompt_tokens))


@router.post("/tokenize", tags=["vLLM"], summary="Text to token ids")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    engine, _ = engine_for(request, body.model)
    ids = (await engine.atokenize(body.prompt, add_special_tokens=body.add_special_tokens))[0]
    token_strs = engine.token_strings(ids) if body.return_token_strs else None
    return json_response(
        {
            "count": len(ids),
            "max_model_len": engine.info().max_input_tokens,
            "tokens": ids,
            "token_strs": token_strs,
        }
    )


@router.post("/detokenize", tags=["vLLM"], summary="Token ids to text")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    engine, _ = engine_for(request, body.model)
    return json_response({"prompt": engine.detokenize(body.tokens)})


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
    else:
        message = lifecycle.failure or "The model is still loading."
    return error_response(503, message, code="not_ready")


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
    }
    if lifecycle.engine is not None:
        content.update(lifecycle.engine.info().to_dict())
    return json_response(content)


@router.get("/metrics", tags=["Operations"], summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    registry = lifecycle_of(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
