"""The gateway's HTTP front: route by ``model``, forward untouched, retry what was dropped.

Every POST route the server has is forwarded: the body is read once, only its ``model``
field is decoded (msgspec skips everything else without building it), and the same bytes go
upstream. The upstream answer is read whole before any byte of it goes to the client, so a
pod that dies mid-answer is retried like one that refused the connection: nothing of the
first attempt ever reached the client.

Holding bodies and answers whole is what makes the retry possible, so what they hold is
bounded (:mod:`embedding_server.gateway.budget`): each is charged to ``--max-buffered-bytes``
by its ``Content-Length`` before it is read, and a request that does not fit gets 503 with
``Retry-After`` (``server_busy``) without being read. A body must arrive within
``--body-timeout``; an answer is written as the client takes it, in pieces the socket's
buffer holds, and a client that has not taken it all within ``--write-timeout`` loses its
connection and the answer's bytes. Embedding requests are idempotent, which is what
makes a retry safe at all; a 4xx is the request's own fault and is never retried, and a
request that timed out upstream is not retried either (the pod may still be working on it,
and a retry would double the load that made it slow).

Errors the gateway itself gives have the OpenAI shape the server uses::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import aiohttp
import msgspec
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from embedding_server.fingerprint import pinned_name, versioned_name
from embedding_server.gateway.apikeys import BulkApiKeysFile
from embedding_server.gateway.balancer import (
    Choose,
    EndpointState,
    LoadPoller,
    least_backlog,
    random_choice,
)
from embedding_server.gateway.budget import ByteBudget, Hold
from embedding_server.gateway.connections import ConnectionGuard
from embedding_server.gateway.discovery import Discovery, Service
from embedding_server.gateway.holding import HoldClosedError, HoldFullError, Holding
from embedding_server.gateway.metrics import GatewayMetrics
from embedding_server.gateway.settings import GatewaySettings, Priority

logger = logging.getLogger(__name__)

FORWARDED_ROUTES = (
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/classify",
    "/v1/classify",
    "/tokenize",
    "/detokenize",
)
"""The server's model routes (``api/routes_*.py``); each names its model in ``model``.
``tests/server/gateway`` checks this against the server's own route table."""

PRIORITY_HEADER = "X-Priority"
ECHO_CHARS = 200
"""The most of a client's model name an error message repeats (issue 48, L4: a 1 MiB name was
echoed whole into the 404)."""


def _echo(name: str) -> str:
    """``name`` quoted for an error message, cut to :data:`ECHO_CHARS` characters."""
    if len(name) <= ECHO_CHARS:
        return repr(name)
    return f"{name[:ECHO_CHARS]!r}... ({len(name):,} characters)"


TOKENS_PER_BYTE = 0.25
"""Estimated tokens of a held request: a quarter of its body's bytes (English text runs at
about four bytes per token; JSON framing makes it an overestimate, which is the safe side
for a bound)."""

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_RESPONSE_SKIP = _HOP_BY_HOP | {"date", "server"}

WRITE_CHUNK_BYTES = 64 * 1024
"""The pieces an answer is written in: each waits until the socket's buffer has room, so a
client that reads slowly (or not at all) holds one piece of the answer in it, not a copy of
the whole."""

KEEPALIVE_OFF = 24 * 3600.0
"""aiohttp's own keep-alive timer, which also runs while a head arrives: off (a day), as
:mod:`embedding_server.gateway.connections` times heads and idle connections itself."""

PROBE_MAX_CONNECTIONS = 64
"""Open connections the probe port (``--probe-port``) takes: a kubelet probes a container
every few seconds, one connection at a time."""

MAX_RETRY_AFTER_SECONDS = 30.0
"""The longest ``Retry-After`` a 503 for a model without a ready endpoint suggests (half the
hold timeout, up to this): a model that wakes while its clients are away should not wait
for clients told to come back minutes later."""


class _ModelField(msgspec.Struct):
    """Only ``model``; every other field of the body is skipped, not decoded."""

    model: str | None = None


_decode_model = msgspec.json.Decoder(_ModelField).decode


def error_response(
    status: int,
    message: str,
    *,
    error_type: str,
    code: str,
    param: str | None = None,
    retry_after: float | None = None,
) -> web.Response:
    body = orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    )
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


