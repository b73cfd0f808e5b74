"""Running the HTTP application under uvicorn: drain on a signal, exit status from the
lifecycle. Used by the single-process server and by each ``--api-workers`` front-end."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import threading
import types
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from embedding_server.api.connections import guarded_protocol
from embedding_server.api.lifecycle import Lifecycle
from embedding_server.api.probes import (
    PROBE_MAX_CONNECTIONS,
    ProbeListener,
    ProbeProtocol,
    probe_config,
)
from embedding_server.settings import ServerSettings

logger = logging.getLogger(__name__)

FATAL_EXIT_GRACE_S = 10.0
"""After a fatal error (the model failed to load, a tensor-parallel rank died or hangs, the
engine process is gone) the server shuts down as usual, but exits with status 1 at the latest
this long after."""


class DrainingServer(uvicorn.Server):
    """uvicorn, but readiness drops to 503 the moment a stop signal arrives.

    uvicorn itself then stops accepting connections and waits for in-flight requests. The
    probe port (``probes``), when there is one, listens once the client port does and stops
    after it has drained.
    """

    def __init__(
        self, config: uvicorn.Config, lifecycle: Lifecycle, probes: ProbeListener | None = None
    ) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.probes = probes

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.probes is not None and self.started:
            await self.probes.start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets=sockets)
        if self.probes is not None:
            await self.probes.stop()

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        self.lifecycle.begin_drain(reason=signal.Signals(sig).name)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Like uvicorn's, without re-raising the signal after shutdown: a drain that
        finished is a success, and Kubernetes should see exit status 0, not 143."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_http(
    settings: ServerSettings,
    app: FastAPI,
    sockets: list[socket.socket] | None = None,
    probe_sockets: list[socket.socket] | None = None,
) -> int:
    """Serve ``app`` (on ``sockets`` when given, else on the settings' host and port) until a
    signal or a fatal error; return the process exit status. With ``--probe-port``, the
    probes are served on ``probe_sockets`` too (else on a socket bound here)."""
    lifecycle: Lifecycle = app.state.lifecycle
    http: str | type[asyncio.Protocol] = "h11"
    probe_http: str | type[asyncio.Protocol] = "h11"
    if importlib.util.find_spec("httptools") is not None:
        # httptools (uvicorn[standard]) with the header, timeout and connection bounds.
        http = guarded_protocol(settings)
        probe_http = guarded_protocol(
            settings, ProbeProtocol, max_connections=PROBE_MAX_CONNECTIONS
        )
    else:
        logger.warning(
            "httptools is not installed: serving with h11, which bounds header size but "
            "not --header-timeout or --max-connections"
        )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        loop=best_available("uvloop", "asyncio"),
        http=http,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]
        lifespan="on",
        timeout_graceful_shutdown=int(max(1.0, settings.shutdown_timeout)),
        log_level=settings.log_level,
        server_header=False,
        # Nothing here reads the client's address; the forwarded-headers layer would be
        # one more step on every request.
        proxy_headers=False,
    )
    probes = None
    if settings.probe_port is not None:
        if probe_sockets is None:
            try:
                probe_sockets = [listen(settings.host, settings.probe_port)]
            except OSError as error:
                logger.error(
                    "cannot listen on %s:%d (--probe-port): %s",
                    settings.host,
                    settings.probe_port,
                    error,
                )
                return 1
        probes = ProbeListener(probe_sockets, probe_config(config, app, probe_http))
    server = DrainingServer(config, lifecycle, probes)

    def fatal() -> None:
        server.should_exit = True
        # A forward pass blocked in a collective of a failed tensor-parallel group may never
        # return; a failed server must still exit, so it is ended after a grace period.
        timer = threading.Timer(FATAL_EXIT_GRACE_S, os._exit, args=(lifecycle.exit_code or 1,))
        timer.daemon = True
        timer.start()

    lifecycle.on_fatal = fatal
    server.run(sockets=sockets)
    if lifecycle.exit_code == 0 and not server.started:
        return 1  # e.g. the port was taken; uvicorn logged why
    return int(lifecycle.exit_code)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (not yet listening), inheritable by the
    front-end processes of ``--api-workers``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets whose protocol says TCP.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def best_available(preferred: str, fallback: str) -> str:
    """``preferred`` if that module is installed, else ``fallback`` (uvicorn's loop, http)."""
    return preferred if importlib.util.find_spec(preferred) is not None else fallback
