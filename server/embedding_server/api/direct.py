"""The JSON POST routes, served without FastAPI's per-request machinery.

FastAPI stays the source of the routes and of the OpenAPI document, and serves everything
else (the probes, ``/info``, ``/metrics``, ``/docs``, 404 and 405). But for each request it
walks its route table, solves the endpoint's dependencies, parses the body into a dict and
validates that dict, which took a large share of a single-text request's time on the CPU
(docs/performance-log.md, "FastAPI's request machinery on the POST routes"). Every POST
route of this server has the same shape,
``async def endpoint(body: SomeRequest, request: Request) -> Response``, so this layer calls
those same endpoints itself: one dict lookup by path, the body validated from its raw bytes
by orjson and pydantic-core, and the endpoint's response sent as is.

A body is validated with the server's :class:`~embedding_server.api.protocol.RequestLimits`
as context, so one holding more inputs or token ids than a request may is refused by its
counts before its elements are validated; a body over :data:`OFFLOAD_BODY_BYTES` is parsed and
validated on a worker thread. That does not make parsing free (orjson and pydantic-core hold
the GIL while they run), but the event loop gets its turn between them and during the
Python-level checks, instead of waiting for the whole body.

What a client sees does not change: the same 400s naming the field (pydantic's errors
rendered by :func:`errors.validation_error_response`, their ``loc`` under ``"body"`` as
FastAPI reports them), the same taxonomy errors and status codes. It runs inside
:class:`~embedding_server.api.middleware.RequestContextMiddleware`, so the request id,
the API key, the body size limit, the metrics and the last-resort 500 apply as before.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from embedding_server.api.errors import (
    ClientDisconnectedError,
    server_error_response,
    validation_error_response,
)
from embedding_server.api.protocol import RequestLimits
from embedding_server.errors import EmbeddingServerError

Endpoint = Callable[[Any, Request], Awaitable[Response]]

OFFLOAD_BODY_BYTES = 256 * 1024
"""Bodies larger than this are parsed and validated off the event loop. Smaller ones take
less than the hop to a thread costs (a single text's body is a few hundred bytes)."""

_SHAPE = ["body", "request"]


@dataclass(frozen=True)
class DirectRoute:
    """A POST route: the pydantic model of its JSON body, and its endpoint."""

    model: type[BaseModel]
    endpoint: Endpoint


def direct_routes(routers: Iterable[APIRouter]) -> dict[str, DirectRoute]:
    """Every POST route of ``routers`` by path.

    Raises ``TypeError`` for a POST endpoint of another shape than ``(body, request)``, so a
    new route cannot silently lose its validation by being called the wrong way here."""
    table: dict[str, DirectRoute] = {}
    for router in routers:
        for route in router.routes:
            if not isinstance(route, APIRoute) or "POST" not in (route.methods or ()):
                continue
            endpoint = route.endpoint
            params = list(inspect.signature(endpoint).parameters)
            model = typing.get_type_hints(endpoint).get("body")
            if params != _SHAPE or not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise TypeError(
                    f"POST {route.path}: {endpoint.__qualname__} must take "
                    "(body: <a pydantic model>, request: Request)"
                )
            table[route.path] = DirectRoute(model, endpoint)
    return table


async def read_body(receive: Receive) -> bytes:
    """The whole request body (the caller's ``receive`` enforces the size limit)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnectedError("The client disconnected before sending its body.")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _under_body(errors: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{**error, "loc": ("body", *error.get("loc", ()))} for error in errors]


_MISSING_BODY = [{"type": "missing", "loc": ("body",), "msg": "Field required"}]


def parse_body(
    model: type[BaseModel], body: bytes, limits: RequestLimits | None = None
) -> BaseModel | Response:
    """``body`` validated as ``model`` (within ``limits``), or the 400 that says what is
    wrong with it; a body over the limits raises the taxonomy's error (413 or 400)."""
    if not body:
        return validation_error_response(_MISSING_BODY)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        # orjson is stricter than the standard library, which FastAPI parses with: a lone
        # surrogate or NaN must reach validation, which names the field, as it always did.
        try:
            data = json.loads(body)
        except ValueError as exc:
            return validation_error_response(
                [
                    {
                        "type": "json_invalid",
                        "loc": ("body",),
                        "msg": "JSON decode error",
                        "ctx": {"error": str(exc)},
                    }
                ]
            )
    try:
        # As FastAPI validates, plus the limits that let a body be refused by its counts.
        return model.model_validate(data, from_attributes=True, context=limits)
    except ValidationError as exc:
        return validation_error_response(_under_body(exc.errors(include_url=False)))


class DirectRoutes:
    """ASGI layer that serves ``routes`` (POST only) itself and passes the rest on.

    ``limits`` gives the limits bodies are validated within at the time of the request (the
    engine's ``max_request_tokens`` is known once it has loaded)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Mapping[str, DirectRoute],
        limits: Callable[[], RequestLimits | None] = lambda: None,
    ) -> None:
        self.app = app
        self.routes = dict(routes)
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(receive)
            if len(body) > OFFLOAD_BODY_BYTES:
                parsed = await asyncio.to_thread(parse_body, route.model, body, self.limits())
            else:
                parsed = parse_body(route.model, body, self.limits())
            del body  # a big body's bytes go before its request is served
            if isinstance(parsed, Response):
                response = parsed
            else:
                response = await route.endpoint(parsed, Request(scope, receive))
        except EmbeddingServerError as exc:
            response = server_error_response(exc)
        await response(scope, receive, send)
