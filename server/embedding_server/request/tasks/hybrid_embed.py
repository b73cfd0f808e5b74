"""A bge-m3-shaped model's outputs from one forward pass (task embed with its sparse and
multi-vector heads), as FlagEmbedding's ``BGEM3FlagModel.encode`` computes them: dense
vectors, lexical weights per token id, and ColBERT multi-vectors; and a ColBERT model's
multi-vectors, its one output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Unpack

from embedding_server.errors import InvalidRequestError
from embedding_server.request.hybrid import OUTPUTS, HybridHeads
from embedding_server.request.jobs import Job
from embedding_server.request.pooling import FloatArray
from embedding_server.request.results import SparseVector, Usage, usage_of
from embedding_server.request.tasks.colbert_jobs import colbert_job, colbert_side
from embedding_server.request.tasks.context import Inputs, TaskContext, check_options
from embedding_server.request.tasks.embed import EmbedOptions


class HybridOptions(EmbedOptions, total=False):
    """Options of a bge-m3-shaped model's outputs together (``dimensions`` and
    ``normalize`` apply to the dense output; multi-vectors are always normalized)."""

    max_output_values: int | None
    """As :class:`~.token_embed.TokenEmbedOptions`'s: refuse, before the forward pass, a
    request whose multi-vectors would hold more numbers than this."""
    input_type: str | None
    """As :class:`~.token_embed.TokenEmbedOptions`'s: a ColBERT model's side."""


@dataclass(frozen=True, kw_only=True)
class HybridResult(Usage):
    """The outputs one request asked of a bge-m3-shaped model, from one forward pass: dense
    vectors ``[n, d]``, sparse (lexical) weights and multi-vectors (``[len_i - 1, width]``
    per input), each None when not asked for."""

    dense: FloatArray | None = None
    sparse: list[SparseVector] | None = None
    multi_vector: list[FloatArray] | None = None


def hybrid_heads(ctx: TaskContext, what: str) -> HybridHeads:
    """The model's sparse and multi-vector heads, or a 400 saying it has none."""
    hybrid = ctx.config.hybrid
    if hybrid is None:
        raise InvalidRequestError(
            f"{what} needs a model with sparse and multi-vector outputs (bge-m3's "
            f"sparse_linear.pt and colbert_linear.pt); this model ({ctx.info.architecture}"
            f", task {ctx.config.task}) serves {', '.join(ctx.info.outputs) or 'neither'}",
            param="model",
        )
    return hybrid


async def hybrid_embed(
    ctx: TaskContext,
    /,
    inputs: Inputs,
    outputs: Sequence[str] = OUTPUTS,
    **options: Unpack[HybridOptions],
) -> HybridResult:
    """Any of ``dense`` (the pooled vectors, ``[n, d]``), ``sparse`` (lexical weights per
    token id) and ``multi_vector`` (ColBERT vectors, ``[len_i - 1, width]`` per input,
    normalized), for a model whose ``info.outputs`` lists them."""
    check_options("hybrid_embed", dict(options), HybridOptions)
    wanted = set(outputs) if not isinstance(outputs, str) else {outputs}
    colbert = colbert_side(ctx, options.get("input_type"))
    if colbert is not None:
        if wanted != {"multi_vector"}:
            raise InvalidRequestError(
                f"outputs must be multi_vector for a ColBERT model ({ctx.info.architecture}"
                "), which has no dense or sparse output",
                param="outputs",
            )
        for name in ("dimensions", "normalize"):
            if options.get(name) is not None:
                raise InvalidRequestError(
                    f"{name} applies to the dense output, which a ColBERT model has not",
                    param=name,
                )
        fmt, side = colbert
        items = await ctx.texts(inputs)
        out = await ctx.run(colbert_job(items, side, options, fmt))
        rows = [t for t in out.tokens if t is not None]
        vectors = [fmt.vectors(r, t.ids, side) for r, t in zip(rows, out.tokenized, strict=True)]
        return HybridResult(multi_vector=vectors, **usage_of(out))
    hybrid = hybrid_heads(ctx, "dense, sparse and multi-vector output")
    unknown = sorted(wanted - set(OUTPUTS))
    if unknown or not wanted:
        raise InvalidRequestError(
            f"outputs must be a non-empty list of {', '.join(OUTPUTS)}"
            + (f"; got {', '.join(map(repr, unknown))}" if unknown else ""),
            param="outputs",
        )
    dense = "dense" in wanted
    if not dense:
        for name in ("dimensions", "normalize"):
            if options.get(name) is not None:
                raise InvalidRequestError(
                    f"{name} applies to the dense output, which was not asked for",
                    param=name,
                )
    head = ctx.config.head.options(options.get("dimensions"), options.get("normalize"))
    items = await ctx.texts(inputs)
    per_token = bool(wanted & {"sparse", "multi_vector"})
    max_values = options.get("max_output_values")
    job = Job.prepare(
        items,
        options,
        ctx.config.prompts,
        add_special_tokens=options.get("add_special_tokens", True),
        want_tokens=per_token,
        max_token_rows=(
            None
            if max_values is None or "multi_vector" not in wanted
            else max_values // hybrid.multi_vector_dim
        ),
    )
    out = await ctx.run(job)
    rows = [t for t in out.tokens if t is not None]
    return HybridResult(
        dense=head.apply(out.pooled) if dense else None,
        sparse=(
            [hybrid.sparse(r, t.ids) for r, t in zip(rows, out.tokenized, strict=True)]
            if "sparse" in wanted
            else None
        ),
        multi_vector=([hybrid.multi_vector(r) for r in rows] if "multi_vector" in wanted else None),
        **usage_of(out),
    )
