"""``POST /v2/embed``: Cohere's v2 embed API, so Cohere SDK users can point at this server.

One embedding pass serves every requested ``embedding_types``: the float32 matrix is
computed once and each type is derived from it (see ``encoding.py`` for the quantization
rules). int8/uint8 are scaled from the L2-normalized vector whatever the server's
``normalize`` setting is, so they are comparable across requests.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from embedding_server.api.dependencies import (
    check_input_count,
    check_response_size,
    engine_for,
    pooled_dimensions,
)
from embedding_server.api.disconnect import cancel_on_disconnect
from embedding_server.api.encoding import cohere_bytes_per_dimension, cohere_embeddings
from embedding_server.api.ids import new_id
from embedding_server.api.prompts import prompt_name_for
from embedding_server.api.protocol import CohereEmbedRequest
from embedding_server.api.responses import encode_off_loop, json_response, timing_headers

router = APIRouter(tags=["Cohere"])


@router.post("/v2/embed", summary="Embed texts (Cohere v2-compatible)")
async def cohere_embed(body: CohereEmbedRequest, request: Request) -> Response:
    engine, lifecycle = engine_for(request, body.model)
    check_input_count(lifecycle, len(body.texts), "texts")
    value_bytes = cohere_bytes_per_dimension(body.embedding_types)
    dims = pooled_dimensions(engine, body.output_dimension)
    types = ",".join(body.embedding_types)
    check_response_size(lifecycle, len(body.texts), dims, value_bytes, f"embedding_types {types}")
    prompt_name = prompt_name_for(engine, None, body.input_type)
    result = await cancel_on_disconnect(
        request,
        engine.aembed(
            body.texts,
            dimensions=body.output_dimension,
            prompt_name=prompt_name,
            truncate=body.truncation(),
        ),
    )
    headers = timing_headers(result.timings, result.prompt_tokens)

    def encode() -> Response:
        content = {
            "id": new_id(),
            "embeddings": cohere_embeddings(result.embeddings, body.embedding_types),
            "texts": body.texts,
            "meta": {
                "api_version": {"version": "2"},
                "billed_units": {"input_tokens": result.prompt_tokens},
            },
            "response_type": "embeddings_by_type",
        }
        return json_response(content, headers)

    size = result.embeddings.shape[0] * dims * value_bytes + sum(map(len, body.texts))
    return await encode_off_loop(encode, size)
