"""Per-token embeddings (task embed): the final hidden states of every token; a bge-m3-shaped
model's multi-vectors; a ColBERT model's query or document vectors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Unpack

from embedding_server.errors import InvalidRequestError
from embedding_server.request.jobs import Job, TokenOptions
from embedding_server.request.pooling import FloatArray
from embedding_server.request.results import JobOutput, Usage, usage_of
from embedding_server.request.tasks.colbert_jobs import colbert_job, colbert_side
from embedding_server.request.tasks.context import Inputs, TaskContext, check_options


class TokenEmbedOptions(TokenOptions, total=False):
    """Options of per-token embeddings."""

    input_type: str | None
    """A ColBERT model's side, ``query`` or ``document``: which marker, length and
    expansion its texts get (required there; refused for any other model)."""

    max_output_values: int | None
    """Refuse, before the forward pass, a request whose per-token output would hold more
    numbers than this (:class:`~.errors.OutputTooLargeError`)."""


@dataclass(frozen=True, kw_only=True)
class TokenEmbedResult(Usage):
    """Per-token hidden states (float32 ``[len_i, hidden]`` per input) and their token ids."""

    embeddings: list[FloatArray]
    token_ids: list[list[int]]


def token_result(out: JobOutput, embeddings: list[FloatArray]) -> TokenEmbedResult:
    """A per-token result of ``out``'s inputs: one matrix each, with its token ids."""
    token_ids = [list(t.ids) for t in out.tokenized]
    return TokenEmbedResult(embeddings=embeddings, token_ids=token_ids, **usage_of(out))


async def embed_tokens(
    ctx: TaskContext, /, inputs: Inputs, **options: Unpack[TokenEmbedOptions]
) -> TokenEmbedResult:
    """Per-token final hidden states (float32 ``[len_i, hidden]`` per input); with
    ``max_output_values``, a request whose output would hold more numbers is refused
    with :class:`~.errors.OutputTooLargeError` before the forward pass."""
    check_options("embed_tokens", dict(options), TokenEmbedOptions)
    ctx.require("per-token embedding", "embed")
    items = await ctx.texts(inputs)
    colbert = colbert_side(ctx, options.get("input_type"))
    if colbert is not None:
        if options.get("normalize") is False:
            raise InvalidRequestError(
                "a ColBERT model's vectors are always normalized", param="normalize"
            )
        fmt, side = colbert
        out = await ctx.run(colbert_job(items, side, options, fmt))
        rows = [t for t in out.tokens if t is not None]
        vectors = [fmt.vectors(r, t.ids, side) for r, t in zip(rows, out.tokenized, strict=True)]
        token_ids = [fmt.kept_ids(t.ids, side) for t in out.tokenized]
        return TokenEmbedResult(embeddings=vectors, token_ids=token_ids, **usage_of(out))
    special = options.get("add_special_tokens", True)
    max_values = options.get("max_output_values")
    hybrid = ctx.config.hybrid
    width = hybrid.multi_vector_dim if hybrid is not None else ctx.info.hidden_size
    job = Job.prepare(
        items,
        options,
        ctx.config.prompts,
        add_special_tokens=special,
        want_tokens=True,
        max_token_rows=None if max_values is None else max_values // width,
    )
    out = await ctx.run(job)
    matrices = [t for t in out.tokens if t is not None]
    if hybrid is not None:
        # A bge-m3-shaped model's per-token output is its multi-vectors (as vLLM's
        # token_embed of BgeM3EmbeddingModel): CLS left out, normalized by default.
        normalize = options.get("normalize")
        vectors = [
            hybrid.multi_vector(m, normalize=normalize is None or bool(normalize)) for m in matrices
        ]
        token_ids = [list(t.ids[1:]) for t in out.tokenized]
        return TokenEmbedResult(embeddings=vectors, token_ids=token_ids, **usage_of(out))
    normalize = bool(options.get("normalize"))
    return token_result(out, ctx.config.head.finish_tokens(matrices, normalize))
