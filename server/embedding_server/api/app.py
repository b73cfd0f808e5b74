"""The FastAPI application factory and the server's lifecycle (load -> ready -> drain).

The process starts listening before the model is loaded so that orchestrators see it alive
(``/health`` is 200 from the first moment) while ``/ready`` stays 503 until the engine has
loaded and warmed up. On a stop signal readiness drops to 503 at once (the CLI calls
:meth:`Lifecycle.begin_drain` from its signal hook), uvicorn stops accepting connections and
lets in-flight requests finish, and the lifespan's exit stops the engine after draining it.
A model that fails to load ends the process with one clear log line and exit status 1.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedding_server.api.direct import DirectRoutes, direct_routes
from embedding_server.api.errors import install_error_handlers
from embedding_server.api.golden import GoldenVectors
from embedding_server.api.lifecycle import Lifecycle, freeze_heap, served_model_name
from embedding_server.api.middleware import RequestContextMiddleware
from embedding_server.api.protocol import RequestLimits
from embedding_server.api.routes_cohere import router as cohere_router
from embedding_server.api.routes_openai import router as openai_router
from embedding_server.api.routes_ops import router as ops_router
from embedding_server.api.routes_tasks import router as tasks_router
from embedding_server.api.routes_vllm import router as vllm_router
from embedding_server.api.tracing import TracingMiddleware
from embedding_server.fingerprint import HEADER, ExpectedFingerprint
from embedding_server.metrics import Metrics
from embedding_server.request.serving import ServingEngine
from embedding_server.request.tracing import Tracing
from embedding_server.settings import ServerSettings
from embedding_server.termination import report_model_load_failure

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger(__name__)


ROUTERS = (openai_router, cohere_router, vllm_router, tasks_router, ops_router)
"""Every route the server has."""

Connect = Callable[[ServerSettings, Metrics], Awaitable[ServingEngine]]
"""How a server gets its engine: load the model in this process
(:func:`embedding_server.engine.load_engine`, which the CLI passes), or, in an
``--api-workers`` front-end, connect to the engine process. The HTTP layer never imports
the model runtime itself (the import contracts in pyproject.toml)."""


class EmbeddingApp(FastAPI):
    """FastAPI, with the JSON POST routes (:mod:`embedding_server.api.direct`) entered at the
    server's own outermost middleware.

    Starlette passes every request through five layers before the first user middleware:
    FastAPI's and Starlette's ``__call__``, ``ServerErrorMiddleware``, FastAPI's telemetry
    and body-limit layers. The telemetry is off here and no ``max_body_size`` is set, so for
    these routes they only cost a coroutine frame on every resume of the request (several
    per request, a few percent of a single text's event-loop time: docs/performance-log.md).
    A direct route's request starts at :class:`RequestContextMiddleware` (or the tracing
    layer outside it), which already turns an unexpected exception into the server's own
    500; every other request, and the lifespan, take FastAPI's whole stack as before."""

    direct_paths: frozenset[str] = frozenset()
    """The paths whose POSTs :class:`DirectRoutes` serves."""
    fingerprinted_paths: frozenset[str] = frozenset()
    """The paths whose answers carry :data:`~embedding_server.fingerprint.HEADER`: every
    route that answers from the model's outputs (:data:`UNFINGERPRINTED` aside)."""
    fingerprint: Callable[[], str] | None = None
    """The served model's fingerprint, once it is known (else empty)."""
    _direct_entry: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in self.fingerprinted_paths:
            fingerprint = self.fingerprint() if self.fingerprint is not None else ""
            if fingerprint:
                send = _fingerprinting(send, fingerprint.encode("ascii"))
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in self.direct_paths
        ):
            entry = self._direct_entry or self._user_stack()
            if self.root_path:
                scope["root_path"] = self.root_path
            scope["app"] = self  # what Request.app reads, as Starlette sets it
            await entry(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def _user_stack(self) -> ASGIApp:
        """The outermost user middleware of the built stack (built as Starlette would)."""
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        outermost = self.user_middleware[0].cls
        node: object = self.middleware_stack
        while not isinstance(node, outermost):  # type: ignore[arg-type]
            node = getattr(node, "app")  # noqa: B009  (each layer wraps the next as .app)
        self._direct_entry = node  # type: ignore[assignment]
        return self._direct_entry  # type: ignore[return-value]


_FINGERPRINT_HEADER = HEADER.lower().encode("ascii")


def _fingerprinting(send: Send, fingerprint: bytes) -> Send:
    """``send``, adding the fingerprint header to a successful answer."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start" and 200 <= message["status"] < 300:
            headers = [*message.get("headers", ()), (_FINGERPRINT_HEADER, fingerprint)]
            message = {**message, "headers": headers}
        await send(message)

    return sending


async def _bring_up(lifecycle: Lifecycle, connect: Connect | None) -> None:
    settings = lifecycle.settings
    started = time.monotonic()
    try:
        if lifecycle.engine is None:
            if connect is None:
                raise RuntimeError("create_app() was given neither an engine nor connect")
            lifecycle.engine = await connect(settings, lifecycle.metrics)
            # A tensor-parallel rank that dies or hangs ends the server (exit 1).
            lifecycle.engine.on_failure(lifecycle.fail)
        if settings.expect_fingerprint is not None:
            info = lifecycle.engine.info()
            try:
                expected = ExpectedFingerprint.parse(settings.expect_fingerprint)
            except ValueError as error:  # its shape was checked with the settings
                lifecycle.refuse(f"--expect-fingerprint {error}")
                return
            mismatch = expected.mismatch(info.fingerprint, info.fingerprint_inputs)
            if mismatch is not None:
                lifecycle.refuse(mismatch)
                return
        await lifecycle.engine.start()
        if lifecycle.golden is not None:
            # Before /ready: the probe set embedded (and compared) by the engine now serving.
            await lifecycle.golden.prepare(lifecycle.engine)
            lifecycle.golden.start_watching(lifecycle.engine)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # startup, not a request: one clear line, then exit 1
        # The log gets the error as it is (the API key, the one secret setting, is never in
        # it: it prints masked); /ready only a fixed line.
        logger.debug("model load failed", exc_info=True)
        detail = f"{type(error).__name__}: {error}"
        report_model_load_failure()
        lifecycle.fail(f"could not load the model named by --model: {detail}")
        return
    freeze_heap()
    if lifecycle.golden is not None and lifecycle.golden.changed:
        return  # not ready: the golden check said why, and says when that changes
    logger.info(
        "ready: serving %r as %r (%.1f s to load and warm up)",
        settings.model,
        served_model_name(settings),
        time.monotonic() - started,
    )


def create_app(
    settings: ServerSettings,
    engine: ServingEngine | None = None,
    *,
    connect: Connect | None = None,
    accept_when_ready: bool = False,
    tracer_provider: TracerProvider | None = None,
) -> EmbeddingApp:
    """Build the HTTP application.

    With ``engine=None``, ``connect`` gets the engine in the background once the server
    starts (``embedding_server.engine.load_engine`` loads the model ``settings`` names);
    pass an engine (e.g. ``Engine.from_pretrained("fake")``) to serve it instead. The
    engine is started and stopped by the application's lifespan. ``accept_when_ready``:
    the lifespan's startup, and so uvicorn's first accept, waits for the engine (an
    ``--api-workers`` front-end restarted beside others that serve meanwhile).
    ``tracer_provider``: where the model routes' spans go (the caller's to shut down); by
    default OTLP to ``settings.otlp_traces_endpoint``, and no tracing when that is unset
    (:mod:`embedding_server.request.tracing`).
    """
    metrics: Metrics = getattr(engine, "metrics", None) or Metrics()
    lifecycle = Lifecycle(settings=settings, metrics=metrics, engine=engine)
    lifecycle.golden = GoldenVectors(
        Path(settings.golden_vectors) if settings.golden_vectors else None,
        settings.golden_min_cosine,
        auto_truncate=settings.auto_truncate,
    )
    model = lifecycle.served_model_name
    tracing = (
        Tracing(tracer_provider, model, settings.trace_parent_policy)
        if tracer_provider is not None
        else Tracing.configure(settings.otlp_traces_endpoint, model, settings.trace_parent_policy)
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bring_up = asyncio.create_task(_bring_up(lifecycle, connect), name="bring-up")
        if accept_when_ready:
            await asyncio.wait([bring_up])  # a failure is the lifecycle's: it exits 1
        try:
            yield
        finally:
            lifecycle.begin_drain("shutdown")
            if not bring_up.done():
                bring_up.cancel()
            await asyncio.gather(bring_up, return_exceptions=True)
            if lifecycle.golden is not None:
                await lifecycle.golden.stop()
            if lifecycle.engine is not None:
                # uvicorn has already waited for in-flight requests; this finishes anything
                # still queued (e.g. work of requests uvicorn gave up on) within the budget.
                await lifecycle.engine.stop(drain=True, timeout=settings.shutdown_timeout)
            if tracing is not None and tracer_provider is None:
                tracing.shutdown()  # the last spans leave before the process does
            logger.info("stopped")

    app = EmbeddingApp(
        title="embedding-server",
        summary="OpenAI-compatible, Cohere-style and vLLM-style embedding endpoints.",
        version=_version(),
        lifespan=lifespan,
        # FastAPI's own OpenTelemetry hooks look the global providers up in os.environ on
        # every request (a share of the event loop's time under load: docs/performance-log.md);
        # this server reports through its Prometheus metrics and request-id logs instead,
        # and with --otlp-traces-endpoint through its own spans (embedding_server.request.tracing).
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    app.state.lifecycle = lifecycle
    app.state.settings = settings
    app.state.metrics = metrics
    for router in ROUTERS:
        app.include_router(router)
    install_error_handlers(app)
    # Metrics label requests by route; anything else is "other" (bounded label cardinality).
    route_paths = [getattr(route, "path", "") for router in ROUTERS for route in router.routes]
    # Added first, so it runs inside the request context (id, auth, limits, metrics).
    posts = direct_routes(ROUTERS)
    app.direct_paths = frozenset(posts)
    # Every POST route is a model route: X-Expect-Embedding-Fingerprint is checked on each.
    model_posts = frozenset(
        getattr(route, "path", "")
        for router in ROUTERS
        for route in router.routes
        if "POST" in getattr(route, "methods", ())
    )
    app.fingerprinted_paths = model_posts - UNFINGERPRINTED
    app.fingerprint = functools.partial(_fingerprint, lifecycle)
    app.add_middleware(DirectRoutes, routes=posts, limits=functools.partial(_limits, lifecycle))
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics,
        api_key=settings.api_key.get_secret_value() if settings.api_key else None,
        max_request_bytes=settings.max_request_bytes,
        route_paths=route_paths,
        allowed_hosts=settings.allowed_hosts,
        body_timeout=settings.body_timeout,
        max_receiving_bytes=settings.receiving_bytes,
        bulk_routes=settings.bulk_routes,
        fingerprint=app.fingerprint,
        fingerprinted_routes=model_posts,
    )
    if tracing is not None:  # outermost: a request's span covers all of the above
        app.add_middleware(TracingMiddleware, tracing=tracing, paths=posts)
    return app


UNFINGERPRINTED = frozenset({"/tokenize", "/detokenize"})
"""Model routes whose answers are token ids or text, no model output: no fingerprint."""


def _fingerprint(lifecycle: Lifecycle) -> str:
    engine = lifecycle.engine
    return engine.info().fingerprint if engine is not None else ""


def _limits(lifecycle: Lifecycle) -> RequestLimits:
    """What a request body may carry now: the engine's token limit once it has loaded."""
    engine = lifecycle.engine
    max_tokens = engine.info().max_request_tokens if engine is not None else None
    return RequestLimits(lifecycle.settings.max_inputs_per_request, max_tokens)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("embedding-operator")
    except PackageNotFoundError:
        return "0.0.0"
