"""``POST /v1/embeddings`` and ``GET /v1/models``: the OpenAI surface, with vLLM's extras.

The official ``openai`` client asks for ``encoding_format=base64`` by default and decodes
the bytes as little-endian float32, so the base64 path is the hot path: it goes from the
engine's float32 matrix to base64 with one ``tobytes``, never through Python floats.

vLLM's ``bytes`` / ``bytes_only`` encodings skip JSON altogether: the body is the matrix's
buffer in the requested element type and byte order, and (for ``bytes``) a ``metadata``
header says where each vector lies. The official client cannot read those; vLLM's
clients use plain HTTP.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from embedding_server.api.dependencies import (
    Served,
    as_input_list,
    check_input_count,
    check_response_size,
    model_route,
    pooled_dimensions,
)
from embedding_server.api.encoding import (
    FloatMatrix,
    base64_rows,
    bytes_per_value,
)
from embedding_server.api.lifecycle import lifecycle_of
from embedding_server.api.media import check_input_form, messages_input
from embedding_server.api.prompts import check_task_adapter, input_type_prompts, prompt_name_for
from embedding_server.api.protocol import EmbeddingRequest
from embedding_server.api.responses import (
    BINARY_FORMATS,
    BINARY_RESPONSES,
    binary_response,
    check_metadata_fits,
    encode_off_loop,
    json_response,
    timing_headers,
    usage,
)
from embedding_server.request.media.preprocessing import ImageInput

router = APIRouter(tags=["OpenAI"])

_CREATED = int(time.time())


@router.post(
    "/v1/embeddings", summary="Create embeddings (OpenAI-compatible)", responses=BINARY_RESPONSES
)
@model_route
async def create_embeddings(body: EmbeddingRequest, served: Served) -> Response:
    engine, lifecycle = served.engine, served.lifecycle
    check_input_form(body)
    special = body.add_special_tokens
    templated = False
    inputs: list[Any]
    if body.messages is not None:
        # One embedding for the conversation (vLLM's chat form).
        # Cancelled if the client goes: its images' reservations come back at once.
        chat = await served.run(messages_input(engine, lifecycle, body))
        inputs, special, templated = [chat.item], chat.add_special_tokens, chat.templated
    else:
        assert body.input is not None
        inputs = as_input_list(body.input)
    check_input_count(lifecycle, len(inputs), "input")
    value_bytes = bytes_per_value(body.encoding_format, body.embed_dtype)
    dims = pooled_dimensions(engine, body.dimensions)
    check_response_size(lifecycle, len(inputs), dims, value_bytes, body.encoding_format)
    check_metadata_fits(body.encoding_format, len(inputs))
    # input_type picks a text prompt where the model has one; an image has none (an explicit
    # prompt_name for images alone is refused by the engine).
    images_only = all(isinstance(item, ImageInput) for item in inputs)
    input_type_prompts(engine, body.input_type)  # an unknown one is a 400, used or not
    input_type = None if images_only or templated else body.input_type
    prompt_name = prompt_name_for(engine, body.prompt_name, input_type)
    # A chat template formats its text itself: no prompt (the default one either) before it.
    prompt = "" if templated else None
    check_task_adapter(engine, body.task)
    result = await served.run(
        engine.aembed(
            inputs,
            dimensions=body.dimensions,
            normalize=body.normalize,
            prompt=prompt,
            prompt_name=prompt_name,
            adapter=body.task,
            truncate=body.truncation(auto=served.auto_truncate),
            add_special_tokens=special,
        )
    )
    matrix = result.embeddings
    headers = timing_headers(result.timings, result.prompt_tokens)

    def encode() -> Response:
        if body.encoding_format in BINARY_FORMATS:
            model, tokens = served.model_name, result.prompt_tokens
            return binary_response(matrix, body, headers, kind="embd", model=model, tokens=tokens)
        rows: list[str] | list[FloatMatrix] = (
            base64_rows(matrix, body.embed_dtype, body.endianness)
            if body.encoding_format == "base64"
            else list(matrix)
        )
        content = {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)
            ],
            "model": served.model_name,
            "usage": usage(result.prompt_tokens),
        }
        return json_response(content, headers)

    return await encode_off_loop(encode, matrix.size * value_bytes)


@router.get("/v1/models", summary="List the served model (OpenAI-compatible)")
async def list_models(request: Request) -> Response:
    lifecycle = lifecycle_of(request)
    entry: dict[str, object] = {
        "id": lifecycle.served_model_name,
        "object": "model",
        "created": _CREATED,
        "owned_by": "embedding-server",
        "root": lifecycle.settings.model,
        # The gateway's /v1/models has the same field: the other names 'model' may take.
        "aliases": [
            a for a in lifecycle.settings.served_model_aliases if a != lifecycle.served_model_name
        ],
    }
    if lifecycle.engine is not None:
        info = lifecycle.engine.info()
        entry["max_model_len"] = info.max_input_tokens
        entry["dimensions"] = info.dimensions
        entry["modalities"] = info.modalities
    return json_response({"object": "list", "data": [entry]})
