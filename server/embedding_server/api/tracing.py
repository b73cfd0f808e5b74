"""The ASGI layer that traces the model routes (installed only with ``--otlp-traces-endpoint``).

It is the outermost layer, so a request's span covers everything the server does for it,
the request-context layer's refusals (401, 413, 415) included. Only the POST model routes are
traced: probes and scrapes would drown the traces that matter. What the spans hold, and how
the engine's stages join them, is :mod:`embedding_server.request.tracing`'s.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedding_server.request.tracing import Tracing, current_trace


class TracingMiddleware:
    """One span per request to ``paths``, current while the route runs."""

    def __init__(self, app: ASGIApp, *, tracing: Tracing, paths: Iterable[str]) -> None:
        self.app = app
        self.tracing = tracing
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or path not in self.paths:
            await self.app(scope, receive, send)
            return
        traced = self.tracing.begin(scope["method"], path, scope["headers"])
        if traced is None:  # sampled out
            await self.app(scope, receive, send)
            return

        async def send_traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                traced.responded(int(message["status"]), message.get("headers", ()))
            await send(message)

        token = current_trace.set(traced)
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as error:
            traced.failed(error)
            raise
        finally:
            current_trace.reset(token)
            traced.end()
