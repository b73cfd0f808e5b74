"""The probe listener (``--probe-port``): ``/health``, ``/ready``, ``/metrics`` and
``/golden`` on a port of their own, so that clients cannot starve the kubelet's probes (nor
the operator's read of the golden vectors).

The client port's connection cap (``--max-connections``) is what keeps a client from holding
unbounded connections; but one client that holds all of them, reopening each as it is
closed, kept ``/health`` answering 503 there for as long as it liked, and the liveness probe
would have restarted a pod that was fine. This listener shares the process, its event loop
and the application (the same ``/health`` and ``/ready`` answers, with the same host check and
metrics), but not the client port's connections:

* it serves only :data:`PROBE_PATHS` (anything else is a 404), so it is no way around the
  client cap;
* it has its own connection cap (:data:`PROBE_MAX_CONNECTIONS`) with the client port's header
  timeout and size; past the cap, the oldest connection that has not finished sending its
  request is closed to make room (:class:`ProbeProtocol`), not the new one: a probe sends its
  request as soon as it connects, so a crowd of idle connections cannot keep it out; the one
  closed is the oldest idle one of the peer address that holds the most
  (:mod:`embedding_server.probe_room`), never the kubelet's;
* it is started once the client port listens and stopped after the client port has drained,
  so a draining pod still answers its probes (``/ready`` 503, ``/health`` 200).

With ``--api-workers N``, the engine process binds this port as it binds the client port, and
every front-end serves it, as each serves the client port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, ClassVar

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.server import ServerState

from embedding_server.api.connections import GuardedHttpToolsProtocol
from embedding_server.api.errors import error_response
from embedding_server.probe_room import to_close

logger = logging.getLogger(__name__)

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics", "/golden"})
"""What the probe port serves: the kubelet's probes, Prometheus's scrape and the golden
vectors the operator records."""

PROBE_MAX_CONNECTIONS = 64
"""Open connections the probe port takes (a kubelet probes each container every few seconds,
one connection at a time)."""

STOP_WAIT_S = 2.0
"""How long stopping waits for the probe port's open connections to end."""


class ProbesOnly:
    """The application, but only its :data:`PROBE_PATHS`: a 404 for anything else."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PROBE_PATHS:
            response = error_response(
                404,
                "The probe port serves only /health, /ready, /metrics and /golden; "
                "send other requests to the server's port.",
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class ProbeProtocol(GuardedHttpToolsProtocol):
    """The guarded protocol, but a connection past the cap makes room: one open connection
    that is still sending its request (or idle between requests) is closed, chosen by
    :func:`embedding_server.probe_room.to_close`."""

    max_connections: ClassVar[int] = PROBE_MAX_CONNECTIONS

    def _make_room(self) -> bool:
        others = sorted(
            (
                c
                for c in self.connections
                if c is not self and isinstance(c, GuardedHttpToolsProtocol)
            ),
            key=lambda c: c.opened_at,
        )
        closed = to_close((c, c.transport, c.waiting_for_request) for c in others)
        if closed is None:
            return False
        closed.refuse_busy()
        return True


class ProbeListener:
    """The probe port of one HTTP process: started beside uvicorn's server, on its loop."""

    def __init__(self, sockets: list[socket.socket], config: uvicorn.Config) -> None:
        self.sockets = sockets
        self.config = config
        self.state = ServerState()
        self._servers: list[asyncio.Server] = []

    async def start(self) -> None:
        config = self.config
        if not config.loaded:
            config.load()
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.state, app_state={}, _loop=loop
            )

        for sock in self.sockets:
            self._servers.append(
                await loop.create_server(protocol, sock=sock, backlog=config.backlog)
            )
        host, port = self.sockets[0].getsockname()[:2]
        logger.info("probes (/health, /ready, /metrics, /golden) also on %s:%d", host, port)

    async def stop(self) -> None:
        """Stop accepting, end the open connections (bounded)."""
        for server in self._servers:
            server.close()
        for connection in list(self.state.connections):
            connection.shutdown()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_WAIT_S):
                while self.state.connections:
                    await asyncio.sleep(0.05)


def probe_config(base: uvicorn.Config, app: ASGIApp, http: Any) -> uvicorn.Config:
    """uvicorn's configuration of the probe port: the client port's, serving
    :class:`ProbesOnly` with ``http``, without the lifespan (the client port's runs it)."""
    return uvicorn.Config(
        ProbesOnly(app),
        log_config=None,
        access_log=False,
        http=http,
        h11_max_incomplete_event_size=base.h11_max_incomplete_event_size,
        timeout_keep_alive=base.timeout_keep_alive,
        lifespan="off",
        log_level=base.log_level,
        server_header=False,
        proxy_headers=False,
    )
