"""What every model route does the same way: check the model name and input count, run the
engine call so that a client disconnect cancels it, and answer with orjson bytes (or, for
vLLM's ``bytes`` encodings, a binary body) plus the TEI-style timing headers.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response

from embedding_server.api.encoding import BINARY_MEDIA_TYPE, BinaryPayload, dumps, metadata_header
from embedding_server.api.errors import ClientDisconnectedError
from embedding_server.api.lifecycle import Lifecycle, lifecycle_of
from embedding_server.engine import Engine, StageTimings
from embedding_server.errors import InvalidRequestError, ModelNotFoundError

T = TypeVar("T")

_ids = random.Random()


def new_id() -> str:
    """A 32-hex-digit id for requests and responses.

    Not ``uuid4``: that reads ``os.urandom`` on every call, a syscall that showed up in
    request profiles; ids need to be unique, not unpredictable.
    """
    return f"{_ids.getrandbits(128):032x}"


JSON_MEDIA_TYPE = "application/json"


class JSONBytes(Response):
    """A response whose body is already-serialized JSON (no second encoding pass)."""

    media_type = JSON_MEDIA_TYPE


def json_response(content: object, headers: Mapping[str, str] | None = None) -> Response:
    return JSONBytes(dumps(content), headers=dict(headers) if headers else None)


BINARY_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON; or, for encoding_format bytes / bytes_only, the raw vectors.",
        "content": {BINARY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        "headers": {
            "metadata": {
                "description": "encoding_format bytes only: JSON {id, created, model, "
                "data: [{index, embed_dtype, endianness, start, end, shape}], usage}.",
                "schema": {"type": "string"},
            }
        },
    }
}
"""OpenAPI for routes that can answer with vLLM's binary encodings, next to their JSON."""


def binary_response(
    payload: BinaryPayload,
    headers: Mapping[str, str],
    *,
    with_metadata: bool,
    response_id: str,
    model: str,
    usage: Mapping[str, int],
) -> Response:
    """vLLM's binary answer: the body, plus (for ``bytes``, not ``bytes_only``) the
    ``metadata`` header ``{id, created, model, data: [items], usage}``.

    The header grows by ~100 bytes per input and HTTP clients cap header sizes (aiohttp at
    8 KiB, requests at 64 KiB per line, httpx at 100 KiB in all), so large batches are
    better asked for as ``bytes_only``, whose offsets follow from the shape.
    """
    all_headers = dict(headers)
    if with_metadata:
        all_headers["metadata"] = metadata_header(
            {
                "id": response_id,
                "created": int(time.time()),
                "model": model,
                "data": payload.items,
                "usage": dict(usage),
            }
        )
    return Response(payload.body, media_type=BINARY_MEDIA_TYPE, headers=all_headers)


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


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (dropping its queued
    batches) and raise :class:`ClientDisconnectedError`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnectedError("The client disconnected; its work was cancelled.")


def timing_headers(timings: StageTimings, tokens: int) -> dict[str, str]:
    """``x-tokenization-time``, ``x-queue-time``, ``x-inference-time`` (ms) and
    ``x-compute-tokens`` as TEI sends them, plus ``x-pooling-time`` (pool + head)."""

    def ms(name: str) -> str:
        return f"{float(getattr(timings, name)) * 1000.0:.3f}"

    return {
        "x-tokenization-time": ms("tokenize"),
        "x-queue-time": ms("queue"),
        "x-inference-time": ms("forward"),
        "x-pooling-time": ms("pool"),
        "x-compute-tokens": str(tokens),
    }
