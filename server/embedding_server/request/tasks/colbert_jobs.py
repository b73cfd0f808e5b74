"""A ColBERT model's jobs, shared by the tasks that serve one (per-token embeddings, the
multi-vector output, scores): the request's side, and a job tokenized as the checkpoint was
trained."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from embedding_server.errors import InvalidRequestError
from embedding_server.request.colbert import ColbertFormat, Side, parse_side
from embedding_server.request.jobs import Job, JobItem, ScoreOptions, TokenOptions
from embedding_server.request.tasks.context import TaskContext
from embedding_server.request.texts import TextInput
from embedding_server.request.truncation import Truncation


def colbert_side(ctx: TaskContext, input_type: object) -> tuple[ColbertFormat, Side] | None:
    """A ColBERT model's format and the request's side; None for any other model, which
    refuses an ``input_type`` rather than ignore it."""
    fmt = ctx.config.colbert
    if fmt is None:
        if input_type is not None:
            raise InvalidRequestError(
                "input_type applies to a ColBERT model's queries and documents; this "
                f"model ({ctx.info.architecture}) is not one",
                param="input_type",
            )
        return None
    if input_type is None:
        raise InvalidRequestError(
            "input_type (query or document) is required by a ColBERT model: its queries "
            "and documents are tokenized differently",
            param="input_type",
        )
    return fmt, parse_side(input_type)


def colbert_job(
    items: list[TextInput],
    sides: Side | Sequence[Side],
    options: ScoreOptions | TokenOptions,
    fmt: ColbertFormat,
) -> Job:
    """A ColBERT job over ``items`` (one side for all, or one each), its per-token
    output held to the request's ``max_output_values``. Its markers, lengths and query
    expansion are the checkpoint's, so options that would change its tokenization are
    refused, never ignored."""
    per_item: list[Side] = [sides] * len(items) if isinstance(sides, str) else list(sides)
    max_values = cast(dict[str, Any], options).get("max_output_values")
    max_token_rows = None if max_values is None else max_values // fmt.width
    for name in ("prompt", "prompt_name", "adapter"):
        if options.get(name) is not None:
            raise InvalidRequestError(
                f"{name} does not apply to a ColBERT model: its queries and documents "
                "are marked as the checkpoint was trained (input_type)",
                param=name,
            )
    truncation = Truncation.coerce(options.get("truncate", True))
    if truncation.side == "left" or truncation.max_tokens is not None:
        raise InvalidRequestError(
            f"a ColBERT model cuts queries to {fmt.query_length} tokens and documents "
            f"to {fmt.document_length}, keeping their start, as it was trained: "
            "truncation may only be asked for at the end (or refused)",
            param=truncation.param,
        )
    if cast(dict[str, Any], options).get("add_special_tokens", True) is not True:
        raise InvalidRequestError(
            "add_special_tokens does not apply to a ColBERT model",
            param="add_special_tokens",
        )
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidRequestError(
                f"input[{i}]: a ColBERT model takes texts, not token ids (its markers "
                "and query expansion are added to the text's tokens)",
                param="input",
            )
    return Job(
        list[JobItem](items),
        None,
        truncation,
        want_tokens=True,
        max_token_rows=max_token_rows,
        colbert=fmt,
        sides=tuple(per_item),
    )
