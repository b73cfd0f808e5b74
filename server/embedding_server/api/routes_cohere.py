"""``POST /v2/embed``: Cohere's v2 embed API, so Cohere SDK users can point at this server.

One embedding pass serves every requested ``embedding_types``: the float32 matrix is
computed once and each type is derived from it (see ``encoding.py`` for the quantization
rules). int8/uint8 are scaled from the L2-normalized vector whatever the server's
``normalize`` setting is, so they are comparable across requests.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from embedding_server.api.common import (
    cancel_on_disconnect,
    check_input_count,
    engine_for,
    json_response,
    new_id,
    timing_headers,
)
from embedding_server.api.encoding import cohere_embeddings
from embedding_server.api.prompts import prompt_name_for
from embedding_server.api.protocol import CohereEmbedRequest
from embedding_server.errors import InvalidRequestError
from embedding_server.tokenization import Truncation

router = APIRouter(tags=["Cohere"])


def _truncation(body: CohereEmbedRequest) -> Truncation:
    base = Truncation.from_cohere(body.truncate)
    if body.max_tokens is None:
        return base
    if base.side is None:
        raise InvalidRequestError(
            "max_tokens needs truncate END or START; with NONE an "
            "over-long text is refused instead",
            param="max_tokens",
        )
    return Truncation(side=base.side, max_tokens=body.max_tokens, param="max_tokens")


@router.post("/v2/embed", summary="Embed texts (Cohere v2-compatible)")
async def cohere_embed(body: CohereEmbedRequest, request: Request) -> Response:
    engine, lifecycle = engine_for(request, body.model)
    check_input_count(lifecycle, len(body.texts), "texts")
    prompt_name = prompt_name_for(engine, None, body.input_type)
    result = await cancel_on_disconnect(
        request,
        engine.aembed(
            body.texts,
            dimensions=body.output_dimension,
            prompt_name=prompt_name,
            truncate=_truncation(body),
        ),
    )
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
    return json_response(content, timing_headers(result.timings, result.prompt_tokens))
