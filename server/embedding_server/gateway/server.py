"""Run the gateway: build its discovery from the settings and serve until a signal."""

from __future__ import annotations

import asyncio
import logging
import socket

from aiohttp import web

from embedding_server.gateway.discovery import Discovery, StaticDiscovery
from embedding_server.gateway.proxy import Gateway
from embedding_server.gateway.settings import GatewaySettings
from embedding_server.logging import configure_logging

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT = 30.0
"""Seconds in-flight requests get to finish after SIGTERM before the gateway exits."""


def build_discovery(settings: GatewaySettings) -> Discovery:
    """The discovery source the settings name (a bad routes file fails here, at start)."""
    if settings.discovery == "kubernetes":
        from embedding_server.gateway.kubernetes import KubernetesDiscovery

        return KubernetesDiscovery.in_cluster(settings.namespace)
    return StaticDiscovery(settings.routes or (), settings.routes_file)


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (it ships with uvicorn[standard]): a proxy's time is the
    event loop's, and uvloop's is about half of asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_gateway(settings: GatewaySettings) -> int:
    """Serve until SIGTERM/SIGINT, then let in-flight requests finish; exit status."""
    configure_logging(settings.log_level, settings.log_format)
    try:
        discovery = build_discovery(settings)
        # Reads --bulk-api-keys-file: a file that is missing or not text stops it here.
        app = Gateway(settings, discovery).app()
    except (OSError, ValueError) as error:
        logger.error("cannot start the gateway: %s", error)
        return 2
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    listener = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((settings.host, settings.port))
    logger.info(
        "gateway listening on %s:%d (%s discovery, %s)",
        settings.host,
        settings.port,
        settings.discovery,
        settings.balancing,
    )
    web.run_app(
        app,
        sock=listener,
        access_log=None,
        print=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT,
        loop=loop,
        handle_signals=True,
        # A client that hangs up stops its request here too: a held one leaves the holding
        # queue (so the held-requests gauge an autoscaler reads counts only live demand), and
        # a forwarded one closes its upstream connection, which cancels its work on the pod.
        handler_cancellation=True,
    )
    return 0
