"""How the model routes answer: pre-serialized JSON, vLLM's binary bodies (and their OpenAPI
description), and the TEI-style timing headers both carry.

Encoding a big answer (JSON of a million floats, base64 of per-token matrices) takes the
CPU for a while, so it runs on a worker thread (:func:`encode_off_loop`): the event loop
must stay free to answer ``/health`` and every other client meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from starlette.responses import Response

from embedding_server.api.encoding import (
    BINARY_MEDIA_TYPE,
    EmbedDtype,
    EncodingFormat,
    Endianness,
    FloatMatrix,
    binary_payload,
    dumps,
    metadata_header,
)
from embedding_server.api.ids import new_id
from embedding_server.errors import InvalidRequestError
from embedding_server.request.results import StageTimings

JSON_MEDIA_TYPE = "application/json"

OFF_LOOP_BYTES = 256 * 1024
"""Answers estimated above this size are encoded on a worker thread; smaller ones inline,
where a thread hop would cost more than the encoding."""

MAX_METADATA_HEADER_BYTES = 8000
"""Largest ``metadata`` header sent with ``encoding_format: bytes``. Clients and proxies cap
response headers (aiohttp and nginx's default proxy buffer at 8 KiB), so a bigger one is
refused with a pointer to ``bytes_only`` rather than sent to fail somewhere else."""

_METADATA_ITEM_MIN_BYTES = 80
"""Fewest bytes one output's item adds to the ``metadata`` header, to refuse early."""


async def encode_off_loop(encode: Callable[[], Response], size_hint: float) -> Response:
    """``encode()``, on a worker thread when the answer is big (see the module doc)."""
    if size_hint < OFF_LOOP_BYTES:
        return encode()
    return await asyncio.to_thread(encode)


def _metadata_too_large(outputs: int, size: int | None = None) -> InvalidRequestError:
    detail = f"{size} bytes" if size is not None else "too large"
    return InvalidRequestError(
        f"The 'metadata' header for {outputs} outputs would be {detail}, more than the "
        f"{MAX_METADATA_HEADER_BYTES} bytes that HTTP clients and proxies accept; ask for "
        "encoding_format 'bytes_only' (each output's offsets follow from its shape) or send "
        "fewer inputs.",
        param="encoding_format",
    )


def check_metadata_fits(encoding_format: str, outputs: int) -> None:
    """Refuse, before any work, a ``bytes`` answer whose header could not fit."""
    if encoding_format == "bytes" and outputs * _METADATA_ITEM_MIN_BYTES > (
        MAX_METADATA_HEADER_BYTES
    ):
        raise _metadata_too_large(outputs)


class JSONBytes(Response):
    """A response whose body is already-serialized JSON (no second encoding pass)."""

    media_type = JSON_MEDIA_TYPE


def json_response(content: object, headers: Mapping[str, str] | None = None) -> Response:
    return JSONBytes(dumps(content), headers=dict(headers) if headers else None)


def usage(tokens: int) -> dict[str, int]:
    """The ``usage`` of an answer whose inputs took ``tokens``, all of them prompt tokens."""
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def list_content(kind: str, model: str, data: object, tokens: int) -> dict[str, object]:
    """vLLM's list answer (``/pooling``, ``/score``, ``/classify``): ``{id, object, created,
    model, data, usage}``, the id ``<kind>-<hex>``."""
    return {
        "id": f"{kind}-{new_id()}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage(tokens),
    }


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


class WireEncoding(Protocol):
    """A request's vLLM encoding options (``encoding_format``, ``embed_dtype``,
    ``endianness``)."""

    @property
    def encoding_format(self) -> EncodingFormat: ...
    @property
    def embed_dtype(self) -> EmbedDtype: ...
    @property
    def endianness(self) -> Endianness: ...


BINARY_FORMATS = ("bytes", "bytes_only")
"""The encoding formats answered by :func:`binary_response`."""


def binary_response(
    outputs: Sequence[npt.NDArray[np.float32]] | FloatMatrix,
    wire: WireEncoding,
    headers: Mapping[str, str],
    *,
    kind: str,
    model: str,
    tokens: int,
) -> Response:
    """vLLM's binary answer: ``outputs`` in ``wire``'s element type and byte order, plus
    (for ``bytes``, not ``bytes_only``) the ``metadata`` header ``{id, created, model, data:
    [items], usage}``, the id ``<kind>-<hex>``.

    The header grows by ~100 bytes per input and HTTP clients cap header sizes (aiohttp at
    8 KiB, requests at 64 KiB per line, httpx at 100 KiB in all), so one over
    :data:`MAX_METADATA_HEADER_BYTES` is refused (400) with a pointer to ``bytes_only``,
    whose offsets follow from the shape.
    """
    payload = binary_payload(outputs, wire.embed_dtype, wire.endianness)
    all_headers = dict(headers)
    if wire.encoding_format == "bytes":
        header = metadata_header(
            {
                "id": f"{kind}-{new_id()}",
                "created": int(time.time()),
                "model": model,
                "data": payload.items,
                "usage": usage(tokens),
            }
        )
        if len(header) > MAX_METADATA_HEADER_BYTES:
            raise _metadata_too_large(len(payload.items), len(header))
        all_headers["metadata"] = header
    return Response(payload.body, media_type=BINARY_MEDIA_TYPE, headers=all_headers)


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
