"""How the model routes answer: pre-serialized JSON, vLLM's binary bodies (and their OpenAPI
description), and the TEI-style timing headers both carry.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from embedding_server.api.encoding import BINARY_MEDIA_TYPE, BinaryPayload, dumps, metadata_header
from embedding_server.results import StageTimings

JSON_MEDIA_TYPE = "application/json"


class JSONBytes(Response):
    """A response whose body is already-serialized JSON (no second encoding pass)."""

    media_type = JSON_MEDIA_TYPE


def json_response(content: object, headers: Mapping[str, str] | None = None) -> Response:
    return JSONBytes(dumps(content), headers=dict(headers) if headers else None)


BINARY_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON; or, for encoding_format bytes / bytes_only, the raw vectors.",
        "content": {BINARY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        "headers": {
            "metadata": {
                "description": "encoding_format bytes only: JSON {id, created, model, "
                "data: [{index, embed_dtype, endianness, start, end, shape}], usage}.",
                "schema": {"type": "string"},
            }
        },
    }
}
"""OpenAPI for routes that can answer with vLLM's binary encodings, next to their JSON."""


def binary_response(
    payload: BinaryPayload,
    headers: Mapping[str, str],
    *,
    with_metadata: bool,
    response_id: str,
    model: str,
    usage: Mapping[str, int],
) -> Response:
    """vLLM's binary answer: the body, plus (for ``bytes``, not ``bytes_only``) the
    ``metadata`` header ``{id, created, model, data: [items], usage}``.

    The header grows by ~100 bytes per input and HTTP clients cap header sizes (aiohttp at
    8 KiB, requests at 64 KiB per line, httpx at 100 KiB in all), so large batches are
    better asked for as ``bytes_only``, whose offsets follow from the shape.
    """
    all_headers = dict(headers)
    if with_metadata:
        all_headers["metadata"] = metadata_header(
            {
                "id": response_id,
                "created": int(time.time()),
                "model": model,
                "data": payload.items,
                "usage": dict(usage),
            }
        )
    return Response(payload.body, media_type=BINARY_MEDIA_TYPE, headers=all_headers)


def timing_headers(timings: StageTimings, tokens: int) -> dict[str, str]:
    """``x-tokenization-time``, ``x-queue-time``, ``x-inference-time`` (ms) and
    ``x-compute-tokens`` as TEI sends them, plus ``x-pooling-time`` (pool + head)."""

    def ms(name: str) -> str:
        return f"{float(getattr(timings, name)) * 1000.0:.3f}"

    return {
        "x-tokenization-time": ms("tokenize"),
        "x-queue-time": ms("queue"),
        "x-inference-time": ms("forward"),
        "x-pooling-time": ms("pool"),
        "x-compute-tokens": str(tokens),
    }