class Catalog:
    """The current services by key and by every name they answer to, and the versions of
    each name (``name@fingerprint``) where discovery knows them."""

    def __init__(self) -> None:
        self.services: dict[str, Service] = {}
        self.by_name: dict[str, Service] = {}
        self.loaded = False
        self._conflicts: set[tuple[str, str, str]] = set()

    def find(self, model: str) -> Service | None:
        """The entry that serves ``model``: the one of that name; for a versioned name
        (``name@<fingerprint or a prefix of 8 or more of its digits>``), the version of
        ``name`` whose fingerprint it gives, or else ``name``'s own entry, whose pods answer
        409 ``fingerprint_mismatch`` unless they have that fingerprint (so a pinned request
        is never answered by another version, however stale the catalog)."""
        service = self.by_name.get(model)
        if service is not None:
            return service
        pinned = pinned_name(model)
        if pinned is None:
            return None
        name, prefix = pinned
        for fingerprint in sorted(
            {s.fingerprint or "" for s in self.services.values() if s.version}
        ):
            if fingerprint and fingerprint.startswith(prefix):
                version = self.by_name.get(versioned_name(name, fingerprint))
                if version is not None:
                    return version
        return self.by_name.get(name)

    def routed(self, service: Service) -> list[str]:
        """``service``'s names that route to it (not those another entry won)."""
        return [name for name in service.names if self._owner(name) == service.key]

    def _owner(self, name: str) -> str | None:
        found = self.by_name.get(name)
        return found.key if found is not None else None

    def replace(self, services: Sequence[Service]) -> None:
        by_name: dict[str, Service] = {}
        # Versions first: a version's names derive from names its service owns, so a name
        # someone wrote that spells one (an alias ending in @ and hex digits) never takes it.
        for service in sorted(services, key=lambda s: (s.version is None, s.key)):
            for name in service.names:
                if name in by_name and by_name[name].key != service.key:
                    conflict = (name, by_name[name].key, service.key)
                    if conflict not in self._conflicts:  # once, not on every new catalog
                        self._conflicts.add(conflict)
                        logger.warning(
                            "model name %r is claimed by %s and %s; routing it to %s",
                            *conflict,
                            by_name[name].key,
                        )
                    continue
                by_name[name] = service
        self.services = {service.key: service for service in services}
        self.by_name = by_name
        self.loaded = True

    def endpoints(self) -> set[str]:
        return {url for service in self.services.values() for url in service.endpoints}


@dataclass
class _Deadlines:
    """A request's two clocks (``time.monotonic()``), each started when its phase begins:
    ``hold`` when the request is first held (``--hold-timeout`` in all, over every wait),
    ``upstream`` when a ready endpoint is first picked (``--request-timeout`` for the
    forwarding, one retry included). Time held never counts against the upstream work."""

    hold: float | None = None
    upstream: float | None = None


@dataclass
class _Answer:
    """An upstream answer read whole: its bytes (as they arrived) and their hold on the
    byte budget, given back once written (or dropped)."""

    status: int
    headers: dict[str, str]
    chunks: list[bytes]
    hold: Hold

    @property
    def size(self) -> int:
        return sum(len(chunk) for chunk in self.chunks)

    def drop(self) -> None:
        self.chunks = []
        self.hold.release()


@dataclass
class _Retryable:
    """An attempt that reached no answer the client may see (connection lost before the
    whole answer, or 503): ``fallback`` is what the client gets if no retry is left."""

    reason: str
    fallback: web.Response | _Answer


