"""Run the gateway: build its discovery from the settings and serve until a signal."""

from __future__ import annotations

import asyncio
import contextlib
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
        from embedding_server.gateway.kubernetes import KubernetesDiscovery, ReservedNames

        reserved = ReservedNames(settings.reserved_model_names)
        return KubernetesDiscovery.in_cluster(settings.namespace, reserved)
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
        gateway = Gateway(settings, discovery)
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
    probes = None
    if settings.probe_port is not None:
        probes = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
        probes.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probes.bind((settings.host, settings.probe_port))
        logger.info("probes (/health, /ready, /metrics) also on %s:%d", *probes.getsockname()[:2])
    main = loop.create_task(_serve(gateway, listener, probes))
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass  # SIGTERM or SIGINT (the runner's signal handlers raise GracefulExit)
    finally:
        # What web.run_app does: stop serving (the runner's cleanup lets in-flight requests
        # finish within SHUTDOWN_TIMEOUT), then end whatever is left.
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(main)
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    return 0


async def _serve(
    gateway: Gateway, listener: socket.socket, probes: socket.socket | None = None
) -> None:
    """Serve on ``listener`` until cancelled, each connection behind the gateway's
    connection bounds (:mod:`embedding_server.gateway.connections`), then shut down; and
    the probes on ``probes`` (``--probe-port``), started after the client port and stopped
    after it has drained, so a stopping gateway still answers them."""
    runner = gateway.runner(handle_signals=True, shutdown_timeout=SHUTDOWN_TIMEOUT)
    await runner.setup()
    listening = await gateway.guard.listen(runner, listener)
    probe_runner = probe_listening = None
    if probes is not None:
        probe_runner = web.AppRunner(gateway.probe_app(), access_log=None, handle_signals=False)
        await probe_runner.setup()
        probe_listening = await gateway.probe_guard.listen(probe_runner, probes)
    try:
        await asyncio.Event().wait()
    finally:
        listening.close()
        await runner.cleanup()
        if probe_listening is not None and probe_runner is not None:
            probe_listening.close()
            await probe_runner.cleanup()
