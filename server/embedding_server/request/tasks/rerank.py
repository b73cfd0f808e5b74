"""Reranking (tasks score and embed): documents by decreasing relevance to a query, from
their scores against it (:mod:`.score`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Unpack

from PIL import Image

from embedding_server.errors import InvalidRequestError
from embedding_server.request.jobs import ScoreOptions
from embedding_server.request.media.inputs import IMAGE_TYPES
from embedding_server.request.media.preprocessing import ImageInput
from embedding_server.request.results import Ranked, Usage, usage_of
from embedding_server.request.scoring import rank
from embedding_server.request.tasks.context import TaskContext, check_options
from embedding_server.request.tasks.score import score

Document = str | Image.Image | ImageInput
"""A query or a document: a text, or an image for a model that takes them."""


@dataclass(frozen=True, kw_only=True)
class RerankResult(Usage):
    """Documents by decreasing relevance to the query (``top_n`` of them when asked)."""

    results: list[Ranked]


async def rerank(
    ctx: TaskContext,
    /,
    query: Document,
    documents: Sequence[Document],
    *,
    top_n: int | None = None,
    **options: Unpack[ScoreOptions],
) -> RerankResult:
    """``documents`` by decreasing relevance to ``query`` (the first ``top_n`` when
    given): a cross-encoder's scores, or cosine similarity for an embedding model."""
    check_options("rerank", dict(options), ScoreOptions)
    if not isinstance(query, IMAGE_TYPES) and (not isinstance(query, str) or not query):
        raise InvalidRequestError("query must be a non-empty string", param="query")
    if isinstance(documents, str) or not documents:
        raise InvalidRequestError("documents must be a non-empty list", param="documents")
    for i, document in enumerate(documents):
        if isinstance(document, IMAGE_TYPES):
            continue
        if not isinstance(document, str) or not document:
            raise InvalidRequestError(
                f"documents[{i}] must be a non-empty string", param="documents"
            )
    if top_n is not None and (isinstance(top_n, bool) or top_n < 0):
        raise InvalidRequestError("top_n must be a non-negative integer", param="top_n")
    result = await score(ctx, query, list(documents), **options)  # type: ignore[arg-type]
    return RerankResult(results=rank(result.scores, top_n), **usage_of(result))
