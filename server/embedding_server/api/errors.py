"""Errors -> HTTP, in one place.

The taxonomy in :mod:`embedding_server.errors` carries each error's status code, type and
code; this module renders them, and maps what the web framework raises on its own
(validation failures, unknown routes, wrong methods) onto the same OpenAI-shaped body::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

so a client never has to parse two error formats. Unexpected exceptions are not handled
here: the request middleware logs them with the request id and answers a generic 500.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from embedding_server.errors import EmbeddingServerError, QueueFullError, ServerBusyError

logger = logging.getLogger(__name__)


class ClientDisconnectedError(EmbeddingServerError):
    """The client went away before its answer was ready; its queued work was cancelled."""

    status_code = 499  # nginx's "client closed request": nobody reads it, metrics do
    error_type = "client_closed_request"
    code = "client_disconnected"


# Framework-raised statuses that are not in the taxonomy: status -> (type, code).
HTTP_STATUS_TABLE: Mapping[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_value"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "payload_too_large"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "not_ready"),
}


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    )


def error_response(
    status: int,
    message: str,
    *,
    error_type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    default_type, default_code = HTTP_STATUS_TABLE.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None)
    )
    return Response(
        error_body(
            message, error_type or default_type, param, code if code is not None else default_code
        ),
        status_code=status,
        headers=dict(headers or {}),
        media_type="application/json",
    )


def response_for(exc: EmbeddingServerError) -> Response:
    headers: dict[str, str] = {}
    if isinstance(exc, QueueFullError | ServerBusyError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    if exc.close_connection:
        headers["Connection"] = "close"
    return error_response(
        exc.status_code,
        exc.message,
        error_type=exc.error_type,
        param=exc.param,
        code=exc.code,
        headers=headers,
    )


def _param_of(loc: Sequence[Any]) -> str | None:
    """``("body", "input", 0)`` -> ``"input"``: the top-level request field, as OpenAI names it.

    Query and header parameters are named too; a failure of the body as a whole has none.
    """
    if len(loc) >= 2 and loc[0] in ("body", "query", "path", "header") and isinstance(loc[1], str):
        return loc[1]
    return None


_INPUT_SHAPES = frozenset({"text", "texts", "tokens", "token_lists"})


def _describe(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None, str]:
    """(message, param, code) for a list of pydantic errors, naming the first bad field."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON: {detail}".rstrip(": "), None, "invalid_json"
    param = _param_of(loc)
    if param is None:
        if kind == "missing":
            return "A JSON request body is required.", None, "missing_body"
        return f"The request body must be a JSON object ({first.get('msg')}).", None, "invalid_body"
    same_field = [e for e in errors if _param_of(tuple(e.get("loc", ()))) == param]
    if kind == "missing":
        return f"Missing required field '{param}'.", param, "missing_field"
    if len(same_field) > 1 and len({tuple(e["loc"][:3]) for e in same_field}) > 1:
        # A union: each accepted shape failed. Name the field and the first reason.
        return (
            f"Invalid value for '{param}': it matches none of the accepted types "
            f"({first.get('msg')}).",
            param,
            "invalid_type",
        )
    # Without the tag of the input shape it was read as (protocol.EmbeddingInput).
    path = [p for i, p in enumerate(loc[1:]) if not (i == 1 and p in _INPUT_SHAPES)]
    where = ".".join(str(p) for p in path)
    return f"Invalid value for '{where}': {first.get('msg')}.", param, "invalid_value"


def server_error_response(exc: EmbeddingServerError) -> Response:
    """The answer to an error of the taxonomy; the server's own failures are logged."""
    if exc.status_code >= 500:
        logger.error("%s: %s", type(exc).__name__, exc.message)
    return response_for(exc)


def validation_error_response(errors: Sequence[Mapping[str, Any]]) -> Response:
    """The 400 for pydantic's errors about a request, their ``loc`` starting at ``"body"``."""
    message, param, code = _describe(list(errors) or [{"msg": "invalid request"}])
    return error_response(400, message, param=param, code=code)


async def handle_server_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, EmbeddingServerError)
    return server_error_response(exc)


async def handle_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return validation_error_response(exc.errors())


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.__cause__, EmbeddingServerError):
        # FastAPI wraps errors raised while reading the body (our 413 from the counting
        # receive) in a generic 400; the cause is the real answer.
        return response_for(exc.__cause__)
    status = exc.status_code
    if status == 404:
        message = f"No route {request.method} {request.url.path}."
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    else:
        message = str(exc.detail)
    return error_response(status, message, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(EmbeddingServerError, handle_server_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_exception)
