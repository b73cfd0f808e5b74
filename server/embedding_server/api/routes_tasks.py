"""The task endpoints beyond embedding: ``/rerank`` (also ``/v1/rerank``, ``/v2/rerank``)
and ``/classify`` (also ``/v1/classify``), in vLLM's request and response shapes so that its
clients (and Jina's and Cohere's rerank clients) work unchanged.

``/rerank`` ranks documents with the model's ``/score``: a cross-encoder's relevance (task
score) or the cosine similarity of embeddings (task embed). ``/classify`` needs a classifier
(task classify, or a cross-encoder's one sigmoid probability). A model of another task gets a
400 naming its task. Both go through the engine, hence the same scheduler, batching and
metrics as every other request.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from embedding_server.api.dependencies import Served, as_input_list, check_input_count, model_route
from embedding_server.api.ids import new_id
from embedding_server.api.lifecycle import Lifecycle
from embedding_server.api.media import content_parts, load_parts
from embedding_server.api.protocol import MultiModalContent
from embedding_server.api.protocol_tasks import ClassifyRequest, RerankRequest
from embedding_server.api.responses import json_response, list_content, timing_headers, usage
from embedding_server.errors import InvalidRequestError
from embedding_server.request.media.inputs import TextPart, check_image_count, images_of
from embedding_server.request.media.preprocessing import ImageInput
from embedding_server.request.serving import ServingEngine

router = APIRouter(tags=["Tasks"])


@router.post("/rerank", summary="Rank documents by relevance to a query (vLLM/Jina)")
@router.post("/v1/rerank", summary="Rank documents by relevance to a query (vLLM/Jina)")
@router.post("/v2/rerank", summary="Rank documents by relevance to a query (vLLM/Cohere v2)")
@model_route
async def rerank(body: RerankRequest, served: Served) -> Response:
    # Cancelled if the client goes: its images' reservations come back at once.
    query, documents, shown = await served.run(rerank_inputs(served.engine, served.lifecycle, body))
    result = await served.run(
        served.engine.arerank(
            query,
            documents,
            top_n=body.top_n,
            truncate=body.truncation(auto=served.auto_truncate),
        )
    )
    results: list[dict[str, object]] = []
    for ranked in result.results:
        item: dict[str, object] = {"index": ranked.index, "relevance_score": ranked.score}
        if body.return_documents:
            item["document"] = shown[ranked.index]
        results.append(item)
    content = {
        "id": f"rerank-{new_id()}",
        "model": served.model_name,
        "usage": usage(result.prompt_tokens),
        "results": results,
    }
    return json_response(content, timing_headers(result.timings, result.prompt_tokens))


async def rerank_inputs(
    engine: ServingEngine, lifecycle: Lifecycle, body: RerankRequest
) -> tuple[str | ImageInput, list[str | ImageInput], list[dict[str, object]]]:
    """The query and documents as the engine's inputs (vLLM's ``{"content": [parts]}``:
    one document per part, images loaded; the query one part), and each document as
    ``return_documents`` shows it (``{"text"}``, or an image's ``{"image_url": {"url"}}``)."""
    query_parts = (
        content_parts(body.query, "query") if isinstance(body.query, MultiModalContent) else []
    )
    if isinstance(body.query, MultiModalContent) and len(query_parts) != 1:
        raise InvalidRequestError(
            f"query holds {len(query_parts)} parts; a query is one text or one image",
            param="query",
        )
    if isinstance(body.documents, MultiModalContent):
        doc_parts = content_parts(body.documents, "documents")
    else:
        doc_parts = [TextPart(text, "documents") for text in body.texts()]
    check_input_count(lifecycle, len(doc_parts), "documents")
    check_image_count(
        len(images_of([*query_parts, *doc_parts])),
        lifecycle.settings.max_images_per_request,
        "documents",
    )
    query: str | ImageInput
    if query_parts:
        (query,) = await load_parts(engine, lifecycle, query_parts, "query")
    else:
        assert isinstance(body.query, str)
        query = body.query
    documents = await load_parts(engine, lifecycle, doc_parts, "documents")
    shown: list[dict[str, object]] = [
        {"text": p.text} if isinstance(p, TextPart) else {"image_url": {"url": p.url}}
        for p in doc_parts
    ]
    return query, documents, shown


@router.post("/classify", summary="Class probabilities of each input (vLLM)")
@router.post("/v1/classify", summary="Class probabilities of each input (vLLM)")
@model_route
async def classify(body: ClassifyRequest, served: Served) -> Response:
    inputs = as_input_list(body.input)
    check_input_count(served.lifecycle, len(inputs), "input")
    result = await served.run(
        served.engine.aclassify(inputs, truncate=body.truncation(auto=served.auto_truncate))
    )
    labels = result.predicted
    data = [
        {"index": i, "label": labels[i], "probs": probs, "num_classes": len(result.labels)}
        for i, probs in enumerate(result.probs)
    ]
    content = list_content("classify", served.model_name, data, result.prompt_tokens)
    return json_response(content, timing_headers(result.timings, result.prompt_tokens))
