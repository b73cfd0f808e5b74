"""What every request goes through before and after its route, as one plain ASGI layer.

One layer rather than a stack of ``BaseHTTPMiddleware`` classes because each of those costs
a task and a memory stream per request, and this server's HTTP overhead is a budget. In
order, for each HTTP request it:

1. takes the ``X-Request-Id`` header (or makes one), puts it in the logging context and
   echoes it on the response;
2. counts the request in flight and, when it ends, by endpoint and status;
3. refuses a missing or wrong API key (401) on every route except the probes and /metrics;
4. refuses a POST whose body is not labelled ``application/json`` (415): a browser sends
   ``text/plain`` and form bodies cross-site without asking first, so accepting them would
   let any web page call a server without an API key on the visitor's network;
5. refuses a body over the size limit (413), by ``Content-Length`` up front and by counting
   bytes for chunked uploads;
6. adds ``x-total-time`` (ms) to the response;
7. turns an unexpected exception into a generic 500 that leaks nothing, logging the
   traceback with the request id.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedding_server.api.errors import error_body
from embedding_server.api.ids import new_id
from embedding_server.errors import (
    AuthenticationError,
    EmbeddingServerError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)
from embedding_server.logging import request_id_var
from embedding_server.metrics import Metrics

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Routes that never need the API key: probes and the scrape endpoint."""

_MAX_REQUEST_ID = 128


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _clean_request_id(raw: bytes | None) -> str:
    if raw:
        text = raw.decode("latin-1").strip()[:_MAX_REQUEST_ID]
        if text and text.isprintable():
            return text
    return new_id()


def _is_json(content_type: bytes | None) -> bool:
    """``application/json`` or ``application/<x>+json``, with any parameters (charset)."""
    if not content_type:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


class RequestContextMiddleware:
    """Request id, auth, body limit, timing, metrics and last-resort 500s (see module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: Metrics,
        api_key: str | None,
        max_request_bytes: int,
        route_paths: Iterable[str],
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.route_paths = frozenset(route_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = _clean_request_id(_header(scope, b"x-request-id"))
        token = request_id_var.set(request_id)
        path: str = scope["path"]
        endpoint = path if path in self.route_paths else "other"
        status_holder: list[int] = []
        self.metrics.in_flight.inc()

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_holder.append(int(message["status"]))
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                seconds = time.perf_counter() - started
                self.metrics.observe_request(endpoint, seconds)
                headers.append((b"x-total-time", f"{seconds * 1000.0:.3f}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            refusal = self._refuse(scope, path)
            if refusal is not None:
                # A client without the key learns which scheme to use (RFC 6750).
                bearer = ((b"www-authenticate", b"Bearer"),)
                extra = bearer if isinstance(refusal, AuthenticationError) else ()
                await self._send_error(
                    send_wrapper,
                    refusal.status_code,
                    refusal.message,
                    refusal.error_type,
                    refusal.code,
                    extra,
                )
            else:
                await self.app(scope, self._limited(receive), send_wrapper)
        except Exception:
            logger.exception(
                "unhandled error in %s %s (request id %s)", scope.get("method"), path, request_id
            )
            if not status_holder:
                await self._send_error(
                    send_wrapper,
                    500,
                    "The server had an error while "
                    f"processing the request (request id {request_id}).",
                    "server_error",
                    "internal_error",
                    (),
                )
        finally:
            self.metrics.in_flight.dec()
            status = status_holder[0] if status_holder else 499
            self.metrics.count_request(endpoint, status)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "%s %s -> %d in %.1f ms",
                    scope.get("method"),
                    path,
                    status,
                    (time.perf_counter() - started) * 1000.0,
                )
            request_id_var.reset(token)

    def _refuse(self, scope: Scope, path: str) -> EmbeddingServerError | None:
        """The error a request gets before its route runs, if any (steps 3-5 above)."""
        if self.api_key is not None and path not in OPEN_PATHS:
            auth = _header(scope, b"authorization") or b""
            scheme, _, key = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
                return AuthenticationError(
                    "Missing or invalid API key: send 'Authorization: Bearer <key>'."
                )
        if scope["method"] == "POST" and not _is_json(_header(scope, b"content-type")):
            given = (_header(scope, b"content-type") or b"").decode("latin-1")[:100]
            return UnsupportedMediaTypeError(
                "The request body must be JSON sent with 'Content-Type: application/json'"
                + (f"; got {given!r}." if given.isprintable() and given else "; got none.")
            )
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return PayloadTooLargeError(self._too_large_message())
        return None

    def _too_large_message(self) -> str:
        return f"The request body exceeds the limit of {self.max_request_bytes} bytes."

    def _limited(self, receive: Receive) -> Receive:
        limit = self.max_request_bytes
        seen = 0

        async def receive_limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise PayloadTooLargeError(self._too_large_message())
            return message

        return receive_limited

    @staticmethod
    async def _send_error(
        send: Send,
        status: int,
        message: str,
        error_type: str,
        code: str | None,
        extra_headers: Any,
    ) -> None:
        body = error_body(message, error_type, None, code)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *extra_headers,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