class Gateway:
    """The gateway's state and request handling; :meth:`app` is its aiohttp application."""

    def __init__(
        self,
        settings: GatewaySettings,
        discovery: Discovery,
        *,
        metrics: GatewayMetrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.discovery = discovery
        self.metrics = metrics or GatewayMetrics()
        rng = rng or random.Random()
        self.choose: Choose = (
            random_choice(rng) if settings.balancing == "random" else least_backlog(rng)
        )
        self.catalog = Catalog()
        self.holding = Holding(
            max_requests=settings.max_held_requests,
            max_tokens=settings.max_held_tokens,
            on_change=self._held_changed,
        )
        self.bulk_routes = frozenset(settings.bulk_routes)
        self.bulk_keys = (
            BulkApiKeysFile(settings.bulk_api_keys_file) if settings.bulk_api_keys_file else None
        )
        self.budget = ByteBudget(settings.max_buffered_bytes, self.metrics.buffered_bytes.set)
        self.guard = ConnectionGuard(
            max_connections=settings.max_connections,
            max_header_bytes=settings.max_header_bytes,
            header_timeout=settings.header_timeout,
            keep_alive_timeout=settings.keep_alive_timeout,
        )
        self.probe_guard = ConnectionGuard(
            max_connections=PROBE_MAX_CONNECTIONS,
            max_header_bytes=settings.max_header_bytes,
            header_timeout=settings.header_timeout,
            keep_alive_timeout=settings.keep_alive_timeout,
            make_room=True,
        )
        self._keys_task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._poller: LoadPoller | None = None
        self._discovery_task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_request_bytes, middlewares=[self.guard.middleware]
        )
        for path in FORWARDED_ROUTES:
            app.router.add_post(path, self.forward, expect_handler=self._expect)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_startup.append(self._start)
        # aiohttp runs on_shutdown once it stops accepting connections and before it waits
        # for in-flight requests: held ones are answered then, not cut off at the grace end.
        app.on_shutdown.append(self._close_holding)
        app.on_cleanup.append(self._stop)
        return app

    def probe_app(self) -> web.Application:
        """``/health``, ``/ready`` and ``/metrics`` alone, for ``--probe-port``: the same
        answers as the client port's, on connections of their own."""
        app = web.Application(middlewares=[self.probe_guard.middleware])
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    def runner(
        self, *, handle_signals: bool = False, shutdown_timeout: float = 60.0
    ) -> web.AppRunner:
        """The runner of :meth:`app` with the gateway's connection options; serve it with
        ``self.guard.listen(runner, sock)`` once it is set up."""
        return web.AppRunner(
            self.app(),
            handle_signals=handle_signals,
            access_log=None,
            shutdown_timeout=shutdown_timeout,
            keepalive_timeout=KEEPALIVE_OFF,
            # A body its handler did not read (a refusal) ends the connection at once,
            # rather than being read and dropped for aiohttp's default 10 s.
            lingering_time=0,
            # A client that hangs up stops its request here too: a held one leaves the
            # holding queue (so the held-requests gauge an autoscaler reads counts only
            # live demand), and a forwarded one closes its upstream connection, which
            # cancels its work on the pod.
            handler_cancellation=True,
        )

    async def _close_holding(self, app: web.Application) -> None:
        woken = self.holding.close()
        if woken:
            logger.info("shutting down: %d held requests answered 503 to retry elsewhere", woken)

    async def _start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=self.settings.max_connections_per_endpoint,
            ttl_dns_cache=10,
            enable_cleanup_closed=True,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        self._poller = LoadPoller(
            self._session,
            interval=self.settings.poll_interval,
            timeout=self.settings.poll_timeout,
            concurrency=self.settings.poll_concurrency,
            on_change=self._endpoint_changed,
        )
        self._poller.start()
        self._discovery_task = asyncio.create_task(self._run_discovery(), name="gateway-discovery")
        if self.bulk_keys is not None:
            self._keys_task = asyncio.create_task(self.bulk_keys.watch(), name="gateway-keys")

    async def _run_discovery(self) -> None:
        try:
            await self.discovery.run(self.publish)
        except asyncio.CancelledError:
            raise
        except Exception:  # the last catalog keeps serving; the log says why it stopped
            logger.exception("discovery stopped; routing on the last catalog")

    async def _stop(self, app: web.Application) -> None:
        if self._keys_task is not None:
            self._keys_task.cancel()
            await asyncio.gather(self._keys_task, return_exceptions=True)
        if self._discovery_task is not None:
            self._discovery_task.cancel()
            await asyncio.gather(self._discovery_task, return_exceptions=True)
        if self._poller is not None:
            await self._poller.stop()
        if self._session is not None:
            await self._session.close()

    def _held_changed(self, model: str, count: int) -> None:
        service = self.catalog.by_name.get(model)
        key = service.key if service is not None else ""
        self.metrics.held_requests.labels(model, key).set(count)

    # -- catalog and endpoints ------------------------------------------------------------
    def publish(self, services: Sequence[Service]) -> None:
        """Take a new catalog (discovery's callback)."""
        self.catalog.replace(services)
        if self._poller is not None:
            self._poller.track(self.catalog.endpoints())
        for service in self.catalog.services.values():
            self._service_changed(service)

    def _endpoint_changed(self, state: EndpointState) -> None:
        for service in self.catalog.services.values():
            if state.url in service.endpoints:
                self._service_changed(service)

    def _service_changed(self, service: Service) -> None:
        ready = self.ready_endpoints(service)
        self.metrics.ready_endpoints.labels(service.name).set(len(ready))
        if ready:
            self.holding.release(service.name)

    def ready_endpoints(self, service: Service) -> list[EndpointState]:
        if self._poller is None:
            return []
        states = self._poller.endpoints
        found = (states.get(url) for url in sorted(service.endpoints))
        return [state for state in found if state is not None and state.ready]

    # -- routes ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self.catalog.loaded:
            return web.json_response({"status": "ready"})
        return error_response(
            503,
            "The gateway has not read its routes yet.",
            error_type="server_error",
            code="not_ready",
        )

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _visible(self) -> list[Service]:
        """The services a caller may be told of (``--models-listing``), by name: the gateway
        authenticates nobody, so what one caller may see every caller does."""
        listing = self.settings.models_listing
        if listing == "none":
            return []
        services = self.catalog.services.values()
        shown = services if listing == "full" else [s for s in services if s.listed]
        return sorted(shown, key=lambda s: s.name)

    async def list_models(self, request: web.Request) -> web.Response:
        full = self.settings.models_listing == "full"
        data = []
        for service in self._visible():
            entry: dict[str, object] = {
                "id": service.name,
                "object": "model",
                "created": 0,
                "owned_by": "embedding-server",
                "aliases": self.catalog.routed(service)[1:],
            }
            if service.fingerprint is not None:
                entry["fingerprint"] = service.fingerprint
            if service.version is not None:
                entry["parent"] = service.parent
                entry["version"] = service.version
            if full:
                entry["ready_endpoints"] = len(self.ready_endpoints(service))
            data.append(entry)
        return web.json_response({"object": "list", "data": data})

    async def forward(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        outcome, label = await self._forward(request)
        if isinstance(outcome, _Answer):
            status = outcome.status
            response = await self._send(request, outcome)
        else:
            status = outcome.status
            response = outcome
        self.metrics.requests.labels(label, str(status)).inc()
        if label:
            self.metrics.request_seconds.labels(label).observe(time.monotonic() - started)
        return response

    async def _send(self, request: web.Request, answer: _Answer) -> web.StreamResponse:
        """Write ``answer`` as the client takes it, within ``--write-timeout``; past it the
        connection is dropped with what its buffer held. The answer's bytes are given back
        either way."""
        response = web.StreamResponse(status=answer.status, headers=answer.headers)
        response.content_length = answer.size
        try:
            async with asyncio.timeout(self.settings.write_timeout):
                await response.prepare(request)
                for chunk in answer.chunks:
                    view = memoryview(chunk)
                    for start in range(0, len(view), WRITE_CHUNK_BYTES):
                        await response.write(view[start : start + WRITE_CHUNK_BYTES])
                await response.write_eof()
        except TimeoutError:
            logger.info(
                "closing a connection whose client took less than its %d-byte answer to %s "
                "within --write-timeout (%g s)",
                answer.size,
                request.path,
                self.settings.write_timeout,
            )
            if request.transport is not None:
                request.transport.abort()  # drops what its buffer holds, unlike close()
        except ConnectionError:
            pass  # the client went away: nothing more to write
        finally:
            answer.drop()
        return response

    async def _expect(self, request: web.Request) -> web.Response | None:
        """``Expect: 100-continue`` (curl's, for bodies over 1 MiB): a body that is too
        large, or that the byte budget has no room for now, is refused before the client
        is asked to send it; else "100 Continue", as aiohttp's own handler writes it."""
        expect = request.headers.get("Expect", "")
        if request.version != aiohttp.HttpVersion11:
            return None
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect[:100]}")
        length = request.content_length
        if length is not None and length > self.settings.max_request_bytes:
            return _closing(self._too_large())
        if length is not None and not self.budget.has_room(length):
            return _closing(self._busy())
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # not the answer's
        return None

    async def _read_body(self, request: web.Request, hold: Hold) -> bytearray | web.Response:
        """The request's body, held against the byte budget; or the refusal it gets (its
        connection then closes, with whatever of the body was not read)."""
        limit = self.settings.max_request_bytes
        length = request.content_length
        if length is not None and length > limit:
            return _closing(self._too_large())
        if length is not None and not hold.resize(length):
            return _closing(self._busy())
        body = bytearray()
        try:
            # A body trickled in byte by byte would hold this handler (and its bytes)
            # forever: the time to receive it is bounded.
            async with asyncio.timeout(self.settings.body_timeout):
                while chunk := await request.content.readany():
                    body += chunk
                    if len(body) > limit:
                        return _closing(self._too_large())
                    if length is None and not hold.resize(len(body)):
                        return _closing(self._busy())
        except TimeoutError:
            return _closing(
                error_response(
                    408,
                    "The request body did not arrive within the gateway's --body-timeout "
                    f"({self.settings.body_timeout:g} s); send it whole and retry.",
                    error_type="invalid_request_error",
                    code="request_timeout",
                )
            )
        return body

    def _too_large(self) -> web.Response:
        return error_response(
            413,
            f"The request body is larger than {self.settings.max_request_bytes} bytes.",
            error_type="invalid_request_error",
            code="payload_too_large",
        )

    def _busy(self) -> web.Response:
        return error_response(
            503,
            "The gateway holds as many request and answer bytes as it may at once "
            "(--max-buffered-bytes); retry shortly.",
            error_type="server_error",
            code="server_busy",
            retry_after=1.0,
        )

    async def _forward(self, request: web.Request) -> tuple[web.Response | _Answer, str]:
        hold = self.budget.hold()
        try:
            return await self._forward_held(request, hold)
        finally:
            hold.release()

    async def _forward_held(
        self, request: web.Request, hold: Hold
    ) -> tuple[web.Response | _Answer, str]:
        body = await self._read_body(request, hold)
        if isinstance(body, web.Response):
            return body, ""
        service, problem = self._service_of(body)
        if service is None:
            assert problem is not None
            return problem, ""
        name = service.name
        self.metrics.last_request.labels(name, service.key).set(time.time())
        priority, problem = self._priority(request)
        if problem is not None:
            return problem, name
        deadlines = _Deadlines()
        tokens = max(1, int(len(body) * TOKENS_PER_BYTE))
        headers = _forward_headers(request.headers.items())
        # The priority as decided here (by header or by --bulk-routes), so that the pod
        # admits and batches the request in the same class whatever its own defaults.
        headers[PRIORITY_HEADER] = priority
        tried: dict[str, str] = {}
        """Each endpoint tried, and why it failed (``_Retryable.reason``)."""
        fallback: web.Response | _Answer | None = None
        for attempt in range(2):
            state, problem = await self._pick(service, tokens, priority, deadlines, tried)
            if state is None:
                assert problem is not None
                if fallback is not None and attempt:
                    return fallback, name
                return problem, name
            if deadlines.upstream is None:
                deadlines.upstream = time.monotonic() + self.settings.request_timeout
            outcome = await self._attempt(state, request, body, headers, tokens, deadlines.upstream)
            if not isinstance(outcome, _Retryable):
                if isinstance(fallback, _Answer):
                    fallback.drop()
                return outcome, name
            if isinstance(fallback, _Answer):
                fallback.drop()
            fallback = outcome.fallback
            tried[state.url] = outcome.reason
            state.refused()
            self._service_changed(service)
            if attempt == 0:
                self.metrics.retries.labels(name, outcome.reason).inc()
                logger.info(
                    "retrying a %s request for %r on another endpoint: %s at %s",
                    request.path,
                    name,
                    outcome.reason,
                    state.url,
                )
        assert fallback is not None
        return fallback, name

    def _service_of(self, body: bytes | bytearray) -> tuple[Service | None, web.Response | None]:
        try:
            model = _decode_model(body).model
        except msgspec.ValidationError:
            return None, error_response(
                400,
                "'model' must be a string naming a model.",
                error_type="invalid_request_error",
                code="invalid_value",
                param="model",
            )
        except msgspec.DecodeError:
            return None, error_response(
                400,
                "The request body is not a JSON object.",
                error_type="invalid_request_error",
                code="invalid_json",
            )
        if model is None:
            services = [s for s in self.catalog.services.values() if s.version is None]
            if len(services) == 1:
                return services[0], None
            return None, error_response(
                400,
                f"'model' is required: this gateway serves several models{self._known()}.",
                error_type="invalid_request_error",
                code="missing_model",
                param="model",
            )
        service = self.catalog.find(model)
        if service is None:
            return None, error_response(
                404,
                f"The model {_echo(model)} does not exist here{self._known()}.",
                error_type="invalid_request_error",
                code="model_not_found",
                param="model",
            )
        return service, None

    def _known(self) -> str:
        """``". Known models: 'a', 'b'"`` for an error message, of the models the caller may
        be told of (``--models-listing``); empty when it may be told of none."""
        if self.settings.models_listing == "none":
            return ""
        names = sorted(name for service in self._visible() for name in self.catalog.routed(service))
        shown = ", ".join(_echo(name) for name in names) if names else "none"
        return f". Known models: {shown}"

    def _priority(self, request: web.Request) -> tuple[Priority, web.Response | None]:
        """A bulk API key's requests are bulk whatever their header says (a key handed to an
        indexing job cannot jump the interactive queue); otherwise the header, else the
        route. A header that is neither class is a 400 either way."""
        given = request.headers.get(PRIORITY_HEADER)
        value = None if given is None else given.strip().lower()
        if value not in (None, "interactive", "bulk"):
            return "interactive", error_response(
                400,
                f"The {PRIORITY_HEADER} header must be 'interactive' or 'bulk'.",
                error_type="invalid_request_error",
                code="invalid_value",
                param=PRIORITY_HEADER,
            )
        keys = self.bulk_keys
        if keys is not None and keys.keys.is_bulk(request.headers.get("Authorization")):
            return "bulk", None
        if value == "interactive":
            return "interactive", None
        if value == "bulk":
            return "bulk", None
        return ("bulk" if request.path in self.bulk_routes else "interactive"), None

    async def _pick(
        self,
        service: Service,
        tokens: int,
        priority: Priority,
        deadlines: _Deadlines,
        tried: dict[str, str],
    ) -> tuple[EndpointState | None, web.Response | None]:
        """A ready endpoint, one not tried yet if there is one, holding the request while
        there is none: up to its hold deadline, and on a retry no longer than its upstream
        deadline either. An endpoint that dropped the connection may be tried again once
        a poll begun after that says it is ready (a single replica restarted on its
        address); one that answered 503 is not (it said it cannot take the request)."""
        name = service.name
        held = False
        while True:
            # The catalog may have changed while the request was held: look the service
            # up again (a new endpoint is what a held request waits for).
            service = self.catalog.services.get(service.key, service)
            ready = self.ready_endpoints(service)
            candidates = [s for s in ready if s.url not in tried] or [
                s for s in ready if tried.get(s.url) == "connection"
            ]
            if candidates:
                break
            now = time.monotonic()
            if deadlines.hold is None:
                deadlines.hold = now + self.settings.hold_timeout
            remaining = deadlines.hold - now
            if deadlines.upstream is not None:  # a retry's wait is part of the upstream work
                remaining = min(remaining, deadlines.upstream - now)
            if held or remaining <= 0:
                self.metrics.decisions.labels(name, "hold_timeout").inc()
                return None, self._unavailable(name)
            self.metrics.decisions.labels(name, "held").inc()
            try:
                released = await self.holding.wait(name, tokens, priority, remaining)
            except (HoldClosedError, HoldFullError) as refused:
                closing = isinstance(refused, HoldClosedError)
                self.metrics.decisions.labels(name, "shutdown" if closing else "hold_full").inc()
                message = (
                    f"The gateway is shutting down and was holding this request for {name!r}; "
                    "it reached no pod: retry."
                    if closing
                    else f"The model {name!r} has no ready endpoint and already holds as many "
                    "requests as it may; retry later."
                )
                return None, error_response(
                    503,
                    message,
                    error_type="server_error",
                    code="model_unavailable",
                    # Closing: another gateway pod can hold it now.
                    retry_after=1.0 if closing else self._retry_after(),
                )
            held = not released
        limit = self.settings.saturation_backlog_seconds
        if priority == "bulk" and all(s.backlog_seconds >= limit for s in candidates):
            self.metrics.decisions.labels(name, "saturated").inc()
            return None, error_response(
                429,
                f"Every endpoint of {name!r} is saturated; bulk requests wait for slack.",
                error_type="rate_limit_error",
                code="saturated",
                retry_after=min(s.backlog_seconds for s in candidates),
            )
        self.metrics.decisions.labels(name, "only" if len(candidates) == 1 else "picked").inc()
        return self.choose(candidates), None

    def _unavailable(self, name: str) -> web.Response:
        return error_response(
            503,
            f"The model {name!r} has no ready endpoint (it may be scaling up from zero); "
            "retry later.",
            error_type="server_error",
            code="model_unavailable",
            retry_after=self._retry_after(),
        )

    def _retry_after(self) -> float:
        return min(MAX_RETRY_AFTER_SECONDS, max(1.0, self.settings.hold_timeout / 2))

    async def _attempt(
        self,
        state: EndpointState,
        request: web.Request,
        body: bytearray,
        headers: dict[str, str],
        tokens: int,
        deadline: float,
    ) -> web.Response | _Answer | _Retryable:
        assert self._session is not None
        url = state.url + request.path_qs
        timeout = aiohttp.ClientTimeout(total=max(0.001, deadline - time.monotonic()))
        state.in_flight_requests += 1
        state.in_flight_tokens += tokens
        hold = self.budget.hold()
        try:
            async with self._session.request(
                request.method, url, data=body, headers=headers, timeout=timeout
            ) as upstream:
                answer = await self._read_answer(upstream, hold)
        except TimeoutError:
            hold.release()
            return error_response(
                504,
                "The model's endpoint did not answer within the gateway's request timeout.",
                error_type="server_error",
                code="upstream_timeout",
            )
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
            hold.release()
            # Refused, reset, or closed before the whole answer arrived: nothing of it has
            # reached the client, so another pod may answer instead.
            return _Retryable(
                "connection",
                error_response(
                    502,
                    f"The model's endpoint closed the connection before answering ({error}).",
                    error_type="server_error",
                    code="upstream_unavailable",
                ),
            )
        except aiohttp.ClientError as error:  # a malformed answer: the pod's fault, not retried
            hold.release()
            return error_response(
                502,
                f"The model's endpoint sent an answer that is not valid HTTP ({error}).",
                error_type="server_error",
                code="upstream_invalid",
            )
        except BaseException:
            hold.release()
            raise
        finally:
            state.in_flight_requests -= 1
            state.in_flight_tokens -= tokens
        if isinstance(answer, web.Response):  # refused by the byte budget
            return answer
        if answer.status == 503:
            return _Retryable("unavailable", answer)
        return answer

    async def _read_answer(
        self, upstream: aiohttp.ClientResponse, hold: Hold
    ) -> _Answer | web.Response:
        """The upstream answer, read whole and held against the byte budget (charged by
        its Content-Length before it is read); or, when it does not fit, the 503 the client
        gets instead (the upstream connection is then closed unread)."""
        length = upstream.content_length
        if length is not None and not self.budget.fits(length):
            hold.release()
            return error_response(
                502,
                f"The model's answer ({length} bytes) is larger than the gateway may hold "
                f"(--max-buffered-bytes, {self.budget.limit} bytes).",
                error_type="server_error",
                code="response_too_large",
            )
        if length is not None and not hold.resize(length):
            hold.release()
            return self._busy()
        chunks: list[bytes] = []
        size = 0
        async for chunk in upstream.content.iter_any():
            size += len(chunk)
            if length is None and not hold.resize(size):
                hold.release()
                return self._busy()
            chunks.append(chunk)
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_SKIP}
        return _Answer(upstream.status, out_headers, chunks, hold)


def _closing(response: web.Response) -> web.Response:
    """``response``, after which its connection is closed (its body was not all read)."""
    response.force_close()
    return response


def _forward_headers(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The client's headers less the hop-by-hop ones (and Host: the upstream's own), and
    less its ``X-Priority``, which the gateway sets to what it decided."""
    return {k: v for k, v in items if k.lower() not in _HOP_BY_HOP and k.lower() != "x-priority"}
