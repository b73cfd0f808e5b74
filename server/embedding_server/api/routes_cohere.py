"""``POST /v2/embed``: Cohere's v2 embed API, so Cohere SDK users can point at this server.

One embedding pass serves every requested ``embedding_types``: the float32 matrix is
computed once and each type is derived from it (see ``encoding.py`` for the quantization
rules). int8/uint8 are scaled from the L2-normalized vector whatever the server's
``normalize`` setting is, so they are comparable across requests.

``embedding_types: ["sparse"]`` (our extension; Cohere has no sparse type) asks a SPLADE
model (task sparse) for each text's weights over the vocabulary, ``{indices, values}`` under
``embeddings.sparse``, the shape ``/pooling`` task sparse gives. Its response size is
bounded before the forward pass by the vocabulary size, or by the request's
``max_active_dims``.

A bge-m3-shaped model (``info().outputs`` lists ``sparse`` and ``multi_vector``) serves any
mix of Cohere's dense types, ``sparse`` (its lexical weights) and ``multi_vector`` (our
extension too: each text's ColBERT vectors under ``embeddings.multi_vector``) from one
forward pass.
"""

from __future__ import annotations

from typing import Any, cast

from fastapi import APIRouter
from starlette.responses import Response

from embedding_server.api.dependencies import (
    Served,
    check_input_count,
    check_response_size,
    check_sparse_request,
    model_route,
    pooled_dimensions,
    require_outputs,
)
from embedding_server.api.encoding import (
    JSON_FLOAT_BYTES,
    CohereEmbeddingType,
    cohere_bytes_per_dimension,
    cohere_embeddings,
)
from embedding_server.api.ids import new_id
from embedding_server.api.media import cohere_parts, load_parts
from embedding_server.api.prompts import input_type_prompts, prompt_name_for
from embedding_server.api.protocol import CohereEmbedRequest
from embedding_server.api.responses import encode_off_loop, json_response, timing_headers
from embedding_server.errors import InvalidRequestError

router = APIRouter(tags=["Cohere"])


@router.post("/v2/embed", summary="Embed texts (Cohere v2-compatible)")
@model_route
async def cohere_embed(body: CohereEmbedRequest, served: Served) -> Response:
    engine, lifecycle = served.engine, served.lifecycle
    if body.texts is None or body.images is not None or body.inputs is not None:
        return await _multimodal_embed(body, served)
    if body.input_type == "image":
        raise InvalidRequestError(
            "input_type image applies to images; texts take search_document, search_query, "
            "classification, clustering or one of the model's prompt names",
            param="input_type",
        )
    check_input_count(lifecycle, len(body.texts), "texts")
    extensions = [t for t in body.embedding_types if t in _EXTENSIONS]
    if engine.info().outputs == ["multi_vector"]:  # a ColBERT model
        return await _colbert_embed(body, served)
    if extensions and "multi_vector" in engine.info().outputs:
        return await _hybrid_embed(body, served)
    if "multi_vector" in extensions:
        require_outputs(engine, ["multi_vector"], "embedding_types multi_vector")
    if "sparse" in body.embedding_types:
        return await _sparse_embed(body, served)
    if body.max_active_dims is not None:
        raise InvalidRequestError(
            "max_active_dims applies to embedding_types sparse only", param="max_active_dims"
        )
    # Neither extension is among them: the rest are Cohere's dense types.
    dense_types = cast(list[CohereEmbeddingType], body.embedding_types)
    value_bytes = cohere_bytes_per_dimension(dense_types)
    dims = pooled_dimensions(engine, body.output_dimension)
    types = ",".join(dense_types)
    check_response_size(lifecycle, len(body.texts), dims, value_bytes, f"embedding_types {types}")
    result = await served.run(
        engine.aembed(
            body.texts,
            dimensions=body.output_dimension,
            prompt_name=prompt_name_for(engine, None, body.input_type),
            truncate=body.truncation(),
        )
    )
    headers = timing_headers(result.timings, result.prompt_tokens)

    def encode() -> Response:
        embeddings = cohere_embeddings(result.embeddings, dense_types)
        return json_response(_content(body, embeddings, result.prompt_tokens), headers)

    size = result.embeddings.shape[0] * dims * value_bytes + sum(map(len, body.texts))
    return await encode_off_loop(encode, size)


_EXTENSIONS = ("sparse", "multi_vector")


