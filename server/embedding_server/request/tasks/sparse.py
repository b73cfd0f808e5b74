"""Sparse embeddings (task sparse, and bge-m3's lexical weights): SPLADE vectors over the
vocabulary, per input the token ids with a non-zero weight and their weights, as
sentence-transformers' SparseEncoder computes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Unpack, cast

from embedding_server.errors import InvalidRequestError
from embedding_server.request.jobs import Job, TokenOptions
from embedding_server.request.results import SparseVector, Usage, usage_of
from embedding_server.request.tasks.context import Inputs, TaskContext, check_options
from embedding_server.request.tasks.hybrid_embed import HybridOptions, hybrid_embed


@dataclass(frozen=True, kw_only=True)
class SparseEmbedResult(Usage):
    """SPLADE vectors of one request, with usage."""

    vectors: list[SparseVector]


async def sparse_embed(
    ctx: TaskContext, /, inputs: Inputs, **options: Unpack[TokenOptions]
) -> SparseEmbedResult:
    """A sparse vector per input: a SPLADE model's, or a bge-m3-shaped model's sparse
    output (:func:`~.hybrid_embed.hybrid_embed`)."""
    check_options("sparse_embed", dict(options), TokenOptions)
    if options.get("normalize"):
        raise InvalidRequestError("normalize does not apply to task sparse", param="normalize")
    if ctx.config.hybrid is not None:  # bge-m3's lexical weights
        hybrid_options = cast(HybridOptions, {k: v for k, v in options.items() if k != "normalize"})
        result = await hybrid_embed(ctx, inputs, ("sparse",), **hybrid_options)
        return SparseEmbedResult(vectors=result.sparse or [], **usage_of(result))
    ctx.require("sparse embedding", "sparse")
    items = await ctx.texts(inputs)
    special = options.get("add_special_tokens", True)
    job = Job.prepare(items, options, ctx.config.prompts, add_special_tokens=special)
    out = await ctx.run(job)
    vectors = [SparseVector.from_dense(row) for row in out.pooled]
    return SparseEmbedResult(vectors=vectors, **usage_of(out))
