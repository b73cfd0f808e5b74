"""Pooled embeddings (task embed): a vector per input, through the model's head (Matryoshka
truncation, normalization) here, per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Unpack

from embedding_server.errors import InvalidRequestError
from embedding_server.request.jobs import Job, TokenOptions
from embedding_server.request.pooling import FloatArray
from embedding_server.request.results import Usage, usage_of
from embedding_server.request.tasks.context import Inputs, TaskContext, check_options


class EmbedOptions(TokenOptions, total=False):
    """Options of pooled embeddings."""

    dimensions: int | None
    """Matryoshka truncation to this many dimensions."""


@dataclass(frozen=True, kw_only=True)
class EmbedResult(Usage):
    """Embeddings of one request plus what the HTTP layer reports about it."""

    embeddings: FloatArray  # [n, d] float32
    token_counts: list[int]  # per input, after truncation


async def embed(
    ctx: TaskContext, /, inputs: Inputs, **options: Unpack[EmbedOptions]
) -> EmbedResult:
    """Embed ``inputs`` (texts, token ids, images): float32 ``[n, d]`` plus usage and
    timings."""
    check_options("embed", dict(options), EmbedOptions)
    ctx.require("embedding", "embed")
    if ctx.config.colbert is not None:
        raise InvalidRequestError(
            f"{ctx.info.architecture} is a ColBERT model: it has no single pooled "
            "vector, only per-token multi-vectors (token embeddings or the multi_vector "
            "output, with input_type query or document) scored by MaxSim (/score, "
            "/rerank)",
            param="model",
        )
    items = await ctx.items(inputs)
    head = ctx.config.head.options(options.get("dimensions"), options.get("normalize"))
    special = options.get("add_special_tokens", True)
    job = Job.prepare(items, options, ctx.config.prompts, add_special_tokens=special)
    out = await ctx.run(job)
    return EmbedResult(
        embeddings=head.apply(out.pooled), token_counts=out.token_counts, **usage_of(out)
    )