async def _multimodal_embed(body: CohereEmbedRequest, served: Served) -> Response:
    """``images`` (each one embedding) or ``inputs`` (each input object one embedding: one
    part on a dual encoder), in Cohere's dense types. The sparse and multi-vector
    extensions are text-only, so they are refused here rather than dropped."""
    engine, lifecycle = served.engine, served.lifecycle
    parts, param = cohere_parts(body)
    check_input_count(lifecycle, len(parts), param)
    extensions = [t for t in body.embedding_types if t in _EXTENSIONS]
    if extensions:
        raise InvalidRequestError(
            f"embedding_types {', '.join(extensions)} applies to texts; {param} get Cohere's "
            "dense types (float, int8, uint8, binary, ubinary, base64)",
            param="embedding_types",
        )
    for name in ("max_active_dims",):
        if getattr(body, name) is not None:
            raise InvalidRequestError(f"{name} applies to sparse texts", param=name)
    dense_types = cast(list[CohereEmbeddingType], body.embedding_types)
    value_bytes = cohere_bytes_per_dimension(dense_types)
    dims = pooled_dimensions(engine, body.output_dimension)
    types = ",".join(dense_types)
    check_response_size(lifecycle, len(parts), dims, value_bytes, f"embedding_types {types}")
    # Cancelled if the client goes: its images' reservations come back at once.
    items = await served.run(load_parts(engine, lifecycle, parts, param))
    texts_only = [item for item in items if isinstance(item, str)]
    # input_type picks a text prompt where the model has one; an image has none.
    if body.input_type != "image":
        input_type_prompts(engine, body.input_type)  # an unknown one is a 400, used or not
    input_type = None if body.input_type == "image" or not texts_only else body.input_type
    result = await served.run(
        engine.aembed(
            items,
            dimensions=body.output_dimension,
            prompt_name=prompt_name_for(engine, None, input_type),
            truncate=body.truncation(),
        )
    )
    headers = timing_headers(result.timings, result.prompt_tokens)

    def encode() -> Response:
        embeddings = cohere_embeddings(result.embeddings, dense_types)
        return json_response(_content(body, embeddings, result.prompt_tokens), headers)

    size = result.embeddings.shape[0] * dims * value_bytes + sum(map(len, texts_only))
    return await encode_off_loop(encode, size)


async def _hybrid_embed(body: CohereEmbedRequest, served: Served) -> Response:
    """A bge-m3-shaped model's outputs from one forward pass: Cohere's dense types from its
    dense vector, ``sparse`` from its lexical weights, ``multi_vector`` from its ColBERT
    vectors. Each part's size is bounded before the forward pass (the multi-vectors once
    the texts are tokenized)."""
    engine, lifecycle = served.engine, served.lifecycle
    wanted = set(body.embedding_types)
    dense_types = [
        cast(CohereEmbeddingType, t) for t in body.embedding_types if t not in _EXTENSIONS
    ]
    outputs = (["dense"] if dense_types else []) + [t for t in _EXTENSIONS if t in wanted]
    if not dense_types and body.output_dimension is not None:
        raise InvalidRequestError(
            "output_dimension applies to the dense embedding_types (float, int8, ...), none "
            "of which was asked for",
            param="output_dimension",
        )
    if "sparse" not in wanted and body.max_active_dims is not None:
        raise InvalidRequestError(
            "max_active_dims applies to embedding_types sparse only", param="max_active_dims"
        )
    count = len(_texts(body))
    entry_bytes = 0
    if "sparse" in wanted:
        entry_bytes = check_sparse_request(
            engine,
            lifecycle,
            count,
            body.max_active_dims,
            what="embedding_types sparse",
            input_param="texts",
        )
    dims = pooled_dimensions(engine, body.output_dimension)
    if dense_types:
        value_bytes = cohere_bytes_per_dimension(dense_types)
        check_response_size(
            lifecycle, count, dims, value_bytes, f"embedding_types {','.join(dense_types)}"
        )
    result = await served.run_bounded(
        lambda limit: engine.ahybrid_embed(
            _texts(body),
            outputs,
            dimensions=body.output_dimension,
            prompt_name=prompt_name_for(engine, None, body.input_type),
            truncate=body.truncation(),
            max_output_values=limit,
        ),
        width=engine.info().multi_vector_dim or 0,
        bytes_per_value=JSON_FLOAT_BYTES,
        encoding="embedding_types multi_vector",
    )
    sparse = [v.top(body.max_active_dims) for v in result.sparse or []]
    headers = timing_headers(result.timings, result.prompt_tokens)

    def encode() -> Response:
        embeddings: dict[str, object] = {}
        if result.dense is not None:
            embeddings = cohere_embeddings(result.dense, dense_types)
        if result.sparse is not None:
            embeddings["sparse"] = [{"indices": v.indices, "values": v.values} for v in sparse]
        if result.multi_vector is not None:
            embeddings["multi_vector"] = result.multi_vector
        return json_response(_content(body, embeddings, result.prompt_tokens), headers)

    size = (
        (count * dims * 16 if dense_types else 0)
        + sum(len(v.indices) for v in sparse) * entry_bytes
        + sum(m.size for m in result.multi_vector or []) * JSON_FLOAT_BYTES
        + sum(map(len, _texts(body)))
    )
    return await encode_off_loop(encode, size)


