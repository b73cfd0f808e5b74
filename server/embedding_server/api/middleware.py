"""What every request goes through before and after its route, as one plain ASGI layer.

One layer rather than a stack of ``BaseHTTPMiddleware`` classes because each of those costs
a task and a memory stream per request, and this server's HTTP overhead is a budget. In
order, for each HTTP request it:

1. takes the ``X-Request-Id`` header (or makes one), puts it in the logging context and
   echoes it on the response;
2. counts the request in flight and, when it ends, by endpoint and status;
3. refuses a ``Host`` the server does not answer for (400), when ``--allowed-hosts`` is set:
   a page using DNS rebinding sends its own name, never one of these or an IP address;
4. refuses a missing or wrong API key (401) on every route except the probes, /metrics and
   /golden;
5. refuses a POST whose body is not labelled ``application/json`` (415): a browser sends
   ``text/plain`` and form bodies cross-site without asking first, so accepting them would
   let any web page call a server without an API key on the visitor's network;
6. refuses a body over the size limit (413), by ``Content-Length`` up front and by counting
   bytes for chunked uploads; a body that does not arrive within ``--body-timeout`` (408);
   and a body that would make the bodies still arriving, all requests together, more than
   ``--max-receiving-bytes`` (503 with Retry-After; a body's first 64 KiB do not count);
   the last two close the connection;
6b. on a POST, waits for the connection's previous answer to have been taken by its client
   (bounded by ``--send-timeout``, which closes the connection), and refuses the request
   (429 with Retry-After) while the process holds ``--max-sending-bytes`` of answers waiting
   to be sent (both from :mod:`embedding_server.api.connections`, under uvicorn);
7. reads the request's ``X-Priority`` (``interactive`` or ``bulk``; without it, bulk on the
   ``--bulk-routes`` and interactive elsewhere) into :data:`~embedding_server.request.jobs.
   request_priority`, where the engine's admission and batching read it; any other value
   is a 400 naming the header;
7b. on a model route, refuses a request whose ``X-Expect-Embedding-Fingerprint`` is not
   the model's fingerprint, nor a prefix of it (409 naming both; a header that is no
   fingerprint or prefix of at least 8 hex digits is a 400 naming it), before its body is
   read: the answer would hold vectors of another computation than the client's index;
8. adds ``x-total-time`` (ms) to the response;
9. turns an unexpected exception into a generic 500 that leaks nothing, logging the
   traceback with the request id.

What it cannot see, because it happens before a request exists (header size and timeouts,
half-open connections, the connection cap), is guarded under uvicorn by
:mod:`embedding_server.api.connections`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedding_server.api.errors import error_body
from embedding_server.api.ids import new_id
from embedding_server.errors import (
    AnswersWaitingError,
    AuthenticationError,
    EmbeddingServerError,
    FingerprintMismatchError,
    HostNotAllowedError,
    InvalidRequestError,
    PayloadTooLargeError,
    RequestTimeoutError,
    ServerBusyError,
    UnsupportedMediaTypeError,
)
from embedding_server.fingerprint import EXPECT_HEADER, expected_prefix
from embedding_server.logging import request_id_var
from embedding_server.metrics import Metrics
from embedding_server.request.admission import Priority
from embedding_server.request.jobs import request_priority

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ready", "/load", "/metrics", "/golden"})
"""Routes that never need the API key: probes, the scrape endpoint and ``/golden`` (the
fixed probe texts' vectors and the fingerprint, which every answer carries: what an operator
records and compares, nothing a client sent)."""

_MAX_REQUEST_ID = 128

_EXPECT_HEADER = EXPECT_HEADER.lower().encode("ascii")

SENDING_SCOPE_KEY = "embedding_server.sending"
"""The ASGI scope key of a request's connection under uvicorn
(:class:`embedding_server.api.connections.GuardedHttpToolsProtocol`): ``await
previous_answer_sent()`` (whether the connection is still open once its previous answer has
been taken) and ``budget_full()`` (``--max-sending-bytes`` reached). Absent elsewhere."""

PRIORITY_HEADER = "X-Priority"
"""The header that marks a request ``interactive`` or ``bulk``; the gateway reads and
forwards the same one (docs/gateway.md, "Priority")."""

FREE_BODY_BYTES = 64 * 1024
"""The first bytes of each body, not counted against ``--max-receiving-bytes``: uvicorn
buffers this much of a connection's body anyway, and a small request is never refused for
what big uploads hold."""


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


class HostCheck:
    """Whether a ``Host`` header names a host the server answers for: one of ``allowed``
    (``*.name`` also matches its subdomains, ``*`` anything), or an IP address."""

    def __init__(self, allowed: Sequence[str]) -> None:
        names = {h.strip().lower().rstrip(".") for h in allowed if h.strip()}
        self.any = "*" in names
        self.exact = frozenset(n for n in names if not n.startswith("*."))
        self.suffixes = tuple(n[1:] for n in names if n.startswith("*."))

    def allows(self, header: bytes | None) -> bool:
        if self.any or header is None:  # no Host: HTTP/1.0, never a browser
            return True
        text = header.decode("latin-1").strip().lower()
        if text.startswith("["):  # [v6]:port
            host = text[1 : text.find("]")] if "]" in text else text
        else:
            host = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
        host = host.rstrip(".")
        if host in self.exact or (self.suffixes and host.endswith(self.suffixes)):
            return True
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return False
        return True


class RequestContextMiddleware:
    """Request id, host, auth, body limits, timing, metrics and last-resort 500s (see the
    module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: Metrics,
        api_key: str | None,
        max_request_bytes: int,
        route_paths: Iterable[str],
        allowed_hosts: Sequence[str] | None = None,
        body_timeout: float | None = None,
        max_receiving_bytes: int | None = None,
        bulk_routes: Iterable[str] = (),
        fingerprint: Callable[[], str] | None = None,
        fingerprinted_routes: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.fingerprint = fingerprint
        """The served model's fingerprint, once it is known (else empty)."""
        self.fingerprinted_routes = frozenset(fingerprinted_routes)
        """The model routes a client may send :data:`EXPECT_HEADER` to."""
        self.bulk_routes = frozenset(bulk_routes)
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.route_paths = frozenset(route_paths)
        self.hosts = HostCheck(allowed_hosts) if allowed_hosts is not None else None
        self.body_timeout = body_timeout
        self.max_receiving_bytes = max_receiving_bytes
        self.receiving = 0
        """Bytes of bodies still arriving that count against ``max_receiving_bytes``."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sending = scope.get(SENDING_SCOPE_KEY) if scope["method"] == "POST" else None
        if sending is not None and not await sending.previous_answer_sent():
            return  # the client never took its previous answer: the connection is closed
        started = time.perf_counter()
        request_id = _clean_request_id(_header(scope, b"x-request-id"))
        token = request_id_var.set(request_id)
        path: str = scope["path"]
        endpoint = path if path in self.route_paths else "other"
        status_holder: list[int] = []
        self.metrics.in_flight.inc()
        receive, release = self._limited(receive)
        priority_token = None

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
            if refusal is None and sending is not None and sending.budget_full():
                refusal = AnswersWaitingError(
                    "The server holds as many answers waiting for their clients to read them "
                    "as it may (--max-sending-bytes); retry shortly.",
                    retry_after=1.0,
                )
            if refusal is None and scope["method"] == "POST":
                priority = self._priority(scope, path)
                if isinstance(priority, InvalidRequestError):
                    refusal = priority
                else:
                    priority_token = request_priority.set(priority)
            if refusal is None and path in self.fingerprinted_routes:
                refusal = self._other_fingerprint(scope)
            if refusal is not None:
                # A client without the key learns which scheme to use (RFC 6750).
                bearer = ((b"www-authenticate", b"Bearer"),)
                extra: tuple[tuple[bytes, bytes], ...] = ()
                if isinstance(refusal, AuthenticationError):
                    extra = bearer
                elif isinstance(refusal, AnswersWaitingError):
                    extra = ((b"retry-after", b"%d" % max(1, round(refusal.retry_after))),)
                await self._send_error(
                    send_wrapper,
                    refusal.status_code,
                    refusal.message,
                    refusal.error_type,
                    refusal.code,
                    extra,
                    refusal.param,
                )
            else:
                await self.app(scope, receive, send_wrapper)
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
            release()
            if priority_token is not None:
                request_priority.reset(priority_token)
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
        """The error a request gets before its route runs, if any (steps 3-6 above)."""
        if self.hosts is not None and not self.hosts.allows(_header(scope, b"host")):
            return HostNotAllowedError(
                "The Host header names a host this server does not answer for "
                "(--allowed-hosts); use one of its names or its IP address."
            )
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

    def _priority(self, scope: Scope, path: str) -> Priority | InvalidRequestError:
        """The request's priority by its header, or by its route; a 400 for another value."""
        given = _header(scope, b"x-priority")
        if given is None:
            return "bulk" if path in self.bulk_routes else "interactive"
        value = given.decode("latin-1").strip().lower()
        if value == "interactive":
            return "interactive"
        if value == "bulk":
            return "bulk"
        return InvalidRequestError(
            f"The {PRIORITY_HEADER} header must be 'interactive' or 'bulk'.",
            param=PRIORITY_HEADER,
        )

    def _other_fingerprint(self, scope: Scope) -> EmbeddingServerError | None:
        """A 409 when the request expects another fingerprint than the model's (a 400 when
        its :data:`EXPECT_HEADER` is no fingerprint or prefix of one)."""
        given = _header(scope, _EXPECT_HEADER)
        if given is None:
            return None
        try:
            expected = expected_prefix(given.decode("latin-1"))
        except ValueError as error:
            return InvalidRequestError(str(error), param=EXPECT_HEADER)
        ours = self.fingerprint() if self.fingerprint is not None else ""
        if not ours or ours.startswith(expected):
            return None  # not loaded yet: the route answers 503
        return FingerprintMismatchError(
            f"This server's embedding fingerprint is {ours}, not {expected} "
            f"({EXPECT_HEADER}): its vectors come from another computation than the one "
            "expected, so the request was not run. Send it to the version with that "
            "fingerprint, or re-embed with this one.",
            param=EXPECT_HEADER,
        )

    def _too_large_message(self) -> str:
        return f"The request body exceeds the limit of {self.max_request_bytes} bytes."

    def _limited(self, receive: Receive) -> tuple[Receive, Callable[[], None]]:
        """``receive`` with the body limits of step 6, and the function that gives back what
        the request holds of ``max_receiving_bytes`` (called when the request ends)."""
        limit, budget = self.max_request_bytes, self.max_receiving_bytes
        timeout = self.body_timeout
        deadline = asyncio.get_running_loop().time() + timeout if timeout is not None else None
        seen = held = 0
        arrived = False

        def release() -> None:
            nonlocal held
            self.receiving -= held
            held = 0

        async def receive_limited() -> Message:
            nonlocal seen, held, arrived
            if arrived:  # the body is in: what is left to hear of is a disconnect
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeoutError(
                    f"The request body did not arrive within {timeout:g} s (--body-timeout)."
                ) from None
            if message["type"] != "http.request":
                arrived = True
                release()
                return message
            seen += len(message.get("body", b""))
            if seen > limit:
                raise PayloadTooLargeError(self._too_large_message())
            counted = max(0, seen - FREE_BODY_BYTES)
            if budget is not None and counted > held:
                if self.receiving + counted - held > budget:
                    raise ServerBusyError(
                        "The server is receiving as many request bodies as it holds at once "
                        "(--max-receiving-bytes); retry shortly.",
                        retry_after=1.0,
                    )
                self.receiving += counted - held
                held = counted
            if not message.get("more_body", False):
                arrived = True
                release()
            return message

        return receive_limited, release

    @staticmethod
    async def _send_error(
        send: Send,
        status: int,
        message: str,
        error_type: str,
        code: str | None,
        extra_headers: Any,
        param: str | None = None,
    ) -> None:
        body = error_body(message, error_type, param, code)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *extra_headers,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
