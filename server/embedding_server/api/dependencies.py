"""What every model route checks first: that the request names the served model and that
the engine is ready, and that its input count is within the server's limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request

from embedding_server.api.lifecycle import Lifecycle, lifecycle_of
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, ModelNotFoundError


def engine_for(request: Request, model: str | None) -> tuple[Engine, Lifecycle]:
    """The ready engine for a request naming ``model`` (404 for another model, 503 if not
    loaded yet)."""
    lifecycle = lifecycle_of(request)
    if model is not None and model not in lifecycle.accepted_model_names:
        raise ModelNotFoundError(
            f"The model '{model}' does not exist; this server serves "
            f"'{lifecycle.served_model_name}'.",
            param="model",
        )
    return lifecycle.require_engine(), lifecycle


def check_input_count(lifecycle: Lifecycle, count: int, param: str) -> None:
    if count == 0:
        raise InvalidRequestError(f"'{param}' must not be empty.", param=param)
    limit = lifecycle.settings.max_inputs_per_request
    if count > limit:
        raise InvalidRequestError(
            f"'{param}' has {count} inputs; this server accepts at most {limit} per request.",
            param=param,
        )


def as_input_list(
    value: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
) -> list[Any]:
    """OpenAI's four input shapes -> a list of texts or token-id lists."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [list(value)]
    return list(value)