_COLBERT_SIDES = {
    "search_query": "query",
    "query": "query",
    "search_document": "document",
    "document": "document",
    "passage": "document",
}
"""Cohere's input_type as a ColBERT model's side."""


async def _colbert_embed(body: CohereEmbedRequest, served: Served) -> Response:
    """A ColBERT model's multi-vectors: ``input_type`` says whether the texts are queries
    (marked and expanded to the query length) or documents; every field that would change
    what the checkpoint computes is refused rather than ignored."""
    engine = served.engine
    if body.embedding_types != ["multi_vector"]:
        raise InvalidRequestError(
            f"embedding_types must be [multi_vector] for a ColBERT model "
            f"({engine.info().architecture}), which has no dense or sparse output",
            param="embedding_types",
        )
    side = _COLBERT_SIDES.get(body.input_type or "")
    if side is None:
        raise InvalidRequestError(
            "input_type must be search_query or search_document (query, document, passage) "
            "for a ColBERT model: its queries and documents are tokenized differently",
            param="input_type",
        )
    for name in ("output_dimension", "max_active_dims"):
        if getattr(body, name) is not None:
            raise InvalidRequestError(f"{name} does not apply to a ColBERT model", param=name)
    result = await served.run_bounded(
        lambda limit: engine.ahybrid_embed(
            _texts(body),
            ["multi_vector"],
            input_type=side,
            truncate=body.truncation(),
            max_output_values=limit,
        ),
        width=engine.info().multi_vector_dim or 0,
        bytes_per_value=JSON_FLOAT_BYTES,
        encoding="embedding_types multi_vector",
    )
    vectors = result.multi_vector or []
    headers = timing_headers(result.timings, result.prompt_tokens)

    def encode() -> Response:
        content = _content(body, {"multi_vector": vectors}, result.prompt_tokens)
        return json_response(content, headers)

    size = sum(m.size for m in vectors) * JSON_FLOAT_BYTES + sum(map(len, _texts(body)))
    return await encode_off_loop(encode, size)


async def _sparse_embed(body: CohereEmbedRequest, served: Served) -> Response:
    engine, lifecycle = served.engine, served.lifecycle
    others = sorted(set(body.embedding_types) - {"sparse"})
    if others:
        raise InvalidRequestError(
            f"embedding_types sparse cannot be combined with {', '.join(others)} on this "
            "model: a SPLADE model (task sparse) serves sparse vectors alone; only a model "
            "with sparse and multi-vector outputs (bge-m3) serves them together",
            param="embedding_types",
        )
    if body.output_dimension is not None:
        raise InvalidRequestError(
            "output_dimension does not apply to embedding_types sparse (use max_active_dims)",
            param="output_dimension",
        )
    entry_bytes = check_sparse_request(
        engine,
        lifecycle,
        len(_texts(body)),
        body.max_active_dims,
        what="embedding_types sparse",
        input_param="texts",
    )
    result = await served.run(
        engine.asparse_embed(
            _texts(body),
            prompt_name=prompt_name_for(engine, None, body.input_type),
            truncate=body.truncation(),
        )
    )
    vectors = [v.top(body.max_active_dims) for v in result.vectors]
    headers = timing_headers(result.timings, result.prompt_tokens)

    def encode() -> Response:
        sparse = [{"indices": v.indices, "values": v.values} for v in vectors]
        return json_response(_content(body, {"sparse": sparse}, result.prompt_tokens), headers)

    size = sum(len(v.indices) for v in vectors) * entry_bytes + sum(map(len, _texts(body)))
    return await encode_off_loop(encode, size)


def _texts(body: CohereEmbedRequest) -> list[str]:
    """The request's texts (the text-only paths are reached with texts only)."""
    assert body.texts is not None
    return body.texts


def _content(body: CohereEmbedRequest, embeddings: Any, prompt_tokens: int) -> dict[str, Any]:
    """Cohere's ``embeddings_by_type`` response around ``embeddings``."""
    return {
        "id": new_id(),
        "embeddings": embeddings,
        "texts": body.texts or [],
        "meta": {
            "api_version": {"version": "2"},
            "billed_units": {"input_tokens": prompt_tokens},
        },
        "response_type": "embeddings_by_type",
    }
