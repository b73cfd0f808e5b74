"""The vLLM-style extras: ``/pooling``, ``/score`` (also ``/v1/score``), ``/tokenize`` and
``/detokenize``.

``/pooling`` answers with per-token vectors unless ``task: embed`` is asked for, as vLLM's
``/pooling`` does for a model that supports ``token_embed``; that output grows with every
input token, so its size is checked against ``max_response_bytes`` once the inputs are
tokenized and before the forward pass. Its other tasks (classify, token_classify, reward,
sparse) need a model of that task and give far fewer values per token. ``/tokenize`` and
``/detokenize`` take at most ``max_request_tokens`` tokens, counted before the work (a
``/tokenize`` prompt is read through bounded windows until it is known to fit), and do their
work off the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from embedding_server.api.dependencies import (
    Served,
    as_input_list,
    check_input_count,
    check_response_size,
    check_sparse_request,
    model_route,
    pooled_dimensions,
    require_outputs,
)
from embedding_server.api.encoding import (
    JSON_FLOAT_BYTES,
    FloatMatrix,
    as_float32,
    base64_array,
    bytes_per_value,
)
from embedding_server.api.lifecycle import Lifecycle
from embedding_server.api.media import content_parts, load_parts
from embedding_server.api.protocol import (
    DetokenizeRequest,
    MultiModalContent,
    PoolingRequest,
    ScoreRequest,
    TokenizeRequest,
)
from embedding_server.api.responses import (
    BINARY_FORMATS,
    BINARY_RESPONSES,
    binary_response,
    check_metadata_fits,
    encode_off_loop,
    json_response,
    list_content,
    timing_headers,
)
from embedding_server.errors import InvalidRequestError, TooManyTokensError
from embedding_server.request.jobs import TokenOptions
from embedding_server.request.media.inputs import Part, check_image_count, images_of
from embedding_server.request.serving import ServingEngine

router = APIRouter()


@router.post(
    "/pooling",
    tags=["vLLM"],
    summary="Per-token (or pooled) hidden states",
    responses=BINARY_RESPONSES,
)
@model_route
async def pooling(body: PoolingRequest, served: Served) -> Response:
    engine, lifecycle = served.engine, served.lifecycle
    inputs = as_input_list(body.input)
    check_input_count(lifecycle, len(inputs), "input")
    check_metadata_fits(body.encoding_format, len(inputs))
    value_bytes = bytes_per_value(body.encoding_format, body.embed_dtype)
    options: TokenOptions = {
        "normalize": body.normalize,
        "truncate": body.truncation(auto=served.auto_truncate),
        "add_special_tokens": body.add_special_tokens,
    }
    if body.task == "sparse":
        return await _sparse_pooling(body, served, inputs, options)
    if body.task == "hybrid":
        return await _hybrid_pooling(body, served, inputs, options)
    if body.max_active_dims is not None:
        raise InvalidRequestError(
            "max_active_dims applies to task sparse only", param="max_active_dims"
        )
    # One output per input: a pooled matrix's rows (task embed) or per-token matrices.
    outputs: FloatMatrix | list[FloatMatrix]
    if body.task == "embed":
        dims = pooled_dimensions(engine, None)
        check_response_size(lifecycle, len(inputs), dims, value_bytes, body.encoding_format)
        pooled = await served.run(engine.aembed(inputs, **options))
        outputs = as_float32(pooled.embeddings)
        tokens, timings = pooled.prompt_tokens, pooled.timings
    elif body.task == "classify":
        dims = len(engine.info().labels or [])
        if body.normalize is not None:
            raise InvalidRequestError(
                "normalize does not apply to task classify", param="normalize"
            )
        classified = await served.run(engine.aclassify(inputs, truncate=options["truncate"]))
        outputs = as_float32(classified.probs)
        tokens, timings = classified.prompt_tokens, classified.timings
    elif body.task in ("token_classify", "reward"):
        dims = len(engine.info().labels or [])
        per_token_head = engine.atoken_classify if body.task == "token_classify" else engine.areward
        labelled = await served.run(per_token_head(inputs, **options))
        outputs = labelled.embeddings
        tokens, timings = labelled.prompt_tokens, labelled.timings
    else:
        dims = engine.info().multi_vector_dim or engine.info().hidden_size
        per_token = await served.run_bounded(
            lambda limit: engine.aembed_tokens(inputs, **options, max_output_values=limit),
            width=dims,
            bytes_per_value=value_bytes,
            encoding=body.encoding_format,
        )
        outputs = per_token.embeddings
        tokens, timings = per_token.prompt_tokens, per_token.timings
    headers = timing_headers(timings, tokens)

    def encode() -> Response:
        if body.encoding_format in BINARY_FORMATS:
            return binary_response(
                outputs, body, headers, kind="pool", model=served.model_name, tokens=tokens
            )
        data: list[dict[str, object]] = []
        for i, output in enumerate(outputs):
            payload_json: object = output
            if body.encoding_format == "base64":
                payload_json = base64_array(output, body.embed_dtype, body.endianness)
            data.append({"index": i, "object": "pooling", "data": payload_json})
        return json_response(list_content("pool", served.model_name, data, tokens), headers)

    vectors = len(inputs) if body.task in ("embed", "classify") else tokens
    return await encode_off_loop(encode, vectors * dims * value_bytes)


async def _sparse_pooling(
    body: PoolingRequest, served: Served, inputs: list[Any], options: TokenOptions
) -> Response:
    """``/pooling`` task sparse: each input's SPLADE vector as ``{indices, values}`` (token
    ids ascending), in JSON only, its size bounded before any work."""
    if body.encoding_format != "float":
        raise InvalidRequestError(
            "task sparse returns {indices, values} in JSON; use encoding_format float",
            param="encoding_format",
        )
    entry_bytes = check_sparse_request(
        served.engine,
        served.lifecycle,
        len(inputs),
        body.max_active_dims,
        what="task sparse",
        input_param="input",
    )
    result = await served.run(served.engine.asparse_embed(inputs, **options))
    vectors = [v.top(body.max_active_dims) for v in result.vectors]
    tokens = result.prompt_tokens

    def encode() -> Response:
        data = [
            {"index": i, "object": "pooling", "data": {"indices": v.indices, "values": v.values}}
            for i, v in enumerate(vectors)
        ]
        content = list_content("pool", served.model_name, data, tokens)
        return json_response(content, timing_headers(result.timings, tokens))

    return await encode_off_loop(encode, sum(len(v.indices) for v in vectors) * entry_bytes)


async def _hybrid_pooling(
    body: PoolingRequest, served: Served, inputs: list[Any], options: TokenOptions
) -> Response:
    """``/pooling`` task hybrid: a bge-m3-shaped model's dense vector, sparse weights and
    multi-vectors of each input from one forward pass, in JSON. Bounded before the forward
    pass: the dense and sparse parts by the input count (a sparse vector holds at most one
    entry per input token), the multi-vectors, which grow with every token, once the
    inputs are tokenized."""
    if body.encoding_format != "float":
        raise InvalidRequestError(
            "task hybrid returns {dense, sparse, multi_vector} in JSON; use encoding_format float",
            param="encoding_format",
        )
    engine, lifecycle = served.engine, served.lifecycle
    info = engine.info()
    require_outputs(engine, ("dense", "sparse", "multi_vector"), "task hybrid")
    entry_bytes = check_sparse_request(
        engine,
        lifecycle,
        len(inputs),
        body.max_active_dims,
        what="task hybrid",
        input_param="input",
    )
    dims = pooled_dimensions(engine, None)
    check_response_size(lifecycle, len(inputs), dims, JSON_FLOAT_BYTES, "task hybrid")
    result = await served.run_bounded(
        lambda limit: engine.ahybrid_embed(inputs, **options, max_output_values=limit),
        width=info.multi_vector_dim or info.hidden_size,
        bytes_per_value=JSON_FLOAT_BYTES,
        encoding="task hybrid",
    )
    dense, multi = result.dense, result.multi_vector
    assert dense is not None and result.sparse is not None and multi is not None
    sparse = [v.top(body.max_active_dims) for v in result.sparse]
    tokens = result.prompt_tokens

    def encode() -> Response:
        data = [
            {
                "index": i,
                "object": "pooling",
                "data": {
                    "dense": dense[i],
                    "sparse": {"indices": sparse[i].indices, "values": sparse[i].values},
                    "multi_vector": multi[i],
                },
            }
            for i in range(len(sparse))
        ]
        content = list_content("pool", served.model_name, data, tokens)
        return json_response(content, timing_headers(result.timings, tokens))

    size = (
        sum(m.size for m in multi) * JSON_FLOAT_BYTES
        + dense.size * JSON_FLOAT_BYTES
        + sum(len(v.indices) for v in sparse) * entry_bytes
    )
    return await encode_off_loop(encode, size)


@router.post("/score", tags=["vLLM"], summary="Scores of text pairs (cross-encoder or cosine)")
@router.post("/v1/score", tags=["vLLM"], summary="Scores of text pairs (cross-encoder or cosine)")
@model_route
async def score(body: ScoreRequest, served: Served) -> Response:
    engine = served.engine
    # Cancelled if the client goes: its images' reservations come back at once.
    side_1, side_2 = await served.run(
        score_sides(engine, served.lifecycle, body.text_1, body.text_2)
    )
    result = await served.run(
        engine.ascore(side_1, side_2, truncate=body.truncation(auto=served.auto_truncate))
    )
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(result.scores)]
    content = list_content("score", served.model_name, data, result.prompt_tokens)
    return json_response(content, timing_headers(result.timings, result.prompt_tokens))


async def score_sides(
    engine: ServingEngine,
    lifecycle: Lifecycle,
    text_1: str | list[str] | MultiModalContent,
    text_2: str | list[str] | MultiModalContent,
) -> tuple[Any, Any]:
    """Both sides of a /score request as the engine's inputs: texts as they are, vLLM's
    ``{"content": [parts]}`` as one input per part, images loaded (counted together against
    ``--max-images-per-request`` before any is fetched)."""
    sides: list[Any] = []
    parts: list[list[Part]] = []
    for param, side in (("text_1", text_1), ("text_2", text_2)):
        if isinstance(side, MultiModalContent):
            parts.append(content_parts(side, param))
            check_input_count(lifecycle, len(parts[-1]), param)
        else:
            parts.append([])
            check_input_count(lifecycle, 1 if isinstance(side, str) else len(side), param)
    check_image_count(
        sum(len(images_of(p)) for p in parts),
        lifecycle.settings.max_images_per_request,
        "text_2" if images_of(parts[1]) else "text_1",
    )
    for param, side, side_parts in (("text_1", text_1, parts[0]), ("text_2", text_2, parts[1])):
        if isinstance(side, MultiModalContent):
            sides.append(await load_parts(engine, lifecycle, side_parts, param))
        else:
            sides.append(side)
    return sides[0], sides[1]


@router.post("/tokenize", tags=["vLLM"], summary="Text to token ids")
@model_route
async def tokenize(body: TokenizeRequest, served: Served) -> Response:
    engine = served.engine
    # Refused (413) as soon as the prompt is known to hold more than one request may: the
    # tokenizer reads a bounded part of it first, never a whole 8 MiB prompt.
    tokenized = await engine.atokenize(
        body.prompt,
        add_special_tokens=body.add_special_tokens,
        max_tokens=engine.info().max_request_tokens,
        param="prompt",
    )
    ids = tokenized[0]
    token_strs = await engine.atoken_strings(ids) if body.return_token_strs else None
    info = engine.info()
    specials = info.special_tokens
    added = body.add_special_tokens
    content = {
        "count": len(ids),
        "max_model_len": info.max_input_tokens,
        "tokens": ids,
        "token_strs": token_strs,
        # Not in vLLM's answer: which special tokens the text got (first and last of
        # ``tokens``) and where the model's template comes from (special_tokens.py).
        "special_tokens": {
            "before": list(specials.before) if added else [],
            "after": list(specials.after) if added else [],
            "source": specials.source,
            "note": specials.note,
        },
    }
    return await encode_off_loop(lambda: json_response(content), len(ids) * 16)


@router.post("/detokenize", tags=["vLLM"], summary="Token ids to text")
@model_route
async def detokenize(body: DetokenizeRequest, served: Served) -> Response:
    engine = served.engine
    _check_token_count(engine.info().max_request_tokens, len(body.tokens), "tokens")
    text = await engine.adetokenize(body.tokens)
    return await encode_off_loop(lambda: json_response({"prompt": text}), len(text))


def _check_token_count(limit: int, count: int, param: str) -> None:
    if count > limit:
        raise TooManyTokensError(
            f"'{param}' holds {count} tokens; one request may hold at most {limit} "
            "(max_request_tokens)",
            param=param,
        )
