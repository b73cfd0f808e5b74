"""Scores of pairs (tasks score and embed), as vLLM's ``LLM.score``: a cross-encoder's
relevance after its activation (its pairs tokenized together, or inside a yes/no reranker's
prompt), a listwise reranker's (a query and its documents in one prompt per block), a late
interaction model's MaxSim (ColBERT, bge-m3's multi-vectors), or the cosine similarity of
two embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Unpack

import numpy as np
import numpy.typing as npt

from embedding_server.errors import InvalidRequestError
from embedding_server.request.colbert import Side, maxsim_sum
from embedding_server.request.heads import PairPrompt, PairTemplate, SegmentedPairTemplate
from embedding_server.request.hybrid import maxsim_scores
from embedding_server.request.jobs import Job, ScoreOptions
from embedding_server.request.listwise import ListwiseFormat, ListwiseJob
from embedding_server.request.prompts import PromptedPairs
from embedding_server.request.results import JobOutput, Usage, usage_of
from embedding_server.request.scoring import (
    check_sides,
    cosine_scores,
    pair_inputs,
    text_pairs,
    text_sides,
)
from embedding_server.request.tasks.colbert_jobs import colbert_job
from embedding_server.request.tasks.context import Inputs, TaskContext, check_options
from embedding_server.request.truncation import Truncation


@dataclass(frozen=True, kw_only=True)
class ScoreResult(Usage):
    """Scores of text pairs (``[n]`` float32): cross-encoder relevance, or cosine similarity
    of embeddings."""

    scores: npt.NDArray[np.float32]


def _result(out: JobOutput, scores: npt.NDArray[np.float32]) -> ScoreResult:
    return ScoreResult(scores=scores, **usage_of(out))


async def score(
    ctx: TaskContext, /, a: Inputs, b: Inputs, **options: Unpack[ScoreOptions]
) -> ScoreResult:
    """Scores ``[n]`` of pairs (equal-length lists, or one against many)."""
    check_options("score", dict(options), ScoreOptions)
    ctx.require("scoring", "embed", "score")
    classifier = ctx.config.classifier
    hybrid = ctx.config.hybrid
    listwise = ctx.config.listwise
    if listwise is not None:
        # A listwise reranker: a query and its documents in one prompt per block.
        queries, documents = await ctx.checked(text_sides, a, b)
        job = listwise_job(queries, documents, options, listwise)
        assert job.listwise is not None
        out = await ctx.run(job)
        rows = [t for t in out.tokens if t is not None]
        ids = [t.ids for t in out.tokenized]
        return _result(out, job.listwise.scores(rows, ids))
    fmt = ctx.config.colbert
    if fmt is not None:
        # ColBERT: the a side as queries, the b side as documents, summed MaxSim.
        items, n_a = await ctx.checked(pair_inputs, a, b)
        query: Side = "query"
        document: Side = "document"
        sides = [query] * n_a + [document] * (len(items) - n_a)
        out = await ctx.run(colbert_job(items, sides, options, fmt))
        rows = [t for t in out.tokens if t is not None]
        vectors = [
            fmt.vectors(r, t.ids, side)
            for r, t, side in zip(rows, out.tokenized, sides, strict=True)
        ]
        return _result(out, maxsim_scores(vectors, n_a, maxsim_sum))
    if classifier is None and hybrid is not None:
        # Late interaction: both sides' multi-vectors from one job, MaxSim per pair.
        items, n_a = await ctx.checked(pair_inputs, a, b)
        job = Job.prepare(items, options, ctx.config.prompts, want_tokens=True)
        out = await ctx.run(job)
        vectors = [hybrid.multi_vector(t) for t in out.tokens if t is not None]
        return _result(out, maxsim_scores(vectors, n_a))
    if classifier is None:
        items_a = await ctx.items(a, "text_1")
        items_b = await ctx.items(b, "text_2")
        check_sides(len(items_a), len(items_b))
        both = [*items_a, *items_b]
        out = await ctx.run(Job.prepare(both, options, ctx.config.prompts))
        return _result(out, cosine_scores(out.pooled, len(items_a)))
    pairs = await ctx.checked(text_pairs, a, b)
    out = await ctx.run(pairs_job(pairs, options, classifier.template))
    return _result(out, classifier.scores(out.pooled))


def listwise_job(
    queries: Sequence[str],
    documents: Sequence[str],
    options: ScoreOptions,
    fmt: ListwiseFormat,
) -> Job:
    """A listwise reranker's job: ``prompt`` is the instruction its prompt holds; prompt
    names and adapters do not apply and are refused, never ignored."""
    for name in ("prompt_name", "adapter"):
        if options.get(name) is not None:
            raise InvalidRequestError(
                f"{name} does not apply to a listwise reranker ({fmt.name}); its "
                "instruction is the request's prompt",
                param=name,
            )
    instruction = options.get("prompt")
    if instruction is not None and not isinstance(instruction, str):
        raise InvalidRequestError("prompt must be a string", param="prompt")
    truncation = Truncation.coerce(options.get("truncate", True))
    lists = ListwiseJob.of_sides(queries, documents, fmt, instruction)
    return Job([], None, truncation, want_tokens=True, listwise=lists)


def pairs_job(
    pairs: list[tuple[str, str]],
    options: ScoreOptions,
    template: PairTemplate | SegmentedPairTemplate | PairPrompt | None = None,
) -> Job:
    """A job over sentence pairs; prompts do not apply to them. With a yes/no
    reranker's ``template``, each pair becomes one text of its prompt (a
    :class:`SegmentedPairTemplate`: its pieces, tokenized apart when the job is), and
    ``prompt`` is the template's instruction; with a cross-encoder's
    :class:`PairPrompt`, one text tokenized as any single text. No prompt is built here:
    the query is in every one, so they are built when the job is tokenized, after it was
    admitted on their sizes (:class:`PromptedPairs`)."""
    truncation = Truncation.coerce(options.get("truncate", True))
    for name in ("prompt_name", "adapter"):
        if options.get(name) is not None:
            raise InvalidRequestError(
                f"{name} does not apply to a cross-encoder's text pairs", param=name
            )
    instruction = options.get("prompt")
    if isinstance(template, PairPrompt):
        if instruction is not None:
            raise InvalidRequestError(
                f"prompt does not apply to {template.name}'s pairs: its prompt is fixed",
                param="prompt",
            )
        return Job([], None, truncation, prompted=PromptedPairs(pairs, template))
    if instruction is not None and not isinstance(instruction, str):
        raise InvalidRequestError("prompt must be a string", param="prompt")
    if isinstance(template, SegmentedPairTemplate):
        return Job([], instruction, truncation, pairs=pairs, segmented=template)
    if template is not None:
        prompted = PromptedPairs(pairs, template, instruction)
        return Job([], None, truncation, add_special_tokens=False, prompted=prompted)
    if instruction is not None:
        raise InvalidRequestError(
            "prompt does not apply to a cross-encoder's text pairs", param="prompt"
        )
    return Job([], None, truncation, pairs=pairs)
